"""`kvgate bench chaos --faults load-1000`: N concurrent streams (default 1000, 64 tokens each) through Envoy + EPP
over sim replicas, against the same streams sent straight to the replicas (round-robin) in the same run.

Reported: sent / succeeded / failed (exact token counts, usage, [DONE]), the EPP's CPU (cores, from
/proc/<pid>/stat over the gateway phase) and peak RSS, Envoy's too, and the per-token latency a client sees
meanwhile: a probe, one stream at a time in this process while the bulk streams run in a child process (1000
streams parsed by one Python client would measure the client), through the gateway against straight to a
replica. The difference of the probe's mean token gap is what the response path (Envoy, and the EPP that every
response body passes through) adds per token under that load.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import threading
import time
from pathlib import Path

import httpx

from kvgate.bench.chaos.load import StreamLoad
from kvgate.bench.chaos.runner import SIM_MODEL
from kvgate.common.processes import end_with_me, free_port
from kvgate.stack.local_stack import StackSpec, launch_local_stack
from kvgate.stack.supervisor import Stack

TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class _Sampler:
    """Peak RSS of some processes, sampled every 0.1 s in a thread."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids, self.peak = pids, {name: 0.0 for name in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for name, pid in self.pids.items():
                try:
                    self.peak[name] = max(self.peak[name], _rss_mib(pid))
                except OSError:
                    pass

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(2)


def _summary(outcomes, max_tokens: int, wall: float) -> dict:
    ok = [o for o in outcomes if o.ok(max_tokens)]
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok(max_tokens):
            errors[o.failure_kind()] = errors.get(o.failure_kind(), 0) + 1
    spread: dict[str, int] = {}
    for o in ok:
        spread[o.endpoint or "?"] = spread.get(o.endpoint or "?", 0) + 1
    e2e = sorted(o.ended_at - o.sent_at for o in ok)
    return {"sent": len(outcomes), "succeeded": len(ok), "failed": len(outcomes) - len(ok), "errors": errors,
            "wall_s": round(wall, 2), "per_endpoint": dict(sorted(spread.items())),
            "e2e_s_p50": round(e2e[len(e2e) // 2], 2) if e2e else None,
            "e2e_s_max": round(e2e[-1], 2) if e2e else None}


def _bulk(urls, streams: int, max_tokens: int, out) -> None:
    """In a child process (its own cores' worth of client CPU): `streams` concurrent streams, once each."""
    load = StreamLoad(urls, SIM_MODEL, concurrency=streams, max_tokens=max_tokens, timeout_s=300)
    t0 = time.monotonic()
    outcomes = asyncio.run(load.run(total=streams))
    out.put(_summary(outcomes, max_tokens, time.monotonic() - t0))


def _probe(urls, until, max_tokens: int) -> dict:
    """Meanwhile, in this process: one stream at a time, its token gaps kept — what a client sees per token while
    the bulk load runs, unskewed by the bulk client's own CPU."""
    load = StreamLoad(urls, SIM_MODEL, concurrency=1, max_tokens=max_tokens, keep_gaps=True, timeout_s=300)

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            seq = 0
            while not until():
                seq += 1
                await load.one(client, seq)
    asyncio.run(run())
    ok = [o for o in load.outcomes if o.ok(max_tokens)]
    gaps = sorted(g for o in ok for g in o.token_gaps[1:])  # the first gap is time to first token
    ttft = sorted(o.token_gaps[0] for o in ok if o.token_gaps)
    q = (lambda xs, p: round(xs[min(len(xs) - 1, int(p * len(xs)))] * 1000, 2) if xs else None)
    return {"streams": len(load.outcomes), "ok": len(ok), "itl_ms_mean": round(statistics.fmean(gaps) * 1000, 3)
            if gaps else None, "itl_ms_p50": q(gaps, 0.5), "itl_ms_p99": q(gaps, 0.99), "ttft_ms_p50": q(ttft, 0.5)}


def _phase(bulk_urls, probe_urls, streams: int, max_tokens: int) -> dict:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_bulk, args=(bulk_urls, streams, max_tokens, out), daemon=True)
    child.start()
    end_with_me(child.pid)  # the bulk client too ends with this process, however it ends
    try:
        time.sleep(1.0)  # the bulk streams are in flight before the probe starts
        probe = _probe(probe_urls, lambda: not child.is_alive() or not out.empty(), max_tokens)
        bulk = out.get(timeout=600)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    return {**bulk, "probe": probe}


def run_capacity(workdir: Path, *, streams: int = 1000, replicas: int = 8, max_tokens: int = 64) -> dict:
    stack = Stack(workdir / "load-1000")
    stack.workdir.mkdir(parents=True, exist_ok=True)
    try:
        up = launch_local_stack(stack, StackSpec(
            replicas=replicas, model=SIM_MODEL, backend="sim", host="127.0.0.1", port=free_port(),
            engine_args=["--sim-step-overhead-ms", "20", "--max-num-seqs", str(max(128, streams))],
            startup_timeout=120))
        direct_urls = [f"http://{e}" for e in up.endpoints]
        direct = _phase(direct_urls, direct_urls[:1], streams, max_tokens)
        epp, envoy = up.child("epp").proc.pid, up.child("envoy").proc.pid
        cpu0 = {name: _cpu_seconds(pid) for name, pid in (("epp", epp), ("envoy", envoy))}
        t0 = time.monotonic()
        with _Sampler({"epp": epp, "envoy": envoy}) as rss:
            gateway = _phase(up.url, up.url, streams, max_tokens)
        wall = time.monotonic() - t0
        cpu = {name: round((_cpu_seconds(pid) - cpu0[name]) / wall, 3) for name, pid in (("epp", epp), ("envoy", envoy))}
    finally:
        stack.stop()
    g, d = gateway["probe"], direct["probe"]
    added = (None if g["itl_ms_mean"] is None or d["itl_ms_mean"] is None
             else round(g["itl_ms_mean"] - d["itl_ms_mean"], 3))
    return {"streams": streams, "replicas": replicas, "max_tokens": max_tokens, "direct": direct, "gateway": gateway,
            "added_itl_ms_mean": added, "epp_cores": cpu["epp"], "envoy_cores": cpu["envoy"],
            "epp_peak_rss_mib": round(rss.peak["epp"], 1), "envoy_peak_rss_mib": round(rss.peak["envoy"], 1),
            "passed": gateway["failed"] == 0 and direct["failed"] == 0}


def print_capacity(c: dict) -> None:
    d, g = c["direct"], c["gateway"]
    print(f"load-1000: {c['streams']} concurrent streams x {c['max_tokens']} tokens over {c['replicas']} sim replicas")
    for name, phase in (("gateway", g), ("direct ", d)):
        p = phase["probe"]
        print(f"  {name}: sent {phase['sent']}, ok {phase['succeeded']}, failed {phase['failed']} in "
              f"{phase['wall_s']} s; probe ({p['ok']} streams meanwhile): per-token latency mean {p['itl_ms_mean']} ms, "
              f"p50 {p['itl_ms_p50']}, p99 {p['itl_ms_p99']}; TTFT p50 {p['ttft_ms_p50']} ms")
    print(f"  the gateway's response path adds {c['added_itl_ms_mean']} ms per token (probe mean); EPP "
          f"{c['epp_cores']} cores, peak RSS {c['epp_peak_rss_mib']} MiB; Envoy {c['envoy_cores']} cores, peak RSS "
          f"{c['envoy_peak_rss_mib']} MiB")
    for name, phase in (("gateway", g), ("direct", d)):
        if phase["errors"]:
            print(f"  {name} errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(phase["errors"].items())))
