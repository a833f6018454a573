"""float32 vs bfloat16 on this CPU, through the engine: the measurement behind auto_config's CPU dtype rule.

`python -m kvgate.bench.engine_cpu_dtype [--rounds 7]`: the demo model and a model of two Qwen2.5-0.5B-shaped
layers (hidden 896, MLP 4864, 14 heads, 2 KV heads; a byte vocabulary so the LM head does not dominate), one engine
per dtype in this process, timed alternately (the machine may be shared), medians printed. Each round: decode steps
at batch 1, 8, 32 (8-token prompts, 16 tokens each, ignore_eos) and 128 (8 tokens each), and one 512-token
prefill. Prefix caching is off, so every round computes the same work.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

CASES = (("decode b=1", 1, 8, 16), ("decode b=8", 8, 8, 16), ("decode b=32", 32, 8, 16), ("decode b=128", 128, 8, 8),
         ("prefill 512", 1, 512, 1))


def build_layer_model(folder: Path, hidden: int = 896, intermediate: int = 4864, heads: int = 14) -> Path:
    """Two decoder layers of Qwen2.5-0.5B's shape (by default), random weights, the demo's byte tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    from kvgate.common.demo import build_byte_tokenizer, write_tokenizer_files

    tok = build_byte_tokenizer()
    config = Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=intermediate,
                         num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=2,
                         max_position_embeddings=4096, tie_word_embeddings=True,
                         bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(folder))
    write_tokenizer_files(tok, folder, 4096)
    return folder


def time_case(llm, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Seconds per engine step of the case (decode: per generated token of the batch)."""
    from kvgate.engine.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + j) % 200 + 3 for j in range(prompt_len)]} for i in range(batch)]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=0.0)
    start = time.perf_counter()
    llm.generate(prompts, params)
    return (time.perf_counter() - start) / new_tokens


def main(argv: list[str] | None = None) -> None:
    from kvgate.engine.llm import LLM

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        models = {"demo": "demo", "hidden 512 x2": str(build_layer_model(Path(tmp) / "h512", 512, 2048, 8)),
                  "0.5B-shaped x2": str(build_layer_model(Path(tmp) / "h896"))}
        for name, path in models.items():
            engines = {dtype: LLM(path, dtype=dtype, max_model_len=1024, enable_prefix_caching=False)
                       for dtype in ("float32", "bfloat16")}
            for llm in engines.values():  # warm-up: first calls pay for allocations and kernel selection
                for _, *case in CASES:
                    time_case(llm, *case)
            times = {(dtype, label): [] for dtype in engines for label, *_ in CASES}
            for _ in range(args.rounds):
                for label, *case in CASES:
                    for dtype, llm in engines.items():
                        times[dtype, label].append(time_case(llm, *case))
            for label, *_ in CASES:
                f32 = statistics.median(times["float32", label]) * 1e3
                bf16 = statistics.median(times["bfloat16", label]) * 1e3
                print(f"{name:15} {label:12} float32 {f32:8.2f} ms  bfloat16 {bf16:8.2f} ms  "
                      f"bf16 speed-up {f32 / bf16:5.2f}x")


if __name__ == "__main__":
    main()
