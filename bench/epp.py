"""`kvgate bench epp`: scheduling decision time, added latency of Envoy + EPP, and scrape CPU cost."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from kvgate.common.epp_protocol import DESTINATION_HEADER
from kvgate.common.processes import free_port, start_group, stop_group, wait_http_ok


def add_bench_epp_parser(sub) -> None:
    p = sub.add_parser("epp", help="EPP decision time and added gateway latency (scrape cost: kvgate bench scrape)")
    p.add_argument("--endpoint-counts", default="10,100,1000")
    p.add_argument("--decisions", type=int, default=2000, help="scheduling decisions per endpoint count")
    p.add_argument("--latency-requests", type=int, default=300)
    p.add_argument("--request-rate", type=float, default=25.0, help="requests/s for the latency comparison")
    p.add_argument("--parts", default="scheduling,latency",
                   help="comma-separated: scheduling (decision time), latency (Envoy + EPP), floor (one Envoy: no "
                        "ext_proc, do-nothing ext-proc servers and the EPP, one request stream), scale (the added "
                        "latency at each of --endpoint-counts real endpoints: bench/epp_scale.py)")
    p.add_argument("--scale-idle-seconds", type=float, default=3.0,
                   help="scale part: seconds the EPP's CPU and scrape interval are measured while it only scrapes")
    p.add_argument("--epp-cpus", default=None, metavar="CPUS",
                   help="latency part: pin the EPP to these CPUs (e.g. 0; Linux) and the engine, both Envoys and "
                        "the load to the others — the EPP on a core of its own; floor part: every ext-proc server "
                        "there; default: no pinning (shared cores)")
    p.add_argument("--floor-modes", default="full,request-only",
                   help="floor part: the processing modes each server is measured in (comma-separated; "
                        "kvgate.bench.epp_floor.FLOOR_MODES)")
    p.add_argument("--floor-servers", default=None,
                   help="floor part: the ext-proc servers (comma-separated; default all: grpc-aio, grpc-sync, "
                        "grpclib, node-grpc-js, go-grpc, kvgate-epp; one not installed is skipped with a note)")
    p.add_argument("--floor-seed", type=int, default=0, help="floor part: the seed of the stream and the bootstrap")
    p.add_argument("--tracing", action="store_true",
                   help="latency part: the EPP traces every request (OpenTelemetry, sampled always) and exports the "
                        "spans to an OTLP/gRPC receiver in this process: the cost of tracing on (compare a run "
                        "without)")
    p.add_argument("--result-file", default=None)
    p.set_defaults(func=run_bench_epp)


async def _timed_requests(url: str, n: int, rate: float, headers: dict, tag: str) -> list[float]:
    """Poisson arrivals of 1-token completions; prompts unique per `tag` so that no run is served from the
    prefix cache that another run filled (a cached prefill would give that run a head start)."""
    latencies = []
    gaps = np.random.default_rng(0).exponential(1.0 / rate, size=n)
    async with httpx.AsyncClient(timeout=30) as client:
        async def one(i: int):
            t0 = time.perf_counter()
            r = await client.post(url + "/v1/completions", headers=headers, json={
                "model": "sim-model", "prompt": f"{tag} latency probe {i} " + "p" * 200, "max_tokens": 1})
            if r.status_code == 200:
                latencies.append(time.perf_counter() - t0)
        tasks = []
        for i, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    return latencies


ROUNDS = 5  # the latency part's alternating rounds (each path n / ROUNDS requests a round)


def _pin_epp(procs: list, epp, epp_cpus: frozenset[int]) -> dict:
    """The EPP's process group on epp_cpus; every other process started here, and this one (the load), on the
    rest."""
    from kvgate.bench.routing import pinning

    mine, rest = pinning.split(epp_cpus)
    threads = sum(pinning.pin_group(p.pid, mine if p is epp else rest) for p in procs)
    os.sched_setaffinity(0, rest)
    return {"epp": sorted(mine), "others": sorted(rest), "threads_pinned": threads}


def measure_added_latency(n: int, rate: float, epp_cpus: frozenset[int] | None = None, tracing: bool = False
                          ) -> dict:
    """Envoy + EPP vs Envoy routing by a client-set header, to the same sim engine, same request stream; with
    `epp_cpus`, the EPP pinned to those CPUs and everything else to the others; with `tracing`, the EPP exporting a
    span per request to an OTLP receiver in this process."""
    from kvgate.bench.routing.runner import epp_histograms, epp_metrics, epp_time
    from kvgate.common.envoy_config import PoolBackend, envoy_binary, render_direct
    from kvgate.common.gateway_routes import render_pool_gateway
    from kvgate.epp.scheduling.config import DEFAULT_CONFIG_YAML, parse_config

    kvgate = str(Path(sys.executable).parent / "kvgate")
    work = Path(tempfile.mkdtemp(prefix="kvgate-bench-epp-"))
    procs = []
    own_cpus, pinned = os.sched_getaffinity(0), None
    receiver = None
    if tracing:
        from kvgate.bench.otlp_receiver import OtlpReceiver

        receiver = OtlpReceiver(keep_raw=False)
    try:
        port = free_port()
        procs.append(start_group([kvgate, "serve", "sim-model", "--backend", "sim", "--port", str(port),
                                  "--sim-step-overhead-ms", "1"], work / "engine.log"))
        wait_http_ok(f"http://127.0.0.1:{port}/health", 120)
        endpoint = f"127.0.0.1:{port}"
        grpc, health, metrics = free_port(), free_port(), free_port()
        epp = start_group([kvgate, "epp", "--endpoints", endpoint, "--grpc-port", str(grpc),
                           "--grpc-health-port", str(health), "--metrics-port", str(metrics),
                           *(["--otlp-traces-endpoint", receiver.endpoint] if receiver else [])], work / "epp.log",
                          {"OTEL_TRACES_SAMPLER": "parentbased_always_on"} if receiver else None)
        procs.append(epp)
        wait_http_ok(f"http://127.0.0.1:{metrics}/metrics", 120)
        gw_port, gw_admin, direct_port, direct_admin = (free_port() for _ in range(4))
        (work / "gw.json").write_text(json.dumps(render_pool_gateway(
            PoolBackend("bench", "127.0.0.1", grpc, [endpoint], epp_health_port=health,
                        response=parse_config(DEFAULT_CONFIG_YAML).response_needs), "127.0.0.1", gw_port,
            gw_admin)))
        (work / "direct.json").write_text(json.dumps(render_direct("127.0.0.1", direct_port, direct_admin)))
        for name, admin in (("gw", gw_admin), ("direct", direct_admin)):
            procs.append(start_group([envoy_binary(), "-c", str(work / f"{name}.json"), "--base-id", str(admin)],
                                     work / f"envoy-{name}.log"))
        wait_http_ok(f"http://127.0.0.1:{gw_admin}/ready", 120)
        wait_http_ok(f"http://127.0.0.1:{direct_admin}/ready", 120)
        pinned = _pin_epp(procs, epp, epp_cpus) if epp_cpus else None
        time.sleep(0.5)  # first scrapes
        warm = 20
        direct_header = {DESTINATION_HEADER: endpoint}
        asyncio.run(_timed_requests(f"http://127.0.0.1:{gw_port}", warm, rate, {}, "warm-epp"))
        asyncio.run(_timed_requests(f"http://127.0.0.1:{direct_port}", warm, rate, direct_header, "warm-direct"))
        epp_before = epp_histograms(epp_metrics(metrics))
        via_epp, direct, rounds = alternate_rounds(f"http://127.0.0.1:{gw_port}", f"http://127.0.0.1:{direct_port}",
                                                   direct_header, n, rate)
        # the EPP's own share: from a request's body to its routing answer, inside the EPP (the rest of what it adds
        # is gRPC messages and Envoy's ext_proc work)
        inside = epp_time(epp_before, epp_histograms(epp_metrics(metrics)))
    finally:
        for p in reversed(procs):
            stop_group(p)  # the EPP's shutdown flushes its queued spans
        os.sched_setaffinity(0, own_cpus)
        spans = receiver.count() if receiver else None
        if receiver:
            receiver.stop()
    return {"rate": rate, "requests": n, "cpus": pinned, "tracing": tracing, "spans_exported": spans,
            **added_latency(via_epp, direct, rounds), "inside_epp": inside}


def alternate_rounds(epp_url: str, direct_url: str, direct_header: dict, n: int, rate: float,
                     tag: str = "", progress=None) -> tuple[list[float], list[float], list[float]]:
    """`n` requests each through the EPP's gateway and the direct one, in ROUNDS alternating rounds, so that a drift
    of the machine's load (which moves the engine's latency between runs) falls on both paths alike: (latencies
    via the EPP, latencies direct, the added p50 of each round in ms). `progress(k)`: k requests done."""
    via_epp, direct, rounds = [], [], []
    per_round = max(1, n // ROUNDS)
    for k in range(ROUNDS):
        e = asyncio.run(_timed_requests(epp_url, per_round, rate, {}, f"{tag}epp{k}"))
        d = asyncio.run(_timed_requests(direct_url, per_round, rate, direct_header, f"{tag}direct{k}"))
        via_epp += e
        direct += d
        if e and d:
            rounds.append(1000 * (float(np.percentile(e, 50)) - float(np.percentile(d, 50))))
        if progress is not None:
            progress(2 * per_round)
    return via_epp, direct, rounds


def added_latency(via_epp: list[float], direct: list[float], rounds: list[float]) -> dict:
    """Both paths' answered requests, p50/p99 (ms), and what the EPP added: absolute, as a ratio, per round."""
    out = {"added_p50_ms_per_round": [round(r, 3) for r in rounds],
           "added_p50_ms_median_of_rounds": float(np.median(rounds)) if rounds else None}
    for name, values in (("envoy_epp", via_epp), ("envoy_direct", direct)):
        a = np.asarray(values) * 1000
        out[name] = {"ok": len(values), "p50_ms": float(np.percentile(a, 50)), "p99_ms": float(np.percentile(a, 99))}
    for q in ("p50_ms", "p99_ms"):
        out[f"added_{q}"] = out["envoy_epp"][q] - out["envoy_direct"][q]
        out[f"ratio_{q.split('_')[0]}"] = out["envoy_epp"][q] / out["envoy_direct"][q]
    return out


def run_bench_epp(args: argparse.Namespace) -> int:
    from kvgate.bench.routing.pinning import cpus_flag
    from kvgate.bench.scheduling import bench_prefix_match, bench_scheduling

    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = parts - {"scheduling", "latency", "floor", "scale"}
    if unknown:
        raise SystemExit(f"kvgate bench epp: unknown part(s) {', '.join(sorted(unknown))}")
    floor_modes, floor_servers = _floor_choices(args) if "floor" in parts else ([], [])
    epp_cpus = cpus_flag(args.epp_cpus, "--epp-cpus", "kvgate bench epp")  # before a long scheduling part
    if epp_cpus is not None and not os.sched_getaffinity(0) - epp_cpus:
        raise SystemExit("kvgate bench epp: --epp-cpus must leave a CPU for the rest")
    results: dict = {"scheduling": {}, "prefix_match_us": None, "latency": None, "floor": None}
    if "scheduling" in parts:
        print("decision = schedule + on_picked, queue 2 / kv-cache 2 / prefix 3 / max-score picker (1 endpoint), "
              "every endpoint holding a hot 4 KB prefix; µs")
        print(f"{'endpoints':>10}{'p50':>9}{'p99':>10}{'x p50@10':>10}{'untimed p50':>13}{'new-states p50':>16}"
              f"{'full-index p50':>16}{'p99':>9}{'live-load p50':>15}{'p99':>9}")
        base = None
        for count in [int(x) for x in args.endpoint_counts.split(",")]:
            r = bench_scheduling(count, args.decisions)
            results["scheduling"][count] = r
            base = base or r["p50_us"]
            print(f"{count:>10}{r['p50_us']:>9.1f}{r['p99_us']:>10.1f}{r['p50_us'] / base:>10.2f}"
                  f"{r['untimed_p50_us']:>13.1f}{r['fresh_states_p50_us']:>16.1f}{r['full_index_p50_us']:>16.1f}"
                  f"{r['full_index_p99_us']:>9.1f}{r['live_load_p50_us']:>15.1f}{r['live_load_p99_us']:>9.1f}",
                  flush=True)
            print(" " * 10 + "  per plugin p50: " + ", ".join(f"{k} {v:.1f}" for k, v in r["plugins_p50_us"].items()))
        grid = results["prefix_match_us"] = bench_prefix_match()
        print("\nprefix index match, every endpoint holding the prompt: µs (endpoints x blocks), "
              "and the per-block set intersection it replaced, run here as the baseline")
        for key, r in grid.items():
            print(f"  {key:>9}  {r['match_us']:7.2f}  baseline {r['set_intersection_us']:9.2f}  "
                  f"({r['set_intersection_us'] / r['match_us']:.0f}x faster)")
    if "latency" in parts:
        lat = results["latency"] = measure_added_latency(args.latency_requests, args.request_rate, epp_cpus,
                                                         args.tracing)
        where = f"the EPP on CPUs {lat['cpus']['epp']}, the rest on {lat['cpus']['others']}" if epp_cpus \
            else "shared cores"
        traced = f", the EPP tracing ({lat['spans_exported']} spans exported)" if args.tracing else ""
        print(f"\nlatency at {args.request_rate:g} req/s, {args.latency_requests} requests (1 output token), "
              f"{where}{traced}:")
        print(f"  Envoy + EPP      p50 {lat['envoy_epp']['p50_ms']:.2f} ms  p99 {lat['envoy_epp']['p99_ms']:.2f} ms")
        print(f"  Envoy direct     p50 {lat['envoy_direct']['p50_ms']:.2f} ms  "
              f"p99 {lat['envoy_direct']['p99_ms']:.2f} ms")
        print(f"  added by the EPP p50 {lat['added_p50_ms']:+.2f} ms ({lat['ratio_p50']:.2f}x)  "
              f"p99 {lat['added_p99_ms']:+.2f} ms ({lat['ratio_p99']:.2f}x)", flush=True)
        print(f"  added p50 per round (ms): {', '.join(f'{r:+.2f}' for r in lat['added_p50_ms_per_round'])}; "
              f"median {lat['added_p50_ms_median_of_rounds']:+.2f} ms", flush=True)
        inside = lat["inside_epp"].get("request_path")
        if inside:
            print(f"  inside the EPP (body to routing answer, its own histogram): mean {inside['mean_ms']:.3f} ms, "
                  f"p99 ≤ {inside['p99_ms_at_most']} ms", flush=True)
    if "floor" in parts:
        from kvgate.bench.epp_floor import format_floor, measure_floor

        results["floor"] = measure_floor(args.latency_requests, args.request_rate, floor_modes, floor_servers,
                                         epp_cpus, args.floor_seed)
        print("\n" + format_floor(results["floor"]), flush=True)
    if "scale" in parts:
        from kvgate.bench.epp_scale import run_scale_part

        run_scale_part(args, results)
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(results, indent=2))
    return 0


def _floor_choices(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The floor part's modes and servers, checked before any part runs."""
    from kvgate.bench.epp_floor import FLOOR_MODES, server_names
    from kvgate.bench.flag_lists import chosen_names

    return (chosen_names(args.floor_modes, FLOOR_MODES, "--floor-modes", "kvgate bench epp"),
            chosen_names(args.floor_servers or ",".join(server_names()), server_names(), "--floor-servers",
                         "kvgate bench epp"))
