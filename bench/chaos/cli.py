"""`kvgate bench chaos`: the faults of bench/chaos/faults.py against a local sim stack under streaming load, one row
per fault (sent, succeeded, failed, running on the victim, failed after the fault, time out of rotation, time
to recover, the expectation and whether it held), and `--result-file` JSON. `--short` is the shape the test
suite runs. `load-1000` (1000 concurrent streams, no fault) is bench/chaos/capacity.py's, `rogue-engine` (one endpoint
serving hostile /metrics pages while a client picks) bench/chaos/rogue_engine.py's."""

from __future__ import annotations

import asyncio
import json
import sys
import time

from kvgate.bench.chaos.runner import BY_NAME, SCENARIOS, StackPool, default_workdir, rows_as_dicts, run_scenario


def add_bench_chaos_parser(sub) -> None:
    p = sub.add_parser("chaos", help="faults under streaming load through Envoy + EPP: who was lost, how fast back")
    names = [s.name for s in SCENARIOS] + ["load-1000", "rogue-engine"]
    p.add_argument("--faults", default=",".join(names), help=f"comma-separated, of: {', '.join(names)}")
    p.add_argument("--concurrency", type=int, default=100, help="streams in flight at all times (default 100)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (default 64)")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before the fault")
    p.add_argument("--hold", type=float, default=10.0, help="seconds of load after the fault")
    p.add_argument("--short", action="store_true", help="32 streams, 1.5 s warm-up, 6 s hold (the test suite's)")
    p.add_argument("--streams", type=int, default=1000, help="load-1000: concurrent streams")
    p.add_argument("--replicas", type=int, default=8, help="load-1000: sim replicas")
    p.add_argument("--rogue-pages", default=None, metavar="NAMES",
                   help="rogue-engine: comma-separated bad pages (default all: see bench/chaos/rogue_engine.py)")
    p.add_argument("--result-file", default=None)
    p.set_defaults(func=run_bench_chaos)


def _table(rows: list[dict]) -> str:
    head = ("fault", "sent", "ok", "failed", "on victim", "failed, not on victim", "out of rotation s", "recover s",
            "expect", "held")
    lines = [head]
    for r in rows:
        lines.append((r["fault"], str(r["sent"]), str(r["succeeded"]), str(r["failed"]),
                      "-" if r["victim_in_flight"] is None else str(r["victim_in_flight"]), str(r["failed_not_on_victim"]),
                      "-" if r["out_of_rotation_s"] is None else f"{r['out_of_rotation_s']:.2f}",
                      "-" if r["recover_s"] is None else f"{r['recover_s']:.2f}", r["expect"],
                      "yes" if r["passed"] else "NO"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines)


def run_bench_chaos(args) -> int:
    from tqdm import tqdm

    names = [n.strip() for n in args.faults.split(",") if n.strip()]
    unknown = [n for n in names if n not in BY_NAME and n not in ("load-1000", "rogue-engine")]
    if unknown:
        raise SystemExit(f"kvgate bench chaos: unknown fault(s): {', '.join(unknown)}")
    if args.short:
        args.concurrency, args.warmup, args.hold = 32, 1.5, 6.0
    workdir = default_workdir()
    result: dict = {"concurrency": args.concurrency, "max_tokens": args.max_tokens, "warmup_s": args.warmup,
                    "hold_s": args.hold, "logs": str(workdir), "faults": []}
    pool = StackPool(workdir)
    failed_expectation = False
    try:
        scenarios = [BY_NAME[n] for n in names if n in BY_NAME]
        # The bar's clock moves while a fault runs; redrawn at most once a second (a file gets no flood of lines).
        with tqdm(total=len(scenarios), unit="fault", leave=False, file=sys.stderr, mininterval=1.0) as bar:
            for scenario in scenarios:
                bar.set_description(scenario.name)
                t0 = time.monotonic()
                row = asyncio.run(run_scenario(pool, scenario, concurrency=args.concurrency,
                                               max_tokens=args.max_tokens, warmup_s=args.warmup, hold_s=args.hold,
                                               tick=lambda: bar.update(0)))
                row_dict = rows_as_dicts([row])[0] | {"seconds": round(time.monotonic() - t0, 1)}
                result["faults"].append(row_dict)
                failed_expectation |= not row.passed
                bar.update(1)
    finally:
        pool.close()
        result["supervisor_log"] = pool.log
    if result["faults"]:
        print(_table(result["faults"]))
        for r in result["faults"]:
            if r.get("hit_rate_before") is not None or r.get("kv_batches_after_fault") is not None:
                print(f"  {r['fault']}: prefix-cache hit rate {r['hit_rate_before']} before, {r['hit_rate_after']} "
                      f"after the fault; the EPP read {r['kv_batches_after_fault']} engine event batches after it")
            for kind, count in sorted(r["errors"].items()):
                print(f"  {r['fault']}: {kind} x{count}  e.g. {r['error_examples'].get(kind) or '-'}")
    if "load-1000" in names:
        from kvgate.bench.chaos.capacity import print_capacity, run_capacity

        cap = run_capacity(workdir, streams=args.streams, replicas=args.replicas, max_tokens=args.max_tokens)
        result["load_1000"] = cap
        print_capacity(cap)
        failed_expectation |= not cap["passed"]
    if "rogue-engine" in names:
        from kvgate.bench.chaos.rogue_engine import PAGES, print_rogue_engine, run_rogue_engine

        pages = tuple(n.strip() for n in args.rogue_pages.split(",")) if args.rogue_pages else PAGES
        if set(pages) - set(PAGES):
            raise SystemExit(f"kvgate bench chaos: unknown rogue page(s): {', '.join(sorted(set(pages) - set(PAGES)))}"
                             f" (of: {', '.join(PAGES)})")
        rogue = run_rogue_engine(workdir / "rogue-engine", pages, phase_s=2.0 if args.short else 4.0,
                                 threads=2 if args.short else 4)
        result["rogue_engine"] = rogue
        print_rogue_engine(rogue)
        failed_expectation |= not rogue["passed"]
    print(f"logs: {workdir}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if failed_expectation else 0
