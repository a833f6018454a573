"""`kvgate bench chaos --faults load-1000`: N concurrent streams (default 1000, 64 tokens each) through Envoy + EPP
over sim replicas, against the same streams sent straight to the replicas (round-robin) in the same run.

Reported: sent / succeeded / failed (exact token counts, usage, [DONE]), the EPP's CPU (cores, from
/proc/<pid>/stat over the gateway phase) and peak RSS, Envoy's too, and the per-token latency (gap between two
token events at the client) through the gateway against straight: the difference is what the response path
(Envoy, and the EPP that every response body passes through) adds per token. The client runs in this process;
it costs both phases the same.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import threading
import time
from pathlib import Path

from kvgate.chaos.load import StreamLoad
from kvgate.chaos.runner import SIM_MODEL, _free_port
from kvgate.up import Stack, launch_local_stack

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


def _phase(urls, streams: int, max_tokens: int) -> dict:
    load = StreamLoad(urls, SIM_MODEL, concurrency=streams, max_tokens=max_tokens, keep_gaps=True, timeout_s=300)
    t0 = time.monotonic()
    outcomes = asyncio.run(load.run(total=streams))
    wall = time.monotonic() - t0
    ok = [o for o in outcomes if o.ok(max_tokens)]
    gaps = sorted(g for o in ok for g in o.token_gaps[1:])  # the first gap is time to first token
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok(max_tokens):
            kind = f"HTTP {o.status}" if o.status not in (None, 200) else (o.error or "incomplete").split(":")[0]
            errors[kind] = errors.get(kind, 0) + 1
    pick = (lambda q: round(gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1000, 2)) if gaps else (lambda q: None)
    return {"sent": len(outcomes), "succeeded": len(ok), "failed": len(outcomes) - len(ok), "errors": errors,
            "wall_s": round(wall, 2), "itl_ms_mean": round(statistics.fmean(gaps) * 1000, 3) if gaps else None,
            "itl_ms_p50": pick(0.5), "itl_ms_p99": pick(0.99)}


def run_capacity(workdir: Path, *, streams: int = 1000, replicas: int = 8, max_tokens: int = 64) -> dict:
    stack = Stack(workdir / "load-1000")
    stack.workdir.mkdir(parents=True, exist_ok=True)
    try:
        up = launch_local_stack(stack, replicas=replicas, model=SIM_MODEL, backend="sim", host="127.0.0.1",
                                port=_free_port(), engine_args=["--sim-step-overhead-ms", "20",
                                                                "--max-num-seqs", str(max(128, streams))],
                                startup_timeout=120)
        direct = _phase([f"http://{e}" for e in up.endpoints], streams, max_tokens)
        epp, envoy = up.child("epp").proc.pid, up.child("envoy").proc.pid
        cpu0 = {name: _cpu_seconds(pid) for name, pid in (("epp", epp), ("envoy", envoy))}
        t0 = time.monotonic()
        with _Sampler({"epp": epp, "envoy": envoy}) as rss:
            gateway = _phase(up.url, streams, max_tokens)
        wall = time.monotonic() - t0
        cpu = {name: round((_cpu_seconds(pid) - cpu0[name]) / wall, 3) for name, pid in (("epp", epp), ("envoy", envoy))}
    finally:
        stack.stop()
    added = (None if gateway["itl_ms_mean"] is None or direct["itl_ms_mean"] is None
             else round(gateway["itl_ms_mean"] - direct["itl_ms_mean"], 3))
    return {"streams": streams, "replicas": replicas, "max_tokens": max_tokens, "direct": direct, "gateway": gateway,
            "added_itl_ms_mean": added, "epp_cores": cpu["epp"], "envoy_cores": cpu["envoy"],
            "epp_peak_rss_mib": round(rss.peak["epp"], 1), "envoy_peak_rss_mib": round(rss.peak["envoy"], 1),
            "passed": gateway["failed"] == 0 and direct["failed"] == 0}


def print_capacity(c: dict) -> None:
    d, g = c["direct"], c["gateway"]
    print(f"load-1000: {c['streams']} concurrent streams x {c['max_tokens']} tokens over {c['replicas']} sim replicas")
    print(f"  gateway: sent {g['sent']}, ok {g['succeeded']}, failed {g['failed']} in {g['wall_s']} s; "
          f"per-token latency mean {g['itl_ms_mean']} ms, p50 {g['itl_ms_p50']}, p99 {g['itl_ms_p99']}")
    print(f"  direct:  sent {d['sent']}, ok {d['succeeded']}, failed {d['failed']} in {d['wall_s']} s; "
          f"per-token latency mean {d['itl_ms_mean']} ms, p50 {d['itl_ms_p50']}, p99 {d['itl_ms_p99']}")
    print(f"  response path adds {c['added_itl_ms_mean']} ms per token (mean); EPP {c['epp_cores']} cores, "
          f"peak RSS {c['epp_peak_rss_mib']} MiB; Envoy {c['envoy_cores']} cores, peak RSS {c['envoy_peak_rss_mib']} MiB")
    for name, phase in (("gateway", g), ("direct", d)):
        if phase["errors"]:
            print(f"  {name} errors: " + ", ".join(f"{k} x{v}" for k, v in sorted(phase["errors"].items())))
