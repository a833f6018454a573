"""`kvgate bench structured-outputs`: what structured outputs cost. Decode tokens/s of one batch in which half the
requests are constrained by a JSON schema, against the same batch with none constrained, as a ratio.

Both runs sample at temperature 1.0 with the same prompts and produce exactly `--output-len` tokens per request
(ignore_eos for the free half; the constrained half's schema asks for an array of at least 10000 objects, which
no request completes, so every step computes a real JSON mask: keys, strings, numbers). The first runs warm up.
"""

from __future__ import annotations

import argparse
import time

# An object array no request can finish within --output-len: a mask per step, every step.
ENDLESS_SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "minItems": 10000, "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                       "name": {"type": "string", "maxLength": 8},
                       "kind": {"enum": ["a", "bb", "ccc"]}},
        "required": ["id", "name", "kind"], "additionalProperties": False}}},
    "required": ["items"], "additionalProperties": False,
}


def add_bench_structured_parser(sub) -> None:
    from kvgate.engine.cli_args import add_engine_args

    p = sub.add_parser("structured-outputs", help="decode tokens/s with half the batch schema-constrained vs none")
    p.add_argument("--model", default="demo", help="'demo' (default) or a local HF folder")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each batch; the best is kept")
    add_engine_args(p)
    p.set_defaults(func=run_bench_structured)


def run_bench_structured(args: argparse.Namespace) -> int:
    from kvgate.engine import LLM, SamplingParams
    from kvgate.engine.bench import make_workload
    from kvgate.engine.cli_args import engine_config_from_args
    from kvgate.engine.llm import resolve_model_path
    from kvgate.engine.sampling_params import StructuredOutputsParams

    llm = LLM.from_config(engine_config_from_args(resolve_model_path(args.model), args))
    engine = llm.engine
    prompts = [{"prompt_token_ids": p} for p in make_workload(args.num_requests, args.prompt_len, args.prompt_len,
                                                              engine.vocab_size, 0)]
    free = SamplingParams(temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    constrained = SamplingParams(temperature=1.0, max_tokens=args.output_len,
                                 structured_outputs=StructuredOutputsParams(json=ENDLESS_SCHEMA))
    half = args.num_requests // 2
    batches = {"none constrained": [free] * args.num_requests,
               "half constrained": [constrained] * half + [free] * (args.num_requests - half)}

    def output_rate(batch, params, repeats) -> float:
        """Output tokens/s of the whole run (short prompts: decode dominates; prefill is the same in both)."""
        best = 0.0
        for _ in range(repeats):
            engine.reset_prefix_cache()
            t0 = time.perf_counter()
            outs = llm.generate(batch, params)
            elapsed = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            assert tokens == len(batch) * args.output_len, "a request ended early: the rates would not compare"
            best = max(best, tokens / elapsed)
        return best

    output_rate(prompts[:2], [constrained, free], 1)  # warm-up: the grammar's tokenizer view, the mask thread
    rates = {name: output_rate(prompts, params, args.repeats) for name, params in batches.items()}
    base = rates["none constrained"]
    print(f"model {args.model} | backend {args.backend} | device {engine.device} | {args.num_requests} requests x "
          f"{args.output_len} tokens (prompts {args.prompt_len}), temperature 1.0, best of {args.repeats}")
    print(f"{'batch':<22}{'output tok/s':>14}{'vs none':>10}")
    for name, rate in rates.items():
        print(f"{name:<22}{rate:>14.1f}{rate / base:>9.2f}x")
    return 0
