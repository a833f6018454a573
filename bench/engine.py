"""`kvgate bench engine`: the same workload (greedy, or the realistic sampling mix of engine_sampling.py; prompts
of random lengths or of one --context length each) through kvgate's engine and through HF transformers' generate
(one request at a time, and left-padded batches of kvgate's own batch size or of the sizes given) or vLLM's offline
LLM.generate (engine_vllm.py), on the same model, with throughput ratios. Decode steps are set against the
memory-bandwidth bound at the device's spec bandwidth (device_spec.py) and at the copy bandwidth measured in the run;
--result-file records the numbers with the commit, versions and device (result_record.py)."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from kvgate.bench.engine_sampling import SAMPLING_MIXES

if TYPE_CHECKING:
    from kvgate.engine.config import EngineConfig

# Random models built on the spot (no download): name -> (config class name, config kwargs).
RANDOM_MODELS = {
    "qwen3-0.5b": ("Qwen3Config", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                        head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True,
                                        rope_theta=1000000.0, rms_norm_eps=1e-6)),
    # the same with Qwen3's own context length (40,960 positions), for --context up to 32k
    "qwen3-0.5b-long": ("Qwen3Config", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                             num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                                             head_dim=128, max_position_embeddings=40960, tie_word_embeddings=True,
                                             rope_theta=1000000.0, rms_norm_eps=1e-6)),
    # Qwen3-30B-A3B's layer shape scaled down (hidden 2048 -> 1024, 128 -> 64 experts of 768 -> 384, top-8, 48 -> 12
    # layers; 1.3B parameters, 0.9B of them in the experts): loads in seconds, still routes like the real one.
    "qwen3-moe-tiny": ("Qwen3MoeConfig", dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072,
                                              moe_intermediate_size=384, num_experts=64, num_experts_per_tok=8,
                                              norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                                              num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=4,
                                              head_dim=128, max_position_embeddings=4096, tie_word_embeddings=False,
                                              rope_theta=1000000.0, rms_norm_eps=1e-6)),
}


def add_bench_engine_parser(sub) -> None:
    from kvgate.engine.cli_args import add_engine_args
    from kvgate.engine.config import KV_CACHE_DTYPES

    p = sub.add_parser("engine", help="engine throughput against HF transformers generate or vLLM")
    p.add_argument("--model", default="demo",
                   help="'demo' (default), 'copier' (a tiny model trained here to quote its prompt, for speculative "
                        "decoding), 'copier-wide' (the copier inside a Llama of a 0.37B model's cost), a random model "
                        "built here (" + ", ".join(RANDOM_MODELS) + "), or a local HF folder")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-prompt-len", type=int, default=32)
    p.add_argument("--max-prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--hf-batch-size", type=parse_hf_batch_sizes, default="match",
                   help="HF generate's batch size for the batched baseline: 'match' (default: kvgate's own "
                        "--max-num-seqs, at most --num-requests, so both batch alike) or sizes, comma-separated "
                        "(each is run; the best is reported as hf_best)")
    p.add_argument("--sampling", choices=SAMPLING_MIXES, default="greedy",
                   help="greedy (default: the argmax path) or realistic: temperature 0.7, top-p 0.9, top-k 50, "
                        "repetition penalty 1.05, and one request in 8 with the top 5 logprobs; HF's baselines "
                        "sample alike")
    p.add_argument("--context", type=parse_contexts, default=None,
                   help="long prompts: every prompt exactly N tokens (random tokens, fixed by --workload-seed), "
                        "comma-separated for several lengths, each its own run reported per context (the engine "
                        "needs --max-model-len >= N + --output-len)")
    p.add_argument("--baselines", default="single,batched",
                   help="runs to compare with, comma-separated: HF single, batched, both (default) or none; vllm "
                        "(vLLM's offline LLM.generate, needs --vllm-python)")
    p.add_argument("--vllm-python", default=None,
                   help="with --baselines vllm: an interpreter with vLLM installed (not a kvgate dependency), which "
                        "runs the workload in a child process (default: $KVGATE_VLLM_PYTHON)")
    p.add_argument("--workload-seed", type=int, default=0)
    p.add_argument("--workload", choices=["random", "quote", "shared-prefix"], default=None,
                   help="random: random prompts; quote: each prompt is a random text followed by the start of it "
                        "again, to be continued (repetitive: prompt lookup finds drafts); shared-prefix: one random "
                        "text of --min-prompt-len tokens (a system prompt) followed by each prompt's own random "
                        "tokens, up to --max-prompt-len in all (default: quote with --speculative-config, else "
                        "random)")
    p.add_argument("--hf-first-tokens", action="store_true",
                   help="check every prompt's first generated token against HF's own forward pass of that prompt "
                        "alone (no padding), also with --baselines none (always done when a baseline runs)")
    p.add_argument("--compare-eager", action="store_true",
                   help="also run kvgate with --enforce-eager (no CUDA graphs) on the same workload, side by side")
    p.add_argument("--compare-sync", action="store_true",
                   help="also run kvgate with --no-async-scheduling (each step waits for the one before) on the "
                        "same workload, side by side")
    p.add_argument("--compare-no-backoff", action="store_true",
                   help="with --speculative-config: also run the speculation with adaptive drafting off (every "
                        "step drafts, as in vLLM; EngineConfig.speculative_backoff_threshold 0), side by side")
    p.add_argument("--compare-no-draft-reuse", action="store_true",
                   help="with a draft model: also run the speculation with the draft's prefix reuse off (it computes "
                        "every request's context itself; draft_model.py), side by side")
    p.add_argument("--compare-kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None,
                   help="also run kvgate with this --kv-cache-dtype on the same workload and KV memory, side by "
                        "side: blocks, preemptions, time, outputs against the first run")
    p.add_argument("--compare-moe-reference", action="store_true",
                   help="with a MoE model: also run its experts through the torch reference (torch_experts, one "
                        "batch per expert; eager: it reads the expert counts back to the host) instead of the fused "
                        "Triton kernels, side by side")
    p.add_argument("--result-file", default=None, help="also write the results as JSON here")
    add_engine_args(p)
    p.set_defaults(func=run_bench_engine)


def _build_random_model(name: str, folder: Path, dtype) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    from kvgate.common.demo import build_byte_tokenizer, write_tokenizer_files

    cls_name, kwargs = RANDOM_MODELS[name]
    config = getattr(transformers, cls_name)(**kwargs, architectures=[cls_name.replace("Config", "ForCausalLM")])
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    if getattr(config, "num_experts", 0):  # HF's own writer: the per-expert tensors of the checkpoint format
        model.save_pretrained(str(folder), safe_serialization=True)
    else:
        state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        config.save_pretrained(str(folder))
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    write_tokenizer_files(build_byte_tokenizer(), folder, kwargs["max_position_embeddings"])


def parse_hf_batch_sizes(text: str) -> str | list[int]:
    """--hf-batch-size: "match" or positive sizes, comma-separated (at most 8, each at most 4096)."""
    if text.strip() == "match":
        return "match"
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or len(sizes) > 8 or not all(1 <= x <= 4096 for x in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: 'match' or 1 to 8 sizes from 1 to 4096, comma-separated")
    return sorted(set(sizes))


def parse_contexts(text: str) -> list[int]:
    """--context: prompt lengths in tokens, comma-separated (at most 8, each from 1 to 1,048,576)."""
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        sizes = []
    if not sizes or len(sizes) > 8 or not all(1 <= x <= 1 << 20 for x in sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: 1 to 8 prompt lengths from 1 to 1048576 tokens, comma-separated")
    return list(dict.fromkeys(sizes))  # each length once, in the order given


def make_context_workload(n: int, context: int, vocab: int, seed: int) -> list[list[int]]:
    """n prompts of exactly `context` random tokens each, the same for the same seed."""
    rng = random.Random(seed)
    return [[rng.randrange(min(vocab, 256)) for _ in range(context)] for _ in range(n)]


def make_workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(min(vocab, 256)) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def make_quote_workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts that quote a text: a random text, then its first part again (so its continuation is in the prompt)."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        length = rng.randint(lo, hi)
        text = [rng.randrange(min(vocab, 256)) for _ in range(max(1, (2 * length) // 3))]
        prompts.append((text + text)[:length])
    return prompts


def make_shared_prefix_workload(n: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    """Prompts of one shared random text of lo tokens (a system prompt), each followed by 1 to hi - lo tokens of its
    own (at least one)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(min(vocab, 256)) for _ in range(lo)]
    return [prefix + [rng.randrange(min(vocab, 256)) for _ in range(rng.randint(1, max(1, hi - lo)))]
            for _ in range(n)]


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def _hf_generate(model, batch: list[list[int]], output_len: int, pad_id: int, device,
                 sampling: dict | None = None) -> list[list[int]]:
    """Exactly output_len new tokens per row, left padding; greedy unless `sampling` (generate's sampling
    arguments, engine_sampling.hf_generate_kwargs) says otherwise."""
    import torch

    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(ids.to(device), attention_mask=mask.to(device), max_new_tokens=output_len,
                             min_new_tokens=output_len, eos_token_id=None, pad_token_id=pad_id,
                             **(sampling or {"do_sample": False}))
    return [row[width:].tolist() for row in out]


def _agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """Share of prompts whose first generated token is the same, and the mean length of the common prefix."""
    first = sum(bool(a) and bool(b) and a[0] == b[0] for a, b in zip(ours, theirs))
    common = 0
    for a, b in zip(ours, theirs):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        common += n
    return {"first_token": first / len(ours), "mean_common_prefix": common / len(ours)}


def _hf_first_tokens(model, prompts: list[list[int]], device, logits_out: list | None = None) -> list[int]:
    """HF's greedy first token for each prompt, from one forward pass of the prompt alone (its last-position logits,
    in float32 on the host, appended to logits_out when given)."""
    import torch

    tokens = []
    with torch.inference_mode():
        for p in prompts:
            logits = model(torch.tensor([p], device=device)).logits[0, -1]
            tokens.append(int(logits.argmax()))
            if logits_out is not None:
                logits_out.append(logits.float().cpu())
    return tokens


def _reduced_precision_floor(model_path, dtype, device, prompts, ours: list[int], hf: list[int],
                             hf_logits: list) -> dict:
    """How often two correct reduced-precision forwards agree on the first token: HF itself with its eager attention
    instead of SDPA (same weights and dtype; only the attention kernel's rounding differs), and kvgate and HF each
    against HF in float32. Near-tied logits flip under any change of rounding, so this is the floor an engine's
    agreement with HF is judged against.

    Then which prompts reduced precision can decide at all: HF's own rounding error at the two leading float32
    logits (|HF reduced - HF float32|, its 99th percentile over the prompts: `noise`) against each prompt's float32
    margin between them. Where the margin exceeds twice the noise, two forwards whose rounding is no worse than HF's
    cannot pick differently (each of the two logits moves by at most the noise), so agreement there should be
    complete; every disagreement is also given as the float32 logit gap between the two picks."""
    import torch
    from transformers import AutoModelForCausalLM

    def first_tokens(logits_out=None, **kw):
        model = AutoModelForCausalLM.from_pretrained(model_path, **kw).to(device).eval()
        tokens = _hf_first_tokens(model, prompts, device, logits_out)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        return tokens

    eager = first_tokens(dtype=dtype, attn_implementation="eager")
    fp32_logits: list = []
    fp32 = first_tokens(fp32_logits, dtype=torch.float32)
    n = len(prompts)

    def share(a, b, among=range(n)):
        among = list(among)
        return sum(a[i] == b[i] for i in among) / max(1, len(among))

    floor = {"hf_eager_vs_hf_sdpa": share(eager, hf), "kvgate_vs_hf_float32": share(ours, fp32),
             "hf_sdpa_vs_hf_float32": share(hf, fp32), "hf_eager_vs_hf_float32": share(eager, fp32)}
    print(f"first tokens in {str(dtype).removeprefix('torch.')}: HF with eager attention vs HF with SDPA "
          f"{100 * floor['hf_eager_vs_hf_sdpa']:.1f}% (only the attention kernel differs); against HF float32: "
          f"kvgate {100 * floor['kvgate_vs_hf_float32']:.1f}%, HF SDPA {100 * floor['hf_sdpa_vs_hf_float32']:.1f}%, "
          f"HF eager {100 * floor['hf_eager_vs_hf_float32']:.1f}%", flush=True)

    full = torch.stack(fp32_logits)                        # [n, V] float32
    reduced = torch.stack(hf_logits)                       # [n, V] HF's reduced-precision logits, as float32
    top2 = full.topk(2, dim=-1)
    margin = top2.values[:, 0] - top2.values[:, 1]
    error = (reduced.gather(1, top2.indices) - top2.values).abs().max(dim=-1).values
    noise = float(error.quantile(0.99))
    decided = [i for i in range(n) if float(margin[i]) > 2 * noise]
    rows = torch.arange(n)
    gaps = (full[rows, torch.tensor(hf)] - full[rows, torch.tensor(ours)]).abs()
    differ = [i for i in range(n) if ours[i] != hf[i]]
    floor["decidable"] = {
        "noise_p99": noise, "float32_margin_p50": float(margin.median()), "prompts": len(decided),
        "kvgate_vs_hf": share(ours, hf, decided), "hf_eager_vs_hf_sdpa": share(eager, hf, decided),
        "disagreements_float32_gap": sorted(float(gaps[i]) for i in differ),
    }
    d = floor["decidable"]
    worst = max(d["disagreements_float32_gap"], default=0.0)
    print(f"HF's own {str(dtype).removeprefix('torch.')} error at the two leading logits: p99 {noise:.4f} (float32 "
          f"margin between them: median {d['float32_margin_p50']:.4f}); on the {len(decided)} prompts whose margin "
          f"exceeds twice that, kvgate equals HF for {100 * d['kvgate_vs_hf']:.1f}% (HF eager vs SDPA "
          f"{100 * d['hf_eager_vs_hf_sdpa']:.1f}%); the {len(differ)} disagreements are float32 logit gaps of at most "
          f"{worst:.4f}", flush=True)
    return floor


def _spec_decode_summary(before, after) -> dict:
    """The speculative-decoding counters of the timed run alone (the warm-up's taken off)."""
    s = after.since(before)
    return {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
            "num_accepted_tokens": s.num_accepted_tokens,
            "acceptance_rate": s.num_accepted_tokens / s.num_draft_tokens if s.num_draft_tokens else 0.0,
            "acceptance_rate_per_pos": [round(a / s.num_drafts, 3) if s.num_drafts else 0.0
                                        for a in s.accepted_per_pos],
            "mean_acceptance_length": s.mean_acceptance_length, "num_paused_steps": s.num_paused_steps}


def parse_baselines(text: str) -> tuple[list[str], bool]:
    """--baselines: the HF runs in order ("single", "batched") and whether vLLM runs; a ConfigError names a
    baseline it does not know."""
    from kvgate.common.errors import ConfigError

    hf, vllm = [], False
    for name in filter(None, (n.strip() for n in text.split(","))):
        if name == "vllm":
            vllm = True
        elif name in ("single", "batched", "both", "none"):
            hf.extend(n for n in {"both": ["single", "batched"], "none": []}.get(name, [name]) if n not in hf)
        else:
            raise ConfigError(f"--baselines: unknown baseline {name!r} (single, batched, both, none, vllm)")
    return hf, vllm


def run_bench_engine(args: argparse.Namespace) -> int:
    from kvgate.bench.engine_vllm import vllm_python
    from kvgate.bench.result_record import write_result
    from kvgate.engine.cli_args import engine_config_from_args

    hf_baselines, with_vllm = parse_baselines(args.baselines)
    if with_vllm and args.sampling != "greedy":
        raise SystemExit("kvgate bench engine: --baselines vllm runs greedy only (use --sampling greedy)")
    python = vllm_python(args) if with_vllm else None  # refused here, before any model is built
    model_path, tmp = _model_path(args)
    config = engine_config_from_args(model_path, args)
    try:
        by_context = {}
        for context in args.context or [None]:
            if context is not None:
                print(f"\n=== context {context} tokens", flush=True)
            by_context[str(context)] = _bench_one_workload(args, config, model_path, hf_baselines, python, context)
        if args.result_file:
            last = by_context[str((args.context or [None])[-1])]
            record = {"model": args.model, "device": last["device"], "dtype": last["dtype"],
                      "num_requests": args.num_requests, "output_len": args.output_len,
                      "sampling": last["sampling"], "bandwidth": last["bandwidth"],
                      "copy_bandwidth_gbs": last["bandwidth"]["copy_gbs"]}
            if args.context:
                record["by_context"] = {c: {k: r[k] for k in ("results", "sampling", "bandwidth")}
                                        for c, r in by_context.items()}
            else:
                record["results"] = last["results"]
            write_result(args.result_file, record, last["torch_device"])
    finally:
        if tmp is not None:
            tmp.cleanup()
    return 0


def _bench_one_workload(args: argparse.Namespace, config: EngineConfig, model_path: str, hf_baselines: list[str],
                        python: str | None, context: int | None) -> dict:
    """Every kvgate run, the HF and vLLM baselines and the comparison of one workload (one --context length, or
    the random-length prompts), printed; its results, sampling mix and bandwidths."""
    import torch

    spec = config.speculative_config
    workload = "context" if context is not None else (args.workload or ("quote" if spec is not None else "random"))
    results: dict[str, dict] = {}
    work: _Workload | None = None
    ours_tokens = None  # the first run's outputs, which every other run and HF are compared with
    for label, run_config in _planned_runs(args, config):
        run = _run_kvgate(label, run_config, args, workload, spec, work, ours_tokens, context)
        work, results[label], device, dtype = run.work, run.result, run.device, run.dtype
        if ours_tokens is None:
            ours_tokens = run.tokens
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if spec is not None:
        _speculation_speed_ups(results)
    hf_single, hf_outputs = _hf_baselines(args, hf_baselines, model_path, device, dtype, work, ours_tokens, results)
    if python is not None:
        _vllm_baseline(python, model_path, dtype, work, ours_tokens, results)
    _print_comparison(args, results, work, ours_tokens, hf_single, hf_outputs, dtype)
    if context is not None:
        results["context_tokens"] = context
    return {"results": results, "sampling": work.sampling, "bandwidth": work.bandwidth_record(),
            "device": str(device), "dtype": str(dtype), "torch_device": device}


def _model_path(args: argparse.Namespace) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """The model folder --model names; a random model is built in a temporary folder, returned to be cleaned up."""
    import torch

    from kvgate.engine.config import EngineConfig
    from kvgate.engine.llm import resolve_model_path

    if args.model not in RANDOM_MODELS:
        return resolve_model_path(args.model), None
    tmp = tempfile.TemporaryDirectory(prefix="kvgate-bench-")
    probe = EngineConfig(model=tmp.name, device=args.device, dtype=args.dtype)
    device = probe.resolve_device()
    dtype = torch.bfloat16 if args.dtype == "auto" and device.type == "cuda" else (
        torch.float32 if args.dtype == "auto" else probe.resolve_dtype(None, device))
    print(f"building random {args.model} ({dtype}) ...", flush=True)
    _build_random_model(args.model, Path(tmp.name), dtype)
    return tmp.name, tmp


def _planned_runs(args: argparse.Namespace, config: EngineConfig) -> list[tuple[str, EngineConfig]]:
    """(label, EngineConfig) of each kvgate run, the first the one the others and HF are compared with: with
    speculation, the same run without it first (the speed-up's baseline); then each --compare-* variant that
    differs from the flags given."""
    spec = config.speculative_config
    runs = [("kvgate", config)]
    if spec is not None:
        runs = [("kvgate", dataclasses.replace(config, speculative_config=None)), ("kvgate_spec", config)]
    if args.compare_no_backoff and spec is not None and config.speculative_backoff_threshold > 0:
        runs.append(("kvgate_spec_no_backoff", dataclasses.replace(config, speculative_backoff_threshold=0.0)))
    if args.compare_no_draft_reuse and spec is not None and spec.method == "draft_model":
        runs.append(("kvgate_spec_no_draft_reuse", config))
    if args.compare_eager and not config.enforce_eager:
        runs.append(("kvgate_eager", dataclasses.replace(config, enforce_eager=True)))
    if args.compare_sync and config.async_scheduling is not False:
        runs.append(("kvgate_sync", dataclasses.replace(config, async_scheduling=False)))
    if args.compare_kv_cache_dtype and args.compare_kv_cache_dtype != config.kv_cache_dtype:
        runs.append((f"kvgate_kv_{args.compare_kv_cache_dtype}",
                     dataclasses.replace(config, kv_cache_dtype=args.compare_kv_cache_dtype)))
    if args.compare_moe_reference:
        runs.append(("kvgate_moe_torch", dataclasses.replace(config, enforce_eager=True)))
    return runs


def _moe_experts(runner) -> str | None:
    """The name of the function the model's MoE layers run their experts through; None without MoE layers."""
    from kvgate.engine.models.moe import FusedMoE

    model = getattr(runner, "model", None)
    layer = next((m for m in model.modules() if isinstance(m, FusedMoE)), None) if model is not None else None
    return layer.experts_fn.__name__ if layer is not None else None


def _use_torch_experts(engine) -> int:
    """Every FusedMoE of the engine's model back on torch_experts (the reference); how many were switched."""
    from kvgate.engine.models.moe import FusedMoE, torch_experts

    model = getattr(engine.runner, "model", None)
    if model is None:
        raise SystemExit("--compare-moe-reference needs the model in this process (not the sim backend, not tensor "
                         "parallel workers)")
    layers = [m for m in model.modules() if isinstance(m, FusedMoE)]
    for layer in layers:
        layer.experts_fn = torch_experts
    return len(layers)


@dataclasses.dataclass
class _Workload:
    """What every run generates, made once the first engine tells its vocabulary and context length."""
    prompts: list[list[int]]
    params: list  # one SamplingParams per prompt (engine_sampling.py), exactly --output-len tokens each
    n_out: int  # output tokens of one run
    bandwidth: float  # the device's copy bandwidth, bytes/s: the decode steps' bound
    sampling: dict  # the sampling mix as recorded (engine_sampling.describe_mix)
    spec: object = None  # device_spec.SpecBandwidth of the device; None where the table has none (a CPU)
    device_name: str = ""

    @property
    def greedy(self) -> bool:
        return self.sampling["mix"] == "greedy"

    def bandwidth_record(self) -> dict:
        """Both bandwidths the bound is given against, as the result file records them."""
        return {"device_name": self.device_name, "copy_gbs": self.bandwidth / 1e9,
                "spec_gbs": self.spec.bytes_per_s / 1e9 if self.spec else None,
                "spec_entry": self.spec.name if self.spec else None,
                "headline_bound": "spec" if self.spec else "copy (no spec bandwidth for this device)"}


def _workload_for(args: argparse.Namespace, workload: str, engine, context: int | None = None) -> _Workload:
    from kvgate.bench.device_spec import spec_bandwidth
    from kvgate.bench.engine_roofline import copy_bandwidth
    from kvgate.bench.engine_sampling import describe_mix, sampling_params_for
    from kvgate.bench.result_record import device_name

    device, dtype = engine.device, engine.dtype
    if context is not None:
        if context + args.output_len > engine.max_model_len:
            raise SystemExit(f"kvgate bench engine: --context {context} + --output-len {args.output_len} exceeds the "
                             f"engine's context length {engine.max_model_len} (raise --max-model-len)")
        prompts = make_context_workload(args.num_requests, context, engine.vocab_size, args.workload_seed)
    else:
        max_prompt = min(args.max_prompt_len, engine.max_model_len - args.output_len)
        make = {"quote": make_quote_workload, "shared-prefix": make_shared_prefix_workload}.get(workload,
                                                                                               make_workload)
        prompts = make(args.num_requests, min(args.min_prompt_len, max_prompt), max_prompt, engine.vocab_size,
                       args.workload_seed)
    params = sampling_params_for(args.sampling, args.num_requests, args.output_len)
    sampling = describe_mix(args.sampling, params)
    print(f"workload: {args.num_requests} requests, prompts {min(map(len, prompts))}-"
          f"{max(map(len, prompts))} tokens (mean {sum(map(len, prompts)) / len(prompts):.0f}), "
          f"{args.output_len} output tokens each, {_mix_line(sampling)}, {workload} | model {args.model} | "
          f"device {device} | dtype {dtype}", flush=True)
    bandwidth = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (1 << 27))
    name = device_name(device)
    spec = spec_bandwidth(name) if device.type == "cuda" else None
    print(f"device {name}: copy bandwidth (read + write) {bandwidth / 1e9:.0f} GB/s measured; "
          + (f"spec bandwidth {spec.bytes_per_s / 1e9:.0f} GB/s ({spec.name}): the bound's headline is against it"
             if spec else "no spec bandwidth for this device (not in bench/device_spec.py): the bound is against "
                          "the measured copy bandwidth only"), flush=True)
    return _Workload(prompts, params, args.num_requests * args.output_len, bandwidth, sampling, spec, name)


def _mix_line(sampling: dict) -> str:
    if sampling["mix"] == "greedy":
        return "greedy"
    settings = ", ".join(f"{k.replace('_', '-')} {v}" for k, v in sampling["settings"].items())
    return (f"sampled ({settings}; {sampling['logprobs_requests']} of {sampling['requests']} with top-"
            f"{sampling['logprobs_top']} logprobs)")


def _with_spec_bound(decode: dict, work: _Workload) -> dict:
    """The decode summary with its bound also at the spec bandwidth (the headline), where the device has one: the
    same bytes, so the fraction scales by copy / spec bandwidth."""
    if not decode.get("decode_steps"):
        return decode
    decode["fraction_of_copy_bound"] = decode["fraction_of_bound"]
    if work.spec is None:
        decode["fraction_of_spec_bound"] = decode["mean_bound_spec_ms"] = None
        return decode
    scale = work.bandwidth / work.spec.bytes_per_s
    decode["mean_bound_spec_ms"] = decode["mean_bound_ms"] * scale
    decode["fraction_of_spec_bound"] = decode["fraction_of_bound"] * scale
    decode["full_batch_median_bound_spec_ms"] = decode["full_batch_median_bound_ms"] * scale
    return decode


@dataclasses.dataclass
class _Run:
    """One kvgate run's outcome; the engine itself is gone."""
    work: _Workload
    result: dict
    tokens: list[list[int]]
    device: object  # torch.device
    dtype: object  # torch.dtype


def _run_kvgate(label: str, run_config: EngineConfig, args: argparse.Namespace, workload: str, spec,
                work: _Workload | None, ours_tokens: list[list[int]] | None, context: int | None = None) -> _Run:
    """One engine of `run_config` through the workload (made here on the first run), timed, compared with the
    first run's outputs (`ours_tokens`), printed."""
    from kvgate.engine import LLM

    llm = LLM.from_config(run_config)
    engine = llm.engine
    if label == "kvgate_spec_no_draft_reuse":
        engine.runner.draft.reuse_prefix = False
    if label == "kvgate_moe_torch":
        if not _use_torch_experts(engine):
            raise SystemExit("--compare-moe-reference: the model has no MoE layers")
    work = work or _workload_for(args, workload, engine, context)
    stats_before = engine.stats()
    info = _engine_info(label, engine, run_config, stats_before)
    elapsed, outs, decode = _timed_generate(llm, work, info, stats_before.num_preemptions)
    decode = _with_spec_bound(decode, work)
    tokens = [o.outputs[0].token_ids for o in outs]
    assert sum(map(len, tokens)) == work.n_out
    info["max_num_seqs"] = engine.config.max_num_seqs
    if ours_tokens is not None and work.greedy:  # sampled outputs are not comparable token by token
        same = sum(a == b for a, b in zip(tokens, ours_tokens))
        info["greedy_identical_to_kvgate"] = f"{same}/{len(work.prompts)}"
        info["mean_common_prefix_with_kvgate"] = _agreement(tokens, ours_tokens)["mean_common_prefix"]
        print(f"  {label}: greedy outputs identical to the first run: {same}/{len(work.prompts)} (mean common prefix "
              f"{info['mean_common_prefix_with_kvgate']:.1f} of {args.output_len} tokens)", flush=True)
    result = {"seconds": elapsed, "output_tokens_per_s": work.n_out / elapsed, **info, "decode": decode}
    print(f"  {label}: {elapsed:.2f} s (async scheduling {'on' if engine.async_scheduling else 'off'}; "
          f"{info['num_preemptions']} preemptions)", flush=True)
    if "spec_decode" in info:
        _print_spec_decode(info["spec_decode"], spec)
    if decode["decode_steps"]:
        _print_decode_steps(decode, work)
    return _Run(work, result, tokens, engine.device, engine.dtype)


def _engine_info(label: str, engine, run_config, stats_before) -> dict:
    """How the engine runs (attention, CUDA graphs, async scheduling, KV cache), printed."""
    runner = engine.runner
    shapes = getattr(runner, "shapes", None)
    info = {"attention_backend": getattr(runner, "attention_backend", run_config.backend),
            "cuda_graphs": bool(shapes and shapes.graphs), "async_scheduling": engine.async_scheduling,
            "kv_cache_dtype": run_config.kv_cache_dtype, "kv_cache_blocks": stats_before.num_blocks,
            "kv_cache_tokens": stats_before.num_blocks * stats_before.block_size}
    print(f"  {label}: KV cache {run_config.kv_cache_dtype}: {stats_before.num_blocks} blocks "
          f"({info['kv_cache_tokens']} tokens)", flush=True)
    experts = _moe_experts(runner)
    if experts:
        info["moe_experts"] = experts
        print(f"  {label}: MoE experts through {experts}", flush=True)
    if info["cuda_graphs"]:
        info["graph_capture_s"] = shapes.capture_seconds
        info["graph_memory_gib"] = shapes.capture_bytes / 2**30
        print(f"  {label}: {len(shapes.graphs)} CUDA graphs captured in {info['graph_capture_s']:.1f} s, "
              f"{info['graph_memory_gib']:.2f} GiB", flush=True)
    return info


def _timed_generate(llm, work: _Workload, info: dict, preemptions_before: int) -> tuple[float, list, dict]:
    """The workload through `llm` after a short warm-up, from an empty prefix cache: seconds, outputs and the
    decode steps against their bound; the run's preemptions and speculative-decoding counters go into `info`."""
    from kvgate.bench.engine_roofline import StepTimer, kv_bytes_per_token
    from kvgate.engine import SamplingParams

    engine = llm.engine
    runner, device = engine.runner, engine.device
    llm.generate([{"prompt_token_ids": work.prompts[0][:16]}], SamplingParams(max_tokens=4))  # warm-up
    engine.reset_prefix_cache()
    # The sim backend (--backend sim) has no weights: no bound to compare with, only the engine's own time.
    timer = None
    if hasattr(runner, "model"):
        held, stored = _weights_read(engine, info)
        timer = StepTimer(engine, work.bandwidth, held, kv_bytes_per_token(runner), stored)
    spec_before = engine.stats().spec_decode
    draft = getattr(runner, "draft", None)  # a draft model's proposer: its own counters (prefix reuse)
    draft_before = dataclasses.replace(draft.stats) if draft is not None else None
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in work.prompts], work.params)
    _sync(device)
    elapsed = time.perf_counter() - t0
    # Preemptions of the timed run (its warm-up has none: one short request)
    info["num_preemptions"] = engine.stats().num_preemptions - preemptions_before
    if spec_before is not None:
        info["spec_decode"] = _spec_decode_summary(spec_before, engine.stats().spec_decode)
        if draft is not None:
            info["spec_decode"]["draft_model"] = dataclasses.asdict(draft.stats.since(draft_before))
    if timer is None:
        return elapsed, outs, {"decode_steps": 0}
    timer.close()
    return elapsed, outs, timer.summary()


def _weights_read(engine, info: dict):
    """(the weight bytes a decode step reads, the checkpoint's as stored where the engine holds more: a quantized
    checkpoint dequantized at load; else None), into `info` and printed."""
    from kvgate.bench.engine_roofline import stored_weight_bytes, weight_bytes

    held = weight_bytes(engine.runner.model)
    stored = stored_weight_bytes(engine.runner.model, engine.config.model)
    quantization = engine.quantization
    info["weight_bytes_held"], info["weight_bytes_checkpoint"] = held.total, stored.total
    info["quantization"] = quantization.line() if quantization is not None else "dense"
    print(f"  weights: {info['weight_bytes_held'] / 2**20:.1f} MiB held by the engine "
          f"({str(engine.dtype).removeprefix('torch.')}), {info['weight_bytes_checkpoint'] / 2**20:.1f} MiB in the "
          f"checkpoint ({info['quantization']}"
          + ("; the bound counts the held bytes" if quantization is not None else "") + ")",
          flush=True)
    return held, (stored if quantization is not None else None)


def _print_spec_decode(s: dict, spec) -> None:
    source = (f"draft model {spec.model}" if spec.method == "draft_model"
              else f"n-grams {spec.prompt_lookup_min}-{spec.prompt_lookup_max}")
    print(f"    speculative decoding ({spec.method}, K={spec.num_speculative_tokens}, {source}): "
          f"{s['num_drafts']} drafts, "
          f"{s['num_accepted_tokens']}/{s['num_draft_tokens']} draft tokens accepted "
          f"({100 * s['acceptance_rate']:.1f}%; per position {s['acceptance_rate_per_pos']}), "
          f"mean acceptance length {s['mean_acceptance_length']:.2f}; decode steps without drafts by "
          f"adaptive drafting {s['num_paused_steps']}", flush=True)
    if "draft_model" in s:
        d = s["draft_model"]
        print(f"    draft model: {d['computed_tokens']} positions computed ({d['catch_up_tokens']} catching up "
              f"on context), {d['reused_tokens']} context positions skipped by prefix reuse", flush=True)


def _print_decode_steps(decode: dict, work: _Workload) -> None:
    print(f"    decode-only steps: {decode['decode_steps']} (mean batch {decode['mean_batch']:.0f}), "
          f"{decode['mean_step_ms']:.2f} ms a step ({decode['mean_execute_ms']:.2f} ms in the runner; host "
          f"work {decode['mean_host_ms']:.2f} ms, waiting for the device {decode['mean_wait_ms']:.2f} ms) "
          f"against a bound of {decode['mean_bound_ms']:.2f} ms (weights + KV at the copy bandwidth): "
          f"{100 * decode['fraction_of_bound']:.1f}% of the bound "
          f"({100 * decode['fraction_of_bound_execute']:.1f}% counting the runner alone); "
          f"at the full batch of {decode['full_batch']}: {decode['full_batch_median_step_ms']:.2f} ms vs "
          f"{decode['full_batch_median_bound_ms']:.2f} ms", flush=True)
    if decode.get("fraction_of_spec_bound") is not None:
        print(f"    against the spec bandwidth ({work.spec.name}, {work.spec.bytes_per_s / 1e12:.2f} TB/s; the "
              f"headline): bound {decode['mean_bound_spec_ms']:.2f} ms a step, "
              f"{100 * decode['fraction_of_spec_bound']:.1f}% of it (against the copy bandwidth "
              f"{work.bandwidth / 1e12:.2f} TB/s: {100 * decode['fraction_of_copy_bound']:.1f}%)", flush=True)
    else:
        print(f"    no spec bandwidth for {work.device_name or 'this device'}: the bound above is against the measured "
              f"copy bandwidth only", flush=True)
    if "mean_bound_stored_weights_ms" in decode:
        print(f"    with the weights read as the checkpoint stores them (quantized kernels), the bound would be "
              f"{decode['mean_bound_stored_weights_ms']:.2f} ms a step", flush=True)


def _speculation_speed_ups(results: dict) -> None:
    """Each speculative run's speed-up against the first run (the same without speculation), printed."""
    s = results["kvgate_spec"]
    s["speedup_vs_no_speculation"] = results["kvgate"]["seconds"] / s["seconds"]
    print(f"speculative decoding: mean acceptance length {s['spec_decode']['mean_acceptance_length']:.2f}, "
          f"speed-up {s['speedup_vs_no_speculation']:.2f}x against the same run without speculation "
          f"({results['kvgate']['seconds']:.2f} s -> {s['seconds']:.2f} s); greedy outputs identical: "
          f"{s.get('greedy_identical_to_kvgate', 'n/a (sampled)')}", flush=True)
    if "kvgate_spec_no_backoff" in results:
        s = results["kvgate_spec_no_backoff"]
        s["speedup_vs_no_speculation"] = results["kvgate"]["seconds"] / s["seconds"]
        print(f"  without adaptive drafting: mean acceptance length "
              f"{s['spec_decode']['mean_acceptance_length']:.2f}, speed-up {s['speedup_vs_no_speculation']:.2f}x "
              f"({s['seconds']:.2f} s); greedy outputs identical: "
              f"{s.get('greedy_identical_to_kvgate', 'n/a (sampled)')}", flush=True)
    if "kvgate_spec_no_draft_reuse" in results:
        s = results["kvgate_spec_no_draft_reuse"]
        s["speedup_vs_no_speculation"] = results["kvgate"]["seconds"] / s["seconds"]
        with_reuse = results["kvgate_spec"]["spec_decode"]["draft_model"]["computed_tokens"]
        print(f"  without the draft's prefix reuse: {s['spec_decode']['draft_model']['computed_tokens']} draft "
              f"positions computed against {with_reuse}, speed-up {s['speedup_vs_no_speculation']:.2f}x "
              f"({s['seconds']:.2f} s); greedy outputs identical: "
              f"{s.get('greedy_identical_to_kvgate', 'n/a (sampled)')}", flush=True)


def _hf_baselines(args: argparse.Namespace, baselines: list[str], model_path: str, device, dtype,
                  work: _Workload, ours_tokens: list[list[int]], results: dict) -> tuple[list | None, list | None]:
    """HF transformers on the same model and workload: first tokens of each prompt alone, then each of `baselines`
    ("single", "batched") timed. Its outputs one at a time (None without that baseline), and those of the first
    baseline run."""
    if not (baselines or args.hf_first_tokens):
        return None, None
    from transformers import AutoModelForCausalLM

    from kvgate.bench.engine_sampling import hf_generate_kwargs

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device).eval()
    pad_id = 0
    sampling = hf_generate_kwargs(work.sampling["mix"])
    _hf_generate(hf, [work.prompts[0][:16]], 4, pad_id, device, sampling)  # warm-up
    if work.greedy:  # a sampled first token is not HF's argmax
        _hf_first_token_check(hf, model_path, device, dtype, work.prompts, ours_tokens, results)
    hf_single = hf_outputs = None
    sizes = [1 if name == "single" else size for name in baselines
             for size in ([1] if name == "single" else hf_batch_sizes(args, results["kvgate"]["max_num_seqs"]))]
    for size in sizes:
        _sync(device)
        t0 = time.perf_counter()
        outs = []
        for i in range(0, len(work.prompts), size):
            outs.extend(_hf_generate(hf, work.prompts[i:i + size], args.output_len, pad_id, device, sampling))
        _sync(device)
        elapsed = time.perf_counter() - t0
        label = "hf_single" if size == 1 else f"hf_batched_{size}"
        results[label] = {"seconds": elapsed, "output_tokens_per_s": work.n_out / elapsed, "batch_size": size}
        if size == 1 and work.greedy:
            hf_single = outs
        hf_outputs = hf_outputs or (outs if work.greedy else None)
        print(f"  {label}: {elapsed:.2f} s", flush=True)
    _best_hf(results, results["kvgate"]["max_num_seqs"])
    return hf_single, hf_outputs


def hf_batch_sizes(args: argparse.Namespace, kvgate_batch: int) -> list[int]:
    """The batched baseline's sizes: kvgate's own --max-num-seqs with --hf-batch-size match (at most the number of
    requests: neither runs a larger batch), else the sizes given."""
    if args.hf_batch_size == "match":
        return [max(1, min(kvgate_batch, args.num_requests))]
    return list(args.hf_batch_size)


def _best_hf(results: dict, kvgate_batch: int) -> None:
    """The fastest HF run into results["hf_best"], with its batch size beside kvgate's, printed."""
    runs = {k: r for k, r in results.items() if k.startswith("hf_") and "batch_size" in r}
    if not runs:
        return
    label, best = max(runs.items(), key=lambda kv: kv[1]["output_tokens_per_s"])
    results["hf_best"] = {"label": label, "batch_size": best["batch_size"], "kvgate_max_num_seqs": kvgate_batch,
                          "output_tokens_per_s": best["output_tokens_per_s"],
                          "kvgate_speedup": results["kvgate"]["output_tokens_per_s"] / best["output_tokens_per_s"]}
    b = results["hf_best"]
    print(f"  best HF run: {label} (batch {b['batch_size']}; kvgate's --max-num-seqs {kvgate_batch}): kvgate "
          f"{b['kvgate_speedup']:.2f}x", flush=True)


def _vllm_baseline(python: str, model_path: str, dtype, work: _Workload, ours_tokens: list[list[int]],
                   results: dict) -> None:
    """vLLM's offline LLM.generate on the same model, dtype and workload (greedy, ignore_eos), in a child process
    of `python`: its time into results["vllm"], with how many outputs equal kvgate's first run's."""
    from kvgate.bench.engine_vllm import run_vllm, vllm_request

    print(f"vLLM ({python}) ...", flush=True)
    out = run_vllm(python, vllm_request(model_path, str(dtype).removeprefix("torch."), work.prompts,
                                        work.params.max_tokens))
    assert sum(map(len, out["outputs"])) == work.n_out, "vLLM did not generate exactly --output-len tokens each"
    same = sum(a == b for a, b in zip(ours_tokens, out["outputs"]))
    results["vllm"] = {"seconds": out["seconds"], "output_tokens_per_s": work.n_out / out["seconds"],
                       "vllm_version": out["vllm_version"],
                       "greedy_identical_to_kvgate": f"{same}/{len(work.prompts)}",
                       "mean_common_prefix_with_kvgate": _agreement(ours_tokens, out["outputs"])["mean_common_prefix"]}
    print(f"  vllm {out['vllm_version']}: {out['seconds']:.2f} s", flush=True)


def _hf_first_token_check(hf, model_path: str, device, dtype, prompts: list[list[int]],
                          ours_tokens: list[list[int]], results: dict) -> None:
    """kvgate's first tokens against HF's forward of each prompt alone; in reduced precision also the floor that
    agreement is judged against (_reduced_precision_floor)."""
    import torch

    hf_logits: list | None = [] if dtype != torch.float32 else None
    first = _hf_first_tokens(hf, prompts, device, hf_logits)
    same = sum(bool(o) and o[0] == t for o, t in zip(ours_tokens, first))
    results["first_token_equal_to_hf_unpadded"] = same / len(prompts)
    print(f"first generated token equal to HF's forward of the prompt alone: {same}/{len(prompts)} "
          f"({100 * same / len(prompts):.1f}%)", flush=True)
    if dtype != torch.float32:
        results["first_token_floor"] = _reduced_precision_floor(model_path, dtype, device, prompts,
                                                                [o[0] for o in ours_tokens], first, hf_logits)


def _print_comparison(args: argparse.Namespace, results: dict, work: _Workload, ours_tokens: list[list[int]],
                      hf_single: list | None, hf_outputs: list | None, dtype) -> None:
    """The table of every run against the first, and kvgate's outputs against HF's; the ratios go into `results`."""
    import torch

    base = results["kvgate"]["output_tokens_per_s"]
    print(f"\n{'system':<28}{'time (s)':>10}{'output tok/s':>15}{'kvgate speed-up':>18}")
    for label, r in results.items():
        if not isinstance(r, dict) or "output_tokens_per_s" not in r or label == "hf_best":
            continue
        ratio = base / r["output_tokens_per_s"]
        r["kvgate_speedup"] = ratio
        print(f"{label:<28}{r['seconds']:>10.2f}{r['output_tokens_per_s']:>15.1f}{ratio:>17.2f}x")
    if hf_single is not None:
        same = sum(a == b for a, b in zip(ours_tokens, hf_single))
        results["greedy_identical_to_hf_single"] = f"{same}/{len(work.prompts)}"
        print(f"\ngreedy outputs identical to HF one-at-a-time: {same}/{len(work.prompts)}"
              + ("" if dtype == torch.float32 else " (reduced precision: small divergences are expected)"))
    if hf_outputs is not None:
        agree = _agreement(ours_tokens, hf_outputs)
        results["first_token_agreement_with_hf_generate"] = agree["first_token"]
        results["mean_common_prefix_with_hf_generate"] = agree["mean_common_prefix"]
        print(f"against HF generate ({'one at a time' if hf_single is not None else 'left-padded batches'}): "
              f"first token equal for {100 * agree['first_token']:.1f}% of prompts; mean common prefix "
              f"{agree['mean_common_prefix']:.1f} of {args.output_len} tokens")
    if "vllm" in results:
        v = results["vllm"]
        print(f"against vLLM {v['vllm_version']}: kvgate {base:.1f} tok/s, vLLM {v['output_tokens_per_s']:.1f} tok/s "
              f"({v['kvgate_speedup']:.2f}x); greedy outputs identical {v['greedy_identical_to_kvgate']}, mean "
              f"common prefix {v['mean_common_prefix_with_kvgate']:.1f} of {args.output_len} tokens")
