"""`kvgate bench routing`: routing configurations side by side on the same sim replicas and the identical request
stream — round-robin, kvgate's EPP profiles, and sglang-router / vllm-router where installed — over a rate sweep
per workload shape (`--workloads`, `--shapes`: workloads.py). One table per shape, `--result-file` JSON, `--plot`
PNG. `--short` is the test suite's shape.

Every (workload, rate, configuration) cell runs `--repeats` times, each run on a fresh stack (cold caches; see
runner.py) with a request stream of its own (repeats.py), one at a time; the cell pools its runs and carries a
confidence interval per measure (stats.py).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
from pathlib import Path

from kvgate.bench.flag_lists import chosen_names
from kvgate.bench.routing.configurations import BY_NAME, CONFIGURATIONS, unavailable
from kvgate.bench.routing.pinning import cpus_flag
from kvgate.bench.routing.repeats import repeat_seed
from kvgate.bench.routing.workloads import SHAPE_SETS, SHAPES, WORKLOADS, WorkloadShape, arrivals, parse_shape, \
    with_foreign

SHORT = {"rates": "6", "duration": 6.0, "drain": 20.0, "repeats": 1}  # --rates and --repeats, when given, still win
DEFAULT_RATES = "2,6,10,14"
# A cell's default length and runs: what a claim rests on (docs/benchmarks.md, "How much to trust one cell"). Cells
# as long as those the frozen saturation rates were found with; the runs sample placements, which a longer cell
# does not.
DEFAULT_DURATION = 20.0
DEFAULT_REPEATS = 5
MAX_REPEATS = 50


def _shapes(workloads: str | None, sets: str | None) -> list[WorkloadShape]:
    """--workloads (names or KIND:knob=value,... separated by `;` or, for names alone, `,`) and --shapes (sets)."""
    texts: list[str] = []
    for name in [s.strip() for s in (sets or "").split(",") if s.strip()]:
        if name not in SHAPE_SETS:
            raise SystemExit(f"kvgate bench routing: unknown shape set {name!r}; known: {', '.join(SHAPE_SETS)}")
        texts += SHAPE_SETS[name]
    if workloads or not texts:
        text = workloads or ",".join(WORKLOADS)
        texts += [t.strip() for t in (text.split(";") if ":" in text else text.split(",")) if t.strip()]
    shapes = []
    for t in dict.fromkeys(texts):
        try:
            shapes.append(parse_shape(t))
        except ValueError as exc:
            raise SystemExit(f"kvgate bench routing: {exc}") from None
    return shapes


def _fits(shape: WorkloadShape, requests) -> None:
    """Every request fits every sim replica's context (WorkloadShape.context_tokens; a character is a token)."""
    limit = shape.context_tokens()
    longest = max((len(r.prompt) + r.max_tokens for r in requests), default=0)
    if longest > limit:
        raise SystemExit(f"kvgate bench routing: workload {shape.name!r} has a request of {longest} tokens with its "
                         f"output, over the replicas' {limit}-token context")


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        rates = []
    if not rates or any(not 0 < r <= 1000 for r in rates):
        raise SystemExit(f"kvgate bench routing: --rates must be numbers in (0, 1000], got {text!r}")
    return rates


def _rates_per_shape(text: str, shapes: list[WorkloadShape]) -> dict[str, list[float]]:
    """--rates: the same numbers for every shape, or `saturation` (each shape at its own saturation rate, the
    frozen table saturation.SATURATION_RATES) or `saturation:FILE` (a --find-saturation result file)."""
    if not text.startswith("saturation"):
        rates = _rates(text)
        return {s.name: rates for s in shapes}
    from kvgate.bench.routing.saturation import SATURATION_RATES, rates_from_result

    found = SATURATION_RATES
    if text != "saturation":
        if not text.startswith("saturation:"):
            raise SystemExit(f"kvgate bench routing: --rates takes numbers, saturation or saturation:FILE, "
                             f"got {text!r}")
        try:
            found = rates_from_result(Path(text.split(":", 1)[1]))
        except (OSError, ValueError) as exc:
            raise SystemExit(f"kvgate bench routing: --rates {text}: {exc}") from None
    missing = [s.name for s in shapes if s.name not in found]
    if missing:
        raise SystemExit(f"kvgate bench routing: no saturation rate for {', '.join(missing)} (run --find-saturation "
                         f"on them and pass its result as --rates saturation:FILE)")
    return {s.name: [found[s.name]] for s in shapes}


def add_bench_routing_parser(sub) -> None:
    p = sub.add_parser("routing", help="routing configurations vs round-robin and cache-aware routers: "
                                       "throughput, TTFT, prefix-cache hit rate over a rate sweep")
    p.add_argument("--workloads", default=None,
                   help=f"shapes, comma-separated, of: {', '.join(SHAPES)}; or KIND:knob=value,... (several "
                        f"separated by ';'), e.g. 'multi-tenant:tenants=32,burstiness=2' (default: "
                        f"{','.join(WORKLOADS)} unless --shapes)")
    p.add_argument("--shapes", default=None,
                   help=f"shape sets, comma-separated, of: {', '.join(f'{k} ({len(v)})' for k, v in SHAPE_SETS.items())}"
                        "; the 'held-out' sets are never used to tune kvgate's profile (docs/benchmarks.md)")
    p.add_argument("--configs", default=",".join(c.name for c in CONFIGURATIONS),
                   help=f"comma-separated, of: {', '.join(BY_NAME)} (those whose plugins or router are "
                        "missing are skipped with a note)")
    p.add_argument("--rates", default=None,
                   help=f"requests/s, comma-separated (default {DEFAULT_RATES}); or 'saturation': each shape at its "
                        "own saturation rate (bench/routing/saturation.py SATURATION_RATES, found by "
                        "--find-saturation), or 'saturation:FILE' from a --find-saturation result file")
    p.add_argument("--duration", type=float, default=DEFAULT_DURATION,
                   help=f"seconds of arrivals per run of a cell (default {DEFAULT_DURATION:g})")
    p.add_argument("--repeats", type=int, default=None, metavar="R",
                   help=f"runs per cell, each on a fresh stack with its own request stream (the first is --seed's; "
                        f"bench/routing/repeats.py); the cell pools them and reports a 95%% confidence interval, "
                        f"hierarchical over runs and requests (one run: over its requests only) (default "
                        f"{DEFAULT_REPEATS}; 1 with --short)")
    p.add_argument("--drain", type=float, default=60.0,
                   help="seconds after the last arrival before unfinished requests count as failed (default 60)")
    p.add_argument("--replicas", type=int, default=4, help="sim replicas (default 4)")
    p.add_argument("--seed", type=int, default=0, help="prompts and arrival times (default 0)")
    p.add_argument("--foreign-share", type=float, default=0.0, metavar="F",
                   help="a share F in [0, 1) of the requests reaches the replicas through another gateway sharing "
                        "the pool (hashing the prompt's first 256 characters to a replica), unseen by the router "
                        "under test; the same requests for every configuration (default 0)")
    p.add_argument("--short", action="store_true",
                   help=f"{SHORT['duration']:g} s per cell, rate {SHORT['rates']}/s unless --rates, one run per cell "
                        "unless --repeats (the test suite's)")
    p.add_argument("--gateway-cpus", default=None, metavar="CPUS",
                   help="pin the gateway tier (Envoy + the EPP, or the external router) to these CPUs, e.g. 0 or "
                        "0,2 or 1-3, and the engines and the load to the others: a slower machine's share for the "
                        "routing decision, the same for every configuration (Linux; default: no pinning)")
    p.add_argument("--epp-replicas", default="1", metavar="N[,N...]",
                   help="EPP replicas serving at once behind Envoy (active-active: each sees the engines' metrics "
                        "and KV events, and with --epp-peer-sync the others' picks); each EPP configuration runs "
                        "once per count, as NAME-xN for N > 1 (default 1)")
    p.add_argument("--epp-peer-sync", choices=("on", "off", "both"), default="on",
                   help="N > 1 active replicas share their picks (epp/peer_sync.py): on (default), off (each "
                        "knows only its own in-flight requests and placements; cells NAME-xN-nosync), or both")
    p.add_argument("--epp-peer-sync-insecure", action="store_true",
                   help="synced replicas share their picks without the pool's CURVE key (--peer-sync-insecure; "
                        "cells NAME-xN-insecure): what the key costs, against the same run without this flag")
    p.add_argument("--find-saturation", action="store_true",
                   help="instead of the sweep: per shape, the rate at which round-robin's TTFT p90 reaches "
                        "--saturation-factor x its value at 1 req/s (a ramp from 4 req/s x1.5, then bisection; "
                        "cells of --duration seconds; bench/routing/saturation.py)")
    p.add_argument("--saturation-factor", type=float, default=10.0, metavar="X",
                   help="--find-saturation's target, x the light-load TTFT p90 (default 10)")
    p.add_argument("--saturation-start", type=float, default=4.0, metavar="RATE",
                   help="--find-saturation's first ramp rate in req/s (default 4; the light cell runs at 1)")
    p.add_argument("--lead", default=None, metavar="FILE,FILE,...",
                   help="run nothing: from result files of the same sweep with different seeds, --lead-subject's "
                        "TTFT p90 lead (best router's p90 / its p90, bar 1.5) and output tok/s lead (its tok/s / "
                        "best router's, bar 1.0) per shape and seed with their 95%% intervals, whether it clears "
                        "both bars on every seed, and whether it does with 95%% confidence "
                        "(bench/routing/lead.py; --plot, --result-file)")
    p.add_argument("--lead-subject", default="kvgate", metavar="NAME", help="the configuration --lead judges")
    p.add_argument("--result-file", default=None, help="write every cell as JSON here")
    p.add_argument("--per-request", action="store_true",
                   help="with --result-file: each cell also lists its requests (arrival, prefix key, prompt and "
                        "output size, the engine that served it, status, TTFT), to see which requests set a tail")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="TTFT p90 and throughput vs rate (matplotlib)")
    p.set_defaults(func=run_bench_routing)


MAX_EPP_REPLICAS = 4


def _cell_name(config, n: int, sync: bool, insecure: bool) -> str:
    return config.name if n == 1 else f"{config.name}-x{n}" + ("-nosync" if not sync else "-insecure" if insecure
                                                                 else "")


def _run_lead(args) -> int:
    from kvgate.bench.routing.lead import leads, load_results, plot_leads, print_leads

    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("kvgate bench routing: --plot needs matplotlib (pip install 'kvgate[bench]')")
    try:
        results = load_results([Path(f.strip()) for f in args.lead.split(",") if f.strip()])
    except (OSError, ValueError) as exc:
        raise SystemExit(f"kvgate bench routing: --lead: {exc}") from None
    found = leads(results, args.lead_subject)
    if not found:
        raise SystemExit(f"kvgate bench routing: --lead: no shape has both {args.lead_subject} and a router cell")
    print_leads(found, args.lead_subject)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps({"subject": args.lead_subject, "shapes": found}, indent=2))
    if args.plot:
        plot_leads(found, args.plot, args.lead_subject)
        print(f"plot: {args.plot}")
    return 0 if all(e["leads"] for e in found.values()) else 1


def run_bench_routing(args) -> int:
    from tqdm import tqdm

    from kvgate.bench.routing.repeats import combine_runs
    from kvgate.bench.routing.report import add_ratios, plot, print_tables
    from kvgate.bench.routing.runner import run_cell
    from kvgate.bench.routing.stats import cell_intervals, cell_samples, cell_seed

    if args.lead:
        return _run_lead(args)
    if args.short:
        args.rates, args.duration, args.drain = args.rates or SHORT["rates"], SHORT["duration"], SHORT["drain"]
        args.repeats = args.repeats or SHORT["repeats"]
    args.rates = args.rates or DEFAULT_RATES
    args.repeats = DEFAULT_REPEATS if args.repeats is None else args.repeats
    if not 1 <= args.repeats <= MAX_REPEATS:
        raise SystemExit(f"kvgate bench routing: --repeats must be in [1, {MAX_REPEATS}], got {args.repeats}")
    shapes = _shapes(args.workloads, args.shapes)
    wanted = chosen_names(args.configs, BY_NAME, "--configs", "kvgate bench routing")
    shape_rates = _rates_per_shape(args.rates, shapes)
    rates = sorted({r for rs in shape_rates.values() for r in rs})
    if args.replicas < 1 or args.duration <= 0 or args.drain <= 0:
        raise SystemExit("kvgate bench routing: --replicas, --duration and --drain must be > 0")
    if not 0 <= args.foreign_share < 1:
        raise SystemExit(f"kvgate bench routing: --foreign-share must be in [0, 1), got {args.foreign_share:g}")
    try:
        epp_replicas = sorted({int(n) for n in args.epp_replicas.split(",")})
    except ValueError:
        epp_replicas = []
    if not epp_replicas or not all(1 <= n <= MAX_EPP_REPLICAS for n in epp_replicas):
        raise SystemExit(f"kvgate bench routing: --epp-replicas takes counts from 1 to {MAX_EPP_REPLICAS}, "
                         f"got {args.epp_replicas!r}")
    gateway_cpus = cpus_flag(args.gateway_cpus, "--gateway-cpus", "kvgate bench routing")
    if args.plot and importlib.util.find_spec("matplotlib") is None:  # fail before the run, not after it
        raise SystemExit("kvgate bench routing: --plot needs matplotlib (pip install 'kvgate[bench]')")
    configs, result = [], {"replicas": args.replicas, "duration_s": args.duration, "drain_s": args.drain,
                           "seed": args.seed, "repeats": args.repeats,
                           "repeat_seeds": [repeat_seed(args.seed, k) for k in range(args.repeats)],
                           "foreign_share": args.foreign_share, "rates": rates,
                           "rates_per_shape": shape_rates,
                           "gateway_cpus": sorted(gateway_cpus) if gateway_cpus else None,
                           "epp_replicas": epp_replicas, "epp_peer_sync": args.epp_peer_sync,
                           "epp_peer_sync_insecure": args.epp_peer_sync_insecure,
                           "configurations": {}, "workloads": {}}
    for name in wanted:
        why = unavailable(BY_NAME[name])
        result["configurations"][name] = {"what": BY_NAME[name].what, "kind": BY_NAME[name].kind,
                                          **({"skipped": why} if why else {})}
        if why:
            print(f"kvgate bench routing: skipping {name}: {why}", file=sys.stderr)
        else:
            configs.append(BY_NAME[name])
    if not configs:
        raise SystemExit("kvgate bench routing: no configuration can run")
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-bench-routing-"))
    if args.find_saturation:
        from kvgate.bench.routing.saturation import run_find_saturation

        if not args.saturation_factor > 1 or not 1 < args.saturation_start <= 200:
            raise SystemExit("kvgate bench routing: --saturation-factor must be > 1 and --saturation-start in (1, 200]")
        for shape in shapes:
            _fits(shape, arrivals(shape, 4.0, args.duration, args.seed))
        run_find_saturation(args, shapes, workdir)  # writes --result-file as it goes
        print(f"logs: {workdir}")
        return 0
    seeds = result["repeat_seeds"]
    # per (shape, rate): one request stream per repeat, the same for every configuration
    plan = [(s, r, [with_foreign(arrivals(s, r, args.duration, seed), args.foreign_share, args.replicas, seed)
                    for seed in seeds]) for s in shapes for r in shape_rates[s.name]]
    for shape, _, streams in plan:
        for requests in streams:
            _fits(shape, requests)
    syncs = {"on": [True], "off": [False], "both": [True, False]}[args.epp_peer_sync]
    runs = [(c, n, sync) for c in configs for n in (epp_replicas if c.kind == "epp" else [1])
            for sync in (syncs if n > 1 else [True])]
    total = sum(len(reqs) for _, _, streams in plan for reqs in streams) * len(runs)
    count, done = len(plan) * len(runs) * len(seeds), 0
    failed = False
    with tqdm(total=total, unit="req", file=sys.stderr, mininterval=1.0, leave=False) as bar:
        for shape, rate, streams in plan:
            cells = result["workloads"].setdefault(shape.name, {"what": shape.what, "knobs": shape.knobs(),
                                                                "cells": []})["cells"]
            by_run: dict[int, list[dict]] = {}
            # repeat by repeat, every configuration within one: a drift of the machine meets them all alike
            for repeat, (seed, requests) in enumerate(zip(seeds, streams)):
                for i, (config, n, sync) in enumerate(runs):
                    name = _cell_name(config, n, sync, args.epp_peer_sync_insecure)
                    done += 1
                    bar.set_description(f"run {done}/{count}: {shape.name} {rate:g}/s {name}"
                                        + (f" repeat {repeat + 1}/{len(seeds)}" if len(seeds) > 1 else ""))
                    run = run_cell(workdir, config, shape, requests, replicas=args.replicas, drain_s=args.drain,
                                   tick=lambda: bar.update(1), gateway_cpus=gateway_cpus, epp_replicas=n,
                                   epp_peer_sync=sync, epp_peer_sync_insecure=args.epp_peer_sync_insecure,
                                   per_request=args.per_request)
                    by_run.setdefault(i, []).append({"seed": seed, **run} if len(seeds) > 1 else run)
                    failed |= run["sent"] != run["requests"]
            for i, (config, n, sync) in enumerate(runs):
                name = _cell_name(config, n, sync, args.epp_peer_sync_insecure)
                cell = {"configuration": name, "rate": rate,
                        **({"epp_replicas": n} if config.kind == "epp" else {}),
                        **({"epp_peer_sync": sync} if n > 1 else {}),
                        **combine_runs(by_run[i])}
                cell["ci"] = cell_intervals(cell_samples(cell), cell_seed(shape.name, rate, name))
                cells.append(cell)
            if args.result_file:  # as it goes (ratios at the end): a sweep of repeats takes hours
                Path(args.result_file).write_text(json.dumps(result, indent=2))
    for workload in result["workloads"].values():
        add_ratios(workload["cells"])
    print_tables(result)
    print(f"logs: {workdir}")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(result, indent=2))
    if args.plot:
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    return 1 if failed else 0
