"""The `kvgate` command: one program, one subcommand per job."""

from __future__ import annotations

import argparse
import logging
import sys


def _generate(args: argparse.Namespace) -> int:
    from kvgate.engine import LLM, SamplingParams
    from kvgate.engine.cli_args import engine_config_from_args
    from kvgate.engine.llm import resolve_model_path

    config = engine_config_from_args(resolve_model_path(args.model), args)
    config.served_model_name = config.served_model_name or args.model
    llm = LLM.from_config(config)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        max_tokens=args.max_tokens, seed=args.sample_seed, stop=args.stop or None, n=args.n,
        ignore_eos=args.ignore_eos,
    )
    prompts = args.prompt or ["Hello"]
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        for c in out.outputs:
            print(f"--- prompt: {prompt!r}  ({len(out.prompt_token_ids)} tokens, {out.num_cached_tokens} cached)")
            print(c.text)
            print(f"--- {len(c.token_ids)} tokens, finish_reason={c.finish_reason}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    # Each subcommand's module registers its own flags; heavy imports wait until a command runs.
    from kvgate import __version__
    from kvgate.bench.serve import add_bench_engine_loop_parser, add_bench_serve_parser
    from kvgate.conformance.cli import add_conformance_parser
    from kvgate.bench.engine import add_bench_engine_parser
    from kvgate.bench.engine_load import add_bench_load_parser
    from kvgate.bench.engine_structured import add_bench_structured_parser
    from kvgate.engine.cli_args import add_engine_args
    from kvgate.engine.server.cli import add_serve_parser
    from kvgate.bench.epp import add_bench_epp_parser
    from kvgate.bench.datalayer import add_bench_scrape_parser
    from kvgate.bench.routing.cli import add_bench_routing_parser
    from kvgate.bench.chaos.cli import add_bench_chaos_parser
    from kvgate.bench.chaos.hostile import add_bench_hostile_parser
    from kvgate.epp.main import add_epp_parser, add_keygen_parser
    from kvgate.operator.main import add_operator_parser
    from kvgate.stack.up import add_up_parser

    parser = argparse.ArgumentParser(prog="kvgate", description="kvgate: an inference gateway for Kubernetes")
    parser.add_argument("--version", action="version", version=f"kvgate {__version__}")
    parser.add_argument("--log-level", default="warning", help="debug, info, warning (default) or error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text offline with the engine")
    gen.add_argument("model", metavar="MODEL", help="a local HF model folder, or 'demo'")
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for a batch)")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--stop", action="append", help="a stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    add_engine_args(gen)
    gen.set_defaults(func=_generate)

    add_serve_parser(sub)
    add_epp_parser(sub)
    add_keygen_parser(sub)
    add_operator_parser(sub)
    add_up_parser(sub)
    add_conformance_parser(sub)

    bench = sub.add_parser("bench", help="benchmarks that print ratios against a baseline")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    add_bench_engine_parser(bench_sub)
    add_bench_load_parser(bench_sub)
    add_bench_structured_parser(bench_sub)
    add_bench_serve_parser(bench_sub)
    add_bench_engine_loop_parser(bench_sub)
    add_bench_epp_parser(bench_sub)
    add_bench_scrape_parser(bench_sub)
    add_bench_chaos_parser(bench_sub)
    add_bench_hostile_parser(bench_sub)
    add_bench_routing_parser(bench_sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvgate.common.errors import EngineError

    try:
        return args.func(args)
    except EngineError as exc:
        print(f"kvgate {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
