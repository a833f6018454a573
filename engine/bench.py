"""`kvgate bench engine`: the same greedy workload through kvgate's engine and through HF transformers'
generate (one request at a time, and left-padded batches), on the same model, with throughput ratios."""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

# Random models built on the spot (no download): name -> (config class name, config kwargs).
RANDOM_MODELS = {
    "qwen3-0.5b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                        head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True,
                                        rope_theta=1000000.0, rms_norm_eps=1e-6)),
}


def add_bench_engine_parser(sub) -> None:
    from kvgate.engine.cli_args import add_engine_args

    p = sub.add_parser("engine", help="engine throughput against HF transformers generate")
    p.add_argument("--model", default="demo",
                   help="'demo' (default), a random model built here (" + ", ".join(RANDOM_MODELS) +
                        "), or a local HF folder")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt-len", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--baselines", default="single,batched",
                   help="HF runs to compare with: single, batched, both (default) or none")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--result-file", default=None, help="also write the results as JSON here")
    add_engine_args(p)
    p.set_defaults(func=run_bench_engine)


def _build_random_model(name: str, folder: Path, dtype) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    from kvgate.engine.demo import build_byte_tokenizer, write_tokenizer_files

    cls_name, kwargs = RANDOM_MODELS[name]
    config = getattr(transformers, cls_name)(**kwargs, architectures=[cls_name.replace("Config", "ForCausalLM")])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    config.save_pretrained(str(folder))
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(build_byte_tokenizer(), folder, kwargs["max_position_embeddings"])


def make_workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(min(vocab, 256)) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _hf_generate(model, batch: list[list[int]], output_len: int, pad_id: int, device) -> list[list[int]]:
    """Greedy, exactly output_len new tokens per row, left padding."""
    import torch

    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=output_len,
                             min_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=pad_id)
    return [row[width:].tolist() for row in out]


def run_bench_engine(args: argparse.Namespace) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from kvgate.engine import LLM, SamplingParams
    from kvgate.engine.cli_args import engine_config_from_args
    from kvgate.engine.config import EngineConfig
    from kvgate.engine.llm import resolve_model_path

    tmp = None
    if args.model in RANDOM_MODELS:
        tmp = tempfile.TemporaryDirectory(prefix="kvgate-bench-")
        probe = EngineConfig(model=tmp.name, device=args.device, dtype=args.dtype)
        device = probe.resolve_device()
        dtype = torch.bfloat16 if args.dtype == "auto" and device.type == "cuda" else (
            torch.float32 if args.dtype == "auto" else probe.resolve_dtype(None, device))
        print(f"building random {args.model} ({dtype}) ...", flush=True)
        _build_random_model(args.model, Path(tmp.name), dtype)
        model_path = tmp.name
    else:
        model_path = resolve_model_path(args.model)

    config = engine_config_from_args(model_path, args)
    llm = LLM.from_config(config)
    engine = llm.engine
    device, dtype = engine.device, engine.dtype
    max_prompt = min(args.max_prompt_len, engine.max_model_len - args.output_len)
    prompts = make_workload(args.num_requests, min(args.min_prompt_len, max_prompt), max_prompt,
                            engine.vocab_size, args.workload_seed)
    n_out = args.num_requests * args.output_len
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    print(f"workload: {args.num_requests} requests, prompts {min(map(len, prompts))}-{max(map(len, prompts))} "
          f"tokens (mean {sum(map(len, prompts)) / len(prompts):.0f}), {args.output_len} output tokens each, "
          f"greedy | model {args.model} | device {device} | dtype {dtype}", flush=True)

    results: dict[str, dict] = {}
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=4))  # warm-up
    engine.reset_prefix_cache()
    _sync(device)
    t0 = time.perf_counter()
    ours = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    _sync(device)
    elapsed = time.perf_counter() - t0
    ours_tokens = [o.outputs[0].token_ids for o in ours]
    assert sum(map(len, ours_tokens)) == n_out
    results["kvgate"] = {"seconds": elapsed, "output_tokens_per_s": n_out / elapsed}
    print(f"  kvgate engine: {elapsed:.2f} s", flush=True)
    del llm, engine
    if device.type == "cuda":
        torch.cuda.empty_cache()

    baselines = {"both": ["single", "batched"], "none": []}.get(args.baselines, args.baselines.split(","))
    hf_single = None
    if baselines:
        hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
        pad_id = 0
        _hf_generate(hf, [prompts[0][:16]], 4, pad_id, device)  # warm-up
        for name in baselines:
            size = 1 if name == "single" else args.hf_batch_size
            _sync(device)
            t0 = time.perf_counter()
            outs = []
            for i in range(0, len(prompts), size):
                outs.extend(_hf_generate(hf, prompts[i:i + size], args.output_len, pad_id, device))
            _sync(device)
            elapsed = time.perf_counter() - t0
            label = "hf_single" if size == 1 else f"hf_batched_{size}"
            results[label] = {"seconds": elapsed, "output_tokens_per_s": n_out / elapsed}
            if size == 1:
                hf_single = outs
            print(f"  {label}: {elapsed:.2f} s", flush=True)

    base = results["kvgate"]["output_tokens_per_s"]
    print(f"\n{'system':<28}{'time (s)':>10}{'output tok/s':>15}{'kvgate speed-up':>18}")
    for label, r in results.items():
        ratio = base / r["output_tokens_per_s"]
        r["kvgate_speedup"] = ratio
        print(f"{label:<28}{r['seconds']:>10.2f}{r['output_tokens_per_s']:>15.1f}{ratio:>17.2f}x")
    if hf_single is not None:
        same = sum(a == b for a, b in zip(ours_tokens, hf_single))
        results["greedy_identical_to_hf_single"] = f"{same}/{len(prompts)}"
        print(f"\ngreedy outputs identical to HF one-at-a-time: {same}/{len(prompts)}"
              + ("" if dtype == torch.float32 else " (reduced precision: small divergences are expected)"))
    if args.result_file:
        Path(args.result_file).write_text(json.dumps({
            "model": args.model, "device": str(device), "dtype": str(dtype), "num_requests": args.num_requests,
            "output_len": args.output_len, "results": results}, indent=2))
    if tmp is not None:
        tmp.cleanup()
    return 0
