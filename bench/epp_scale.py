"""`kvgate bench epp --parts scale`: the added latency of Envoy + EPP at 10, 100 and 1000 endpoints.

N endpoints are N real `kvgate serve` servers to the EPP and to Envoy: one sim engine listening on N loopback ports
(bench/multi_port_engine.py), which the real EPP scrapes every 50 ms (`--endpoints-file`) and the real Envoy
forwards to (`render_pool_gateway` with all N as the pool's endpoints). Per endpoint count, once the EPP has scraped
every endpoint (its `kvgate_epp_endpoint_available` gauges all 1):
  idle      the EPP process's CPU (cores) while it only scrapes, and the interval it achieves (its
            `kvgate_epp_scrapes_total` rate over the endpoints), for `--scale-idle-seconds`
  latency   the latency part's comparison (bench/epp.py alternate_rounds: Envoy + EPP against Envoy routing by
            header to one of the N ports, alternating rounds), and the EPP's own histograms over those requests:
            its request path (body to routing answer) and its decision time
and, next to it, the in-process decision time at the same N (bench/scheduling.py bench_scheduling). One engine and
the direct Envoy serve every count; each count gets a fresh EPP and gateway Envoy.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import psutil

from kvgate.bench.multi_port_engine import SPARE_FDS, raise_fd_limit
from kvgate.common.epp_protocol import DESTINATION_HEADER
from kvgate.common.processes import free_port, start_group, stop_group, wait_http_ok

WARM_REQUESTS = 20  # per path and endpoint count, before the measured rounds
SCRAPED_TIMEOUT_S = 180.0  # for the EPP's first scrape of every endpoint


def _wait_for_ports(path: Path, proc, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the multi-port engine exited with status {proc.returncode}")
        if path.exists():
            return [int(line) for line in path.read_text().split()]
        time.sleep(0.1)
    raise TimeoutError(f"the multi-port engine wrote no ports in {timeout:g} s")


def start_engine(work: Path, count: int, procs: list) -> list[int]:
    """One sim engine on `count` loopback ports, serving; its ports."""
    ports_file = work / "engine.ports"
    proc = start_group([sys.executable, "-m", "kvgate.bench.multi_port_engine", "--count", str(count),
                        "--ports-file", str(ports_file), "--", "sim-model", "--backend", "sim",
                        "--sim-step-overhead-ms", "1"], work / "engine.log")
    procs.append(proc)
    ports = _wait_for_ports(ports_file, proc, 120)
    wait_http_ok(f"http://127.0.0.1:{ports[0]}/health", 120,
                 lambda: None if proc.poll() is None else f"the engine exited ({proc.returncode})", "the engine")
    return ports


def _available(metrics_port: int) -> tuple[int, int]:
    """(endpoints in rotation, successful scrapes so far) as the EPP's /metrics says."""
    from kvgate.bench.routing.runner import epp_metrics

    available = scrapes = 0
    for family in epp_metrics(metrics_port):
        if family.name == "kvgate_epp_endpoint_available":
            available = sum(1 for s in family.samples if s.value == 1.0)
        elif family.name == "kvgate_epp_scrapes":
            scrapes = int(sum(s.value for s in family.samples if s.name.endswith("_total")))
    return available, scrapes


def wait_scraped(metrics_port: int, count: int, epp, timeout: float = SCRAPED_TIMEOUT_S) -> float:
    """Seconds until every one of `count` endpoints is in the EPP's rotation (scraped once, not failing)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if epp.poll() is not None:
            raise RuntimeError(f"the EPP exited with status {epp.returncode}")
        if _available(metrics_port)[0] >= count:
            return time.monotonic() - t0
        time.sleep(0.5)
    raise TimeoutError(f"the EPP had not scraped all {count} endpoints after {timeout:g} s")


def measure_idle(metrics_port: int, count: int, epp_pid: int, engine_pid: int, seconds: float,
                 interval_s: float) -> dict:
    """The EPP's and the engine's CPU while the EPP only scrapes, and the scrape interval it achieves."""
    epp, engine = psutil.Process(epp_pid), psutil.Process(engine_pid)

    def cpu(p: psutil.Process) -> float:
        t = p.cpu_times()
        return t.user + t.system

    _, scrapes0 = _available(metrics_port)
    wall0, epp0, engine0 = time.perf_counter(), cpu(epp), cpu(engine)
    time.sleep(seconds)
    wall, epp_s, engine_s = time.perf_counter() - wall0, cpu(epp) - epp0, cpu(engine) - engine0
    _, scrapes1 = _available(metrics_port)
    per_endpoint_per_s = (scrapes1 - scrapes0) / wall / count
    return {"seconds": round(wall, 2), "epp_cpu_cores": round(epp_s / wall, 3),
            "engine_cpu_cores": round(engine_s / wall, 3),
            "achieved_interval_ms": round(1000 / per_endpoint_per_s, 1) if per_endpoint_per_s else None,
            "target_interval_ms": interval_s * 1000}


def measure_count(work: Path, ports: list[int], count: int, direct_url: str, engine_pid: int, requests: int,
                  rate: float, idle_seconds: float, progress) -> dict:
    """One endpoint count: a fresh EPP over the first `count` ports and a gateway Envoy for it."""
    from kvgate.bench.epp import ROUNDS, _timed_requests, added_latency, alternate_rounds
    from kvgate.bench.routing.runner import epp_histograms, epp_metrics, epp_time
    from kvgate.common.envoy_config import PoolBackend, envoy_binary
    from kvgate.common.gateway_routes import render_pool_gateway

    endpoints = [f"127.0.0.1:{p}" for p in ports[:count]]
    here = work / f"n{count}"
    here.mkdir()
    (here / "endpoints").write_text("".join(f"{e}\n" for e in endpoints))
    kvgate = str(Path(sys.executable).parent / "kvgate")
    procs = []
    try:
        grpc, health, metrics = free_port(), free_port(), free_port()
        epp = start_group([kvgate, "epp", "--endpoints-file", str(here / "endpoints"), "--grpc-port", str(grpc),
                           "--grpc-health-port", str(health), "--metrics-port", str(metrics)], here / "epp.log")
        procs.append(epp)
        wait_http_ok(f"http://127.0.0.1:{metrics}/metrics", 120,
                     lambda: None if epp.poll() is None else f"the EPP exited ({epp.returncode})", "the EPP")
        gw_port, gw_admin = free_port(), free_port()
        (here / "gw.json").write_text(json.dumps(render_pool_gateway(
            PoolBackend("bench", "127.0.0.1", grpc, endpoints, epp_health_port=health), "127.0.0.1", gw_port,
            gw_admin)))
        procs.append(start_group([envoy_binary(), "-c", str(here / "gw.json"), "--base-id", str(gw_admin)],
                                 here / "envoy-gw.log"))
        wait_http_ok(f"http://127.0.0.1:{gw_admin}/ready", 120)
        progress(f"{count} endpoints: first scrapes")
        scraped_s = wait_scraped(metrics, count, epp)
        progress(f"{count} endpoints: idle scraping")
        idle = measure_idle(metrics, count, epp.pid, engine_pid, idle_seconds, 0.05)
        progress(f"{count} endpoints: requests")
        gw_url = f"http://127.0.0.1:{gw_port}"
        direct_header = {DESTINATION_HEADER: endpoints[0]}
        warm_epp = asyncio.run(_timed_requests(gw_url, WARM_REQUESTS, rate, {}, f"n{count}-warm-epp"))
        warm_direct = asyncio.run(_timed_requests(direct_url, WARM_REQUESTS, rate, direct_header,
                                                  f"n{count}-warm-direct"))
        progress(2 * WARM_REQUESTS)
        before = epp_histograms(epp_metrics(metrics))
        via_epp, direct, rounds = alternate_rounds(gw_url, direct_url, direct_header, requests, rate, f"n{count}-",
                                                   progress)
        inside = epp_time(before, epp_histograms(epp_metrics(metrics)))
    finally:
        for p in reversed(procs):
            stop_group(p)
    sent = 2 * WARM_REQUESTS + 2 * max(1, requests // ROUNDS) * ROUNDS
    answered = len(warm_epp) + len(warm_direct) + len(via_epp) + len(direct)
    return {"endpoints": count, "first_scrape_of_all_s": round(scraped_s, 2), "idle": idle,
            "requests_sent": sent, "requests_ok": answered, **added_latency(via_epp, direct, rounds),
            "inside_epp": inside}


def measure_scale(counts: list[int], requests: int, rate: float, idle_seconds: float, decisions: int) -> dict:
    """Every endpoint count in turn over one multi-port engine and one direct Envoy; then the in-process decision
    time at the same counts."""
    from tqdm import tqdm

    from kvgate.bench.epp import ROUNDS
    from kvgate.bench.scheduling import bench_scheduling
    from kvgate.common.envoy_config import envoy_binary, render_direct

    # the engine's sockets, and a connection to each from the EPP and from Envoy, here and in the children
    limit = raise_fd_limit(max(counts) * 3 + SPARE_FDS)
    work = Path(tempfile.mkdtemp(prefix="kvgate-bench-epp-scale-"))
    per_count = 2 * WARM_REQUESTS + 2 * max(1, requests // ROUNDS) * ROUNDS
    results: dict = {"counts": {}, "fd_limit": limit, "cpus": os.cpu_count(), "load_average_before": os.getloadavg(),
                     "workdir": str(work)}
    procs = []
    with tqdm(total=per_count * len(counts), unit="req", file=sys.stderr, mininterval=1.0, leave=False) as bar:
        def progress(step) -> None:
            if isinstance(step, str):
                bar.set_postfix_str(step, refresh=True)
            else:
                bar.update(step)

        try:
            progress(f"engine on {max(counts)} ports")
            ports = start_engine(work, max(counts), procs)
            engine_pid = procs[0].pid
            direct_port, direct_admin = free_port(), free_port()
            (work / "direct.json").write_text(json.dumps(render_direct("127.0.0.1", direct_port, direct_admin)))
            procs.append(start_group([envoy_binary(), "-c", str(work / "direct.json"), "--base-id",
                                      str(direct_admin)], work / "envoy-direct.log"))
            wait_http_ok(f"http://127.0.0.1:{direct_admin}/ready", 120)
            for count in counts:
                results["counts"][count] = measure_count(work, ports, count, f"http://127.0.0.1:{direct_port}",
                                                         engine_pid, requests, rate, idle_seconds, progress)
        finally:
            for p in reversed(procs):
                stop_group(p)
        for count in counts:
            progress(f"{count} endpoints: in-process decisions")
            r = bench_scheduling(count, decisions)
            results["counts"][count]["in_process_decision"] = {k: r[k] for k in ("p50_us", "p99_us", "mean_us")}
    return results


def print_scale(results: dict, rate: float, requests: int) -> None:
    rows = results["counts"]
    base = rows[min(rows)]

    def times(value, base_value) -> str:
        if value is None or not base_value:
            return "—"
        return f"{value / base_value:.2f}x"

    def inside(r, key, field="mean_ms"):
        return (r["inside_epp"].get(key) or {}).get(field)

    print(f"\nscale: one sim engine on N loopback ports, the EPP scraping all N every 50 ms; {requests} requests a "
          f"path at {rate:g} req/s (1 output token), alternating rounds; x = against {min(rows)} endpoints")
    print(f"{'endpoints':>9} {'added p50':>10} {'x':>6} {'added p99':>10} {'x':>6} {'rounds med':>10} "
          f"{'EPP path':>9} {'x':>6} {'decision':>9} {'in-proc p50':>11} {'x':>6} {'idle CPU':>8} "
          f"{'interval':>8} {'ok':>9}")
    print(f"{'':>9} {'ms':>10} {'':>6} {'ms':>10} {'':>6} {'ms':>10} {'mean ms':>9} {'':>6} {'mean ms':>9} "
          f"{'µs':>11} {'':>6} {'cores':>8} {'ms':>8}")
    for count, r in rows.items():
        decision = r.get("in_process_decision", {}).get("p50_us")
        base_decision = base.get("in_process_decision", {}).get("p50_us")
        path, base_path = inside(r, "request_path"), inside(base, "request_path")
        interval = r["idle"]["achieved_interval_ms"]
        print(f"{count:>9} {r['added_p50_ms']:>+10.2f} {times(r['added_p50_ms'], base['added_p50_ms']):>6} "
              f"{r['added_p99_ms']:>+10.2f} {times(r['added_p99_ms'], base['added_p99_ms']):>6} "
              f"{r['added_p50_ms_median_of_rounds']:>+10.2f} "
              f"{path if path is not None else float('nan'):>9.3f} {times(path, base_path):>6} "
              f"{inside(r, 'decision') if inside(r, 'decision') is not None else float('nan'):>9.3f} "
              f"{decision if decision is not None else float('nan'):>11.1f} {times(decision, base_decision):>6} "
              f"{r['idle']['epp_cpu_cores']:>8.2f} {interval if interval is not None else float('nan'):>8.1f} "
              f"{r['requests_ok']:>4}/{r['requests_sent']:<4}", flush=True)
    print("  added: Envoy + EPP p50/p99 minus Envoy direct's; rounds med: the median of the rounds' added p50; EPP "
          "path: body to routing answer (its histogram); decision: its scheduling histogram; in-proc: "
          "bench_scheduling at the same N; idle CPU: the EPP process while it only scrapes; interval: the scrape "
          "interval it achieves (target 50 ms)")


def run_scale_part(args, results: dict) -> None:
    """`--parts scale` of `kvgate bench epp`."""
    counts = [int(x) for x in args.endpoint_counts.split(",")]
    scale = measure_scale(counts, args.latency_requests, args.request_rate, args.scale_idle_seconds,
                          args.decisions)
    results["scale"] = scale
    print_scale(scale, args.request_rate, args.latency_requests)
