"""`kvgate bench epp --parts floor`: what an ext-proc stream costs before any routing work — the request path's floor.

One Envoy (kvgate's own config code) in front of one sim engine, its routes chosen by the `x-kvgate-bench-path`
header: `none`, a route with no ext_proc (the destination from the client-set `x-gateway-destination-endpoint`, as
the latency part's direct Envoy), and one route per (ext-proc server, processing mode), each switching the shared
ext_proc filter on with its own EPP cluster through the gateway's own per-route override (`pool_routes` /
`ext_proc_route_config`), the mode set in that override. The servers: the do-nothing ones of
kvgate.bench.extproc_noop (the EPP's message sequence with a constant answer, one per gRPC implementation installed
here) and kvgate's EPP itself, each (server, mode) a process of its own so that its CPU is its path's alone.

The load is ONE seeded Poisson stream of 1-token completions, each request given a path by a seeded shuffle (every
path the same share), so a drift of the machine's load falls on every path alike. Per path: p50 / p99, what it adds
over `none`, a bootstrap 95% interval of the added p50, the added p50 per round (the stream cut in ROUNDS) and their
median, and the server's CPU per request. Per mode: the best do-nothing server and the EPP's distance from it.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from kvgate.common.envoy_config import REQUEST_ONLY, RESPONSE_HEADERS_ONLY, SHARED_EXT_PROC

PATH_HEADER = "x-kvgate-bench-path"
NO_EXT_PROC = "none"
EPP = "kvgate-epp"
# processing mode name -> the per-route override's processing_mode (None: the shared filter's own mode, as a pool
# with response bodies gets it); a new mode is one entry here
FLOOR_MODES: dict[str, dict | None] = {
    "full": None,
    "headers-only-response": RESPONSE_HEADERS_ONLY,
    "request-only": REQUEST_ONLY,  # what kvgate's gateways send an EPP whose config reads nothing of a response
}
BOOTSTRAP_RESAMPLES = 2000
WARM_REQUESTS = 5  # per path, before the measured stream
# each process's CPU without requests, measured just before the stream (the `net` CPU leaves it out): half the
# stream's expected length, within these bounds, so that its 10 ms ticks are not scaled up much
IDLE_WINDOW_S = (3.0, 30.0)
START_TIMEOUT_S = 120.0


def idle_window_s(n: int, rate: float) -> float:
    return min(IDLE_WINDOW_S[1], max(IDLE_WINDOW_S[0], 0.5 * n / rate))


def server_names() -> list[str]:
    """Every server the floor part knows: the do-nothing implementations, then kvgate's EPP."""
    from kvgate.bench.extproc_noop import IMPLEMENTATIONS

    return [*IMPLEMENTATIONS, EPP]


def mode_of(name: str) -> dict:
    """A mode's processing_mode as Envoy applies it (the filter's default where the route does not override)."""
    from kvgate.common.envoy_config import ext_proc_filter

    return dict(FLOOR_MODES[name] or ext_proc_filter()["typed_config"]["processing_mode"])


@dataclass
class FloorPath:
    name: str  # "none", or "<server>/<mode>"
    server: str | None = None
    mode: str | None = None
    pool: object = None  # its PoolBackend (None for "none")
    proc: subprocess.Popen | None = None
    metrics_port: int | None = None  # kvgate's EPP: its /metrics


# --- the one Envoy -----------------------------------------------------------------------------------------------

def render_floor_envoy(paths: list[FloorPath], listen_port: int, admin_port: int) -> dict:
    """One listener; a route per path, picked by PATH_HEADER; every ext-proc path through the gateway's pool routes
    with its mode in the per-route override."""
    from kvgate.common.envoy_config import listener, overload_manager, pool_clusters, pool_routes, render_direct

    direct = render_direct("127.0.0.1", 0)  # its ORIGINAL_DST-by-header cluster, the latency part's baseline
    (direct_route,) = direct["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"]["route_config"]["virtual_hosts"][0]["routes"]
    routes, clusters = [], list(direct["static_resources"]["clusters"])
    for path in paths:
        match = {"prefix": "/", "headers": [{"name": PATH_HEADER, "string_match": {"exact": path.name}}]}
        if path.pool is None:
            routes.append({**direct_route, "name": "floor-none", "match": match})
            continue
        for route in pool_routes(f"floor-{path.pool.name}", match, path.pool):
            mode = FLOOR_MODES[path.mode]
            if mode is not None:
                route["typed_per_filter_config"][SHARED_EXT_PROC]["config"]["overrides"]["processing_mode"] = \
                    dict(mode)
            routes.append(route)
        clusters += pool_clusters(path.pool)
    route_config = {"route_config": {"name": "floor", "virtual_hosts": [
        {"name": "floor", "domains": ["*"], "routes": routes}]}}
    return {"static_resources": {"listeners": [listener("floor", "127.0.0.1", listen_port, route_config)],
                                 "clusters": clusters},
            "overload_manager": overload_manager(),
            "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}}}


# --- the servers -------------------------------------------------------------------------------------------------

def _wait_port(port: int, proc: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{log.stem} exited ({proc.returncode}): {log.read_text()[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{log.stem} not listening on {port} after {timeout:g} s")


def _start_paths(servers: list[str], modes: list[str], endpoint: str, work: Path, procs: list
                 ) -> tuple[list[FloorPath], dict[str, str]]:
    """A process per (server, mode) — started all at once, then waited for; and the skipped servers with why."""
    from kvgate.bench.extproc_noop import IMPLEMENTATIONS
    from kvgate.bench.extproc_noop.descriptors import write_ext_proc_descriptor_set
    from kvgate.common.envoy_config import PoolBackend
    from kvgate.common.processes import free_port, start_group, wait_http_ok

    kvgate = str(Path(sys.executable).parent / "kvgate")
    descriptors = write_ext_proc_descriptor_set(work / "ext_proc.descriptors.pb")
    skipped = {}
    paths, waits = [FloorPath(NO_EXT_PROC)], []
    for server in servers:
        impl = IMPLEMENTATIONS.get(server)
        why = impl.missing() if impl is not None else None
        if not why and impl is not None and impl.build is not None:
            try:
                impl.build()
            except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
                why = str(exc)
        if why:
            skipped[server] = why
            continue
        for mode in modes:
            name = f"{server}/{mode}"
            log = work / f"{server}-{mode}.log"
            port = free_port()
            pool_name = f"{server}-{mode}"
            if impl is not None:
                proc = start_group(impl.command(port, endpoint, descriptors), log)
                path = FloorPath(name, server, mode, PoolBackend(pool_name, "127.0.0.1", port, [endpoint]), proc)
                waits.append(lambda port=port, proc=proc, log=log: _wait_port(port, proc, log, START_TIMEOUT_S))
            else:  # kvgate's EPP, as the latency part starts it
                health, metrics = free_port(), free_port()
                proc = start_group([kvgate, "epp", "--endpoints", endpoint, "--grpc-port", str(port),
                                    "--grpc-health-port", str(health), "--metrics-port", str(metrics)], log)
                path = FloorPath(name, server, mode, PoolBackend(pool_name, "127.0.0.1", port, [endpoint],
                                                                  epp_health_port=health), proc, metrics)
                waits.append(lambda metrics=metrics, proc=proc, log=log: wait_http_ok(
                    f"http://127.0.0.1:{metrics}/metrics", START_TIMEOUT_S,
                    lambda: f"{log.stem} exited: {log.read_text()[-2000:]}" if proc.poll() is not None else None))
            procs.append(proc)
            paths.append(path)
    for wait in waits:
        wait()
    return paths, skipped


def _pin(procs: list, servers: list, cpus: frozenset[int]) -> dict:
    """Every ext-proc server on `cpus`; Envoy, the engine and this process (the load) on the others."""
    from kvgate.bench.routing import pinning

    mine, rest = pinning.split(cpus)
    ids = {id(p) for p in servers}
    threads = sum(pinning.pin_group(p.pid, mine if id(p) in ids else rest) for p in procs)
    os.sched_setaffinity(0, rest)
    return {"servers": sorted(mine), "others": sorted(rest), "threads_pinned": threads}


# --- the load ----------------------------------------------------------------------------------------------------

def _headers(path: str, endpoint: str) -> dict:
    # the same headers on every path (only the path's name differs); only `none` reads the destination
    return {PATH_HEADER: path, "x-gateway-destination-endpoint": endpoint}


def _body(tag: str, i: int) -> dict:
    # prompts unique per request: no request is served from a prefix another one cached
    return {"model": "sim-model", "prompt": f"floor {tag} {i} " + "p" * 200, "max_tokens": 1}


async def _until_answered(client: httpx.AsyncClient, url: str, paths: list[str], endpoint: str, timeout: float
                          ) -> None:
    """Each path answers 200 (Envoy's first health checks and connections are done), then WARM_REQUESTS more; the
    paths side by side."""
    deadline = time.monotonic() + timeout

    async def warm(name: str) -> None:
        while True:
            try:
                r = await client.post(url, headers=_headers(name, endpoint), json=_body("ready", 0))
                if r.status_code == 200:
                    break
                last = f"{r.status_code} {r.text[:200]}"
            except httpx.HTTPError as exc:
                last = repr(exc)
            if time.monotonic() > deadline:
                raise TimeoutError(f"path {name} never answered 200: {last}")
            await asyncio.sleep(0.2)
        for i in range(WARM_REQUESTS):
            await client.post(url, headers=_headers(name, endpoint), json=_body(f"warm-{name}", i))

    await asyncio.gather(*(warm(name) for name in paths))


async def _stream(url: str, paths: list[str], plan: np.ndarray, arrivals: np.ndarray, endpoint: str,
                  idle_s: float, mark, bar) -> list[tuple[int, int, float]]:
    """Warm every path; `mark("idle")`, `idle_s` without requests, `mark("stream")`; the measured stream:
    request i to paths[plan[i]] at arrivals[i] s; `mark("end")`. (path index, status, seconds) each, status 0 for
    a transport error."""
    results: list = [None] * len(plan)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        await _until_answered(client, url, paths, endpoint, START_TIMEOUT_S)
        mark("idle")
        await asyncio.sleep(idle_s)
        mark("stream")

        async def one(i: int) -> None:
            name = paths[plan[i]]
            t0 = time.perf_counter()
            try:
                r = await client.post(url, headers=_headers(name, endpoint), json=_body("probe", i))
                status = r.status_code
            except httpx.HTTPError:
                status = 0
            results[i] = (int(plan[i]), status, time.perf_counter() - t0)
            bar.update(1)

        tasks = []
        start = time.perf_counter()
        for i, at in enumerate(arrivals):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
        mark("end")
    return results


# --- the numbers -------------------------------------------------------------------------------------------------

def _median_ci(a: np.ndarray, b: np.ndarray, rng: np.random.Generator) -> list[float]:
    """A bootstrap 95% interval of median(a) - median(b), the two resampled independently."""
    ma = np.median(rng.choice(a, size=(BOOTSTRAP_RESAMPLES, len(a))), axis=1)
    mb = np.median(rng.choice(b, size=(BOOTSTRAP_RESAMPLES, len(b))), axis=1)
    lo, hi = np.percentile(ma - mb, [2.5, 97.5])
    return [round(float(lo), 3), round(float(hi), 3)]


def summarize(paths: list[FloorPath], results: list[tuple[int, int, float]], seed: int, rounds: int) -> dict:
    """Per path: counts, p50 / p99 ms, added over `none` (paths[0]) with its bootstrap interval and per round (the
    stream cut in `rounds` by arrival); per mode: the best do-nothing server and the EPP's distance from it."""
    rng = np.random.default_rng(seed)
    n = len(results)
    ms: list[list[float]] = [[] for _ in paths]
    by_round = [[[] for _ in range(rounds)] for _ in paths]
    errors: list[dict[str, int]] = [{} for _ in paths]
    for i, (k, status, seconds) in enumerate(results):
        if status == 200:
            ms[k].append(1000 * seconds)
            by_round[k][i * rounds // n].append(1000 * seconds)
        else:
            errors[k][str(status)] = errors[k].get(str(status), 0) + 1
    arrays = [np.asarray(m) for m in ms]
    out: dict[str, dict] = {}
    for k, path in enumerate(paths):
        ok = len(ms[k])
        row = out[path.name] = {"server": path.server, "mode": path.mode, "sent": ok + sum(errors[k].values()),
                                "ok": ok, "errors": errors[k],
                                "p50_ms": float(np.percentile(arrays[k], 50)) if ok else None,
                                "p99_ms": float(np.percentile(arrays[k], 99)) if ok else None}
        if k == 0:
            continue
        per_round = [float(np.median(a) - np.median(b)) for a, b in zip(by_round[k], by_round[0]) if a and b]
        both = ok and len(ms[0])
        row.update(added_p50_ms=row["p50_ms"] - out[NO_EXT_PROC]["p50_ms"] if both else None,
                   added_p99_ms=row["p99_ms"] - out[NO_EXT_PROC]["p99_ms"] if both else None,
                   added_p50_ci95_ms=_median_ci(arrays[k], arrays[0], rng) if both else None,
                   added_p50_ms_per_round=[round(r, 3) for r in per_round],
                   added_p50_ms_median_of_rounds=float(np.median(per_round)) if per_round else None)
    modes = {}
    for mode in dict.fromkeys(p.mode for p in paths if p.mode):
        floors = [(out[p.name]["p50_ms"], k) for k, p in enumerate(paths)
                  if p.mode == mode and p.server != EPP and ms[k]]
        entry: dict = {"best_floor": None, "epp_over_best_floor_p50_ms": None,
                       "epp_over_best_floor_p50_ci95_ms": None}
        if floors:
            best = min(floors)[1]
            entry["best_floor"] = paths[best].server
            epp = next((k for k, p in enumerate(paths) if p.mode == mode and p.server == EPP and ms[k]), None)
            if epp is not None:
                entry["epp_over_best_floor_p50_ms"] = out[paths[epp].name]["p50_ms"] - out[paths[best].name]["p50_ms"]
                entry["epp_over_best_floor_p50_ci95_ms"] = _median_ci(arrays[epp], arrays[best], rng)
        modes[mode] = entry
    return {"paths": out, "modes": modes}


def measure_floor(n: int, rate: float, modes: list[str], servers: list[str], cpus: frozenset[int] | None = None,
                  seed: int = 0) -> dict:
    """Start the engine, the servers and the one Envoy; warm every path; run the stream; the summary, each
    process's CPU per request over the stream, and the settings."""
    from tqdm import tqdm

    from kvgate.bench.epp import ROUNDS
    from kvgate.bench.routing.pinning import group_cpu_seconds
    from kvgate.bench.routing.runner import epp_histograms, epp_metrics, epp_time
    from kvgate.common.envoy_config import envoy_binary
    from kvgate.common.processes import free_port, start_group, stop_group, wait_http_ok

    kvgate = str(Path(sys.executable).parent / "kvgate")
    work = Path(tempfile.mkdtemp(prefix="kvgate-bench-floor-"))
    procs: list = []
    own_cpus, pinned = os.sched_getaffinity(0), None
    try:
        port = free_port()
        engine = start_group([kvgate, "serve", "sim-model", "--backend", "sim", "--port", str(port),
                              "--sim-step-overhead-ms", "1"], work / "engine.log")
        procs.append(engine)
        endpoint = f"127.0.0.1:{port}"
        paths, skipped = _start_paths(servers, modes, endpoint, work, procs)
        wait_http_ok(f"http://127.0.0.1:{port}/health", START_TIMEOUT_S)
        gw_port, admin = free_port(), free_port()
        (work / "envoy.json").write_text(json.dumps(render_floor_envoy(paths, gw_port, admin)))
        envoy = start_group([envoy_binary(), "-c", str(work / "envoy.json"), "--base-id", str(admin)],
                            work / "envoy.log")
        procs.append(envoy)
        wait_http_ok(f"http://127.0.0.1:{admin}/ready", START_TIMEOUT_S)
        if cpus:
            pinned = _pin(procs, [p.proc for p in paths if p.proc is not None], cpus)

        rng = np.random.default_rng(seed)
        arrivals = np.cumsum(rng.exponential(1.0 / rate, size=n))
        plan = rng.permutation(np.resize(np.arange(len(paths)), n))  # every path the same share, shuffled
        epps = [p for p in paths if p.metrics_port is not None]
        marks: dict = {}

        def mark(name: str) -> None:
            marks[name] = (time.perf_counter(), {id(p): group_cpu_seconds(p.pid) for p in procs})
            if name == "stream":
                marks["epp"] = {p.name: epp_histograms(epp_metrics(p.metrics_port)) for p in epps}

        with tqdm(total=n, unit="req", file=sys.stderr, mininterval=1.0, leave=False) as bar:
            results = asyncio.run(_stream(f"http://127.0.0.1:{gw_port}/v1/completions", [p.name for p in paths],
                                          plan, arrivals, endpoint, idle_window_s(n, rate), mark, bar))
        inside = {p.name: epp_time(marks["epp"][p.name], epp_histograms(epp_metrics(p.metrics_port)))
                  for p in epps}
        (t_idle, idle), (t_stream, stream), (t_end, end) = marks["idle"], marks["stream"], marks["end"]
        cpu = {key: end[key] - stream[key] for key in end}
        # what each process spends without requests (health checks, the EPP's scrapes), over the stream's length
        background = {key: (stream[key] - idle[key]) * (t_end - t_stream) / (t_stream - t_idle) for key in end}
    finally:
        for p in reversed(procs):
            stop_group(p)
        os.sched_setaffinity(0, own_cpus)

    summary = summarize(paths, results, seed, ROUNDS)
    for path in paths:
        row = summary["paths"][path.name]
        served = path.proc is not None and row["ok"]
        row["server_cpu_ms_per_request"] = round(1000 * cpu[id(path.proc)] / row["ok"], 3) if served else None
        row["server_cpu_ms_per_request_net"] = (round(1000 * (cpu[id(path.proc)] - background[id(path.proc)])
                                                      / row["ok"], 3) if served else None)
        if path.name in inside:
            row["inside_epp"] = inside[path.name]
    ok = sum(row["ok"] for row in summary["paths"].values())
    return {"rate": rate, "requests": n, "seed": seed, "rounds": ROUNDS, "cpus": pinned, "skipped": skipped,
            "processing_modes": {m: mode_of(m) for m in modes},
            "envoy_cpu_ms_per_request": round(1000 * cpu[id(envoy)] / ok, 3) if ok else None,
            "engine_cpu_ms_per_request": round(1000 * cpu[id(engine)] / ok, 3) if ok else None,
            **summary}


def _ms(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "—"
    return f"{value:+.2f}" if signed else f"{value:.2f}"


def format_floor(result: dict) -> str:
    """The floor table: a row per path, then each mode's best do-nothing server and the EPP's distance from it."""
    where = (f"the ext-proc servers on CPUs {result['cpus']['servers']}, the rest on {result['cpus']['others']}"
             if result["cpus"] else "shared cores")
    lines = [f"request-path floor at {result['rate']:g} req/s, {result['requests']} requests (1 output token) in one "
             f"stream over {len(result['paths'])} paths, one Envoy, {where}; ms"]
    for server, why in result["skipped"].items():
        lines.append(f"  skipped {server}: {why}")
    lines.append(f"  {'path':<34}{'ok/sent':>9}{'p50':>9}{'p99':>10}{'added p50':>11}{'95% CI':>19}"
                 f"{'added p99':>11}{'rounds':>8}{'cpu/req':>9}{'net':>7}")
    for name, row in result["paths"].items():
        ci = row.get("added_p50_ci95_ms")
        ci_text = f"[{ci[0]:+.2f}, {ci[1]:+.2f}]" if ci else ""
        lines.append(f"  {name:<34}{row['ok']:>4}/{row['sent']:<4}{_ms(row['p50_ms']):>9}{_ms(row['p99_ms']):>10}"
                     f"{_ms(row.get('added_p50_ms'), True):>11}{ci_text:>19}"
                     f"{_ms(row.get('added_p99_ms'), True):>11}"
                     f"{_ms(row.get('added_p50_ms_median_of_rounds'), True):>8}"
                     f"{_ms(row.get('server_cpu_ms_per_request')):>9}"
                     f"{_ms(row.get('server_cpu_ms_per_request_net')):>7}")
        if row["errors"]:
            lines.append(f"  {'':<34}errors: {row['errors']}")
        inside = (row.get("inside_epp") or {}).get("request_path")
        if inside:
            lines.append(f"  {'':<34}inside the EPP (body to routing answer): mean {inside['mean_ms']:.3f} ms")
    for mode, entry in result["modes"].items():
        if entry["best_floor"] is None:
            continue
        gap = entry["epp_over_best_floor_p50_ms"]
        text = (f"; kvgate's EPP over it p50 {gap:+.2f} ms [{entry['epp_over_best_floor_p50_ci95_ms'][0]:+.2f}, "
                f"{entry['epp_over_best_floor_p50_ci95_ms'][1]:+.2f}]" if gap is not None else "")
        lines.append(f"  {mode}: best do-nothing server {entry['best_floor']}{text}")
    lines.append(f"  CPU per request (ms, all paths): Envoy {_ms(result['envoy_cpu_ms_per_request'])}, "
                 f"engine {_ms(result['engine_cpu_ms_per_request'])}; 'cpu/req': each server's own process over the "
                 f"stream (10 ms ticks), 'net': less its CPU without requests (health checks, the EPP's scrapes)")
    return "\n".join(lines)
