"""`kvgate bench hostile`: the attacks of bench/chaos/attacks.py against one local stack — sim engines publishing KV
events, `kvgate epp` on kvgate's profile (precise prefix routing, tokenizing in the EPP), kvgate's Envoy — while
a stream of good requests flows, and what that stream felt.

Timeline: `warmup_s` of good traffic alone (the baseline window), then each attack in turn while the good
traffic goes on (one window per attack, from its first byte to its last answer), then `warmup_s` more (the after
window: is the stack still as good as before?). Good requests are streamed completions over a few tenants' shared
system prompts (so the prefix cache matters), each checked to the last token (bench/chaos/load.py).

Measured: per window, the good requests sent, failed, and their latency p50/p99 (send to last token); the
engines' /health answers polled every 0.2 s (a kubelet fails a pod after 3 probes in a row over 1 s); RSS of every
engine and the EPP at the start, peak and end; the engines' prefix-cache hit rate in the baseline and after
windows; the EPP's KV-event counters (batches, gaps, errors, restarts).

Verdict: every good request succeeded, no process of the stack died, no engine would have failed its liveness
probe, each attack got the answer it expects, memory grew by at most RSS_GROWTH_MIB per process, the
after-window hit rate is within HIT_RATE_SLACK of the baseline's, and the EPP still reads engine events in the
after window.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from kvgate.bench.chaos import attacks as A
from kvgate.bench.chaos.load import Outcome, StreamLoad, tenant_prompts

MODEL = "demo"
SIM_ENGINE_ARGS = ["--sim-step-overhead-ms", "5", "--sim-decode-ms-per-seq", "0.05"]
MAX_TOKENS = 16
RSS_GROWTH_MIB = 100  # per process, from start to end: a cache bounded in bytes, sockets bounded in bytes
HIT_RATE_SLACK = 0.15
PROBE_TIMEOUT_S, PROBE_FAILURES = 1.0, 3  # a kubelet's defaults (timeoutSeconds 1, failureThreshold 3)


@dataclass
class Window:
    name: str
    start: float
    end: float | None = None
    attempt: A.Attempt | None = None


@dataclass
class Probes:
    """/health of every engine every 0.2 s, and RSS of the stack's processes every 0.5 s, on one thread."""
    engines: list[str]
    pids: dict[str, list[int]]  # process name -> its pid and its children's
    health: list[tuple[float, str, float]] = field(default_factory=list)  # (at, engine, seconds; inf: failed)
    rss_mib: dict[str, list[float]] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        last_rss = 0.0
        with httpx.Client(timeout=5.0) as client:
            while not self.stop.wait(0.2):
                for e in self.engines:
                    t0 = time.monotonic()
                    try:
                        ok = client.get(f"http://{e}/health").status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    self.health.append((t0, e, time.monotonic() - t0 if ok else float("inf")))
                if time.monotonic() - last_rss >= 0.5:
                    last_rss = time.monotonic()
                    for name, pids in self.pids.items():
                        self.rss_mib.setdefault(name, []).append(sum(_rss_mib(p) for p in pids))


def _rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _process_tree(pid: int) -> list[int]:
    out = [pid]
    try:
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            out.extend(_process_tree(int(child)))
    except OSError:
        pass
    return out


def _latency(outcomes: list[Outcome], w: Window) -> dict:
    """Good requests sent inside the window: how many, how many failed, latency percentiles (send to end)."""
    inside = [o for o in outcomes if w.start <= o.sent_at < (w.end or float("inf"))]
    ok = [o.ended_at - o.sent_at for o in inside if o.ok(MAX_TOKENS)]
    p = np.percentile(ok, [50, 99]) if ok else [None, None]
    return {"sent": len(inside), "failed": len(inside) - len(ok),
            "p50_s": None if p[0] is None else round(float(p[0]), 3),
            "p99_s": None if p[1] is None else round(float(p[1]), 3),
            "errors": sorted({o.failure_kind() for o in inside if not o.ok(MAX_TOKENS)})}


def _liveness_failures(probes: Probes) -> dict[str, int]:
    """Per engine: the longest run of consecutive probes over PROBE_TIMEOUT_S (a kubelet restarts at 3)."""
    worst: dict[str, int] = {}
    run: dict[str, int] = {}
    for _, e, s in probes.health:
        run[e] = run.get(e, 0) + 1 if s > PROBE_TIMEOUT_S else 0
        worst[e] = max(worst.get(e, 0), run[e])
    return worst


def _slowest_probe(probes: Probes, w: Window) -> float | None:
    inside = [s for t, _, s in probes.health if w.start <= t < (w.end or float("inf"))]
    return round(max(inside), 3) if inside else None


def _expectation_met(attack: A.Attack, attempt: A.Attempt) -> bool:
    statuses = [a for a in attempt.answers if isinstance(a, int)]
    if attack.expect == "absorbed":
        return not any(isinstance(a, str) and a.startswith("attack raised") for a in attempt.answers)
    if len(statuses) != len(attempt.answers):  # a connection broke or timed out: no clear answer
        return False
    allowed = (lambda s: 400 <= s < 500) if attack.expect == "4xx" else (lambda s: s == 200 or 400 <= s < 500)
    return all(allowed(s) for s in statuses) and attempt.refused_clearly


def run_hostile(workdir: Path, names: list[str], *, concurrency: int, warmup_s: float, attack_timeout_s: float,
                startup_timeout: float = 120.0, tick=lambda _: None) -> dict:
    from kvgate.bench.routing.runner import all_counters, epp_kv_event_counts, hit_rate
    from kvgate.epp.scheduling.config import KVGATE_PROFILE_FALLBACK_YAML
    from kvgate.common.processes import free_port
    from kvgate.stack.local_stack import StackSpec, launch_local_stack
    from kvgate.stack.supervisor import Stack

    stack = Stack(Path(tempfile.mkdtemp(prefix="stack-", dir=workdir)))
    rogue_address = f"tcp://[::1]:{free_port()}"
    rogue = A.bind_rogue(rogue_address)
    try:
        up = launch_local_stack(stack, StackSpec(
            replicas=2, model=MODEL, backend="sim", host="127.0.0.1", port=free_port(),
            epp_config_text=KVGATE_PROFILE_FALLBACK_YAML, engine_args=SIM_ENGINE_ARGS, kv_events=True,
            engine_hosts=["127.0.0.2", "127.0.0.3"], epp_kv_event_override={1: rogue_address},
            startup_timeout=startup_timeout))
        target = A.Target(up.url, up.endpoints, MODEL, up.event_sockets, rogue=rogue)
        pids = {c.name: _process_tree(c.proc.pid) for c in stack.children if c.name != "envoy"}
        probes = Probes(up.endpoints, pids)
        probe_thread = threading.Thread(target=probes.run, daemon=True)
        probe_thread.start()
        events_before = epp_kv_event_counts(up.metrics_port)
        windows: list[Window] = []
        counters: dict[str, dict] = {}
        # the good traffic: closed-loop streams over a few tenants' shared system prompts
        load = StreamLoad(up.url, MODEL, concurrency=concurrency, max_tokens=MAX_TOKENS, timeout_s=120.0,
                          prompt_for=tenant_prompts())
        outcomes = load.outcomes
        events_mid: dict[str, int] = {}

        async def timeline() -> None:
            traffic = asyncio.create_task(load.run())
            counters["baseline_start"] = await asyncio.to_thread(all_counters, up.endpoints)
            windows.append(Window("baseline", time.monotonic()))
            await asyncio.sleep(warmup_s)
            windows[-1].end = time.monotonic()
            counters["baseline_end"] = await asyncio.to_thread(all_counters, up.endpoints)
            for name in names:
                attack = A.BY_NAME[name]
                w = Window(name, time.monotonic())
                windows.append(w)
                thread, result = A.run_in_thread(attack, target)
                await asyncio.to_thread(thread.join, attack_timeout_s)
                w.end = time.monotonic()
                w.attempt = result[0] if result else A.Attempt([f"no answer within {attack_timeout_s:g} s"])
                tick(name)
                await asyncio.sleep(0.5)
            counters["after_start"] = await asyncio.to_thread(all_counters, up.endpoints)
            events_mid.update(await asyncio.to_thread(epp_kv_event_counts, up.metrics_port))
            windows.append(Window("after", time.monotonic()))
            await asyncio.sleep(warmup_s)
            windows[-1].end = time.monotonic()
            counters["after_end"] = await asyncio.to_thread(all_counters, up.endpoints)
            load.stop()
            await asyncio.wait_for(traffic, 150.0)

        asyncio.run(timeline())
        probes.stop.set()
        probe_thread.join(5)
        A.held_close(target)
        died = [c.name for c in stack.children if c.proc.poll() is not None or c.restarts]
        events_after = epp_kv_event_counts(up.metrics_port) if not died else {}
    finally:
        rogue.close(0)
        stack.stop()

    rows = []
    for w in windows:
        row = {"window": w.name, "seconds": round((w.end or w.start) - w.start, 2), **_latency(outcomes, w),
               "slowest_health_s": _slowest_probe(probes, w)}
        if w.attempt is not None:
            attack = A.BY_NAME[w.name]
            row |= {"what": attack.what, "expect": attack.expect, **A.to_json(w.attempt),
                    "expectation_met": _expectation_met(attack, w.attempt)}
        rows.append(row)
    rss = {name: {"start_mib": round(v[0], 1), "peak_mib": round(max(v), 1), "end_mib": round(v[-1], 1)}
           for name, v in probes.rss_mib.items() if v}
    hit = {"baseline": hit_rate(counters["baseline_start"], counters["baseline_end"]),
           "after": hit_rate(counters["after_start"], counters["after_end"])}
    liveness = _liveness_failures(probes)
    checks = {
        "good_requests_all_succeeded": all(r["failed"] == 0 for r in rows),
        "no_process_died": not died,
        "liveness_probes_held": all(n < PROBE_FAILURES for n in liveness.values()),
        "attacks_answered_as_expected": all(r.get("expectation_met", True) for r in rows),
        "memory_bounded": all(v["end_mib"] - v["start_mib"] <= RSS_GROWTH_MIB for v in rss.values()),
        "hit_rate_kept": None in hit.values() or hit["after"] >= hit["baseline"] - HIT_RATE_SLACK,
        # the EPP still reads engine events after the attacks (its reader thread survived the bad batches)
        "kv_events_still_read": events_after.get("batches", 0) > events_mid.get("batches", 0),
    }
    return {"windows": rows, "rss": rss, "prefix_cache_hit_rate": hit, "liveness_worst_run": liveness,
            "died": died, "epp_kv_events": {k: events_after.get(k, 0) - events_before.get(k, 0)
                                             for k in set(events_before) | set(events_after)},
            "checks": checks, "passed": all(checks.values()), "concurrency": concurrency,
            "logs": str(stack.workdir)}


def _table(result: dict) -> str:
    head = ("window", "s", "good sent", "failed", "p50 s", "p99 s", "slowest /health s", "answers", "expected")
    lines = [head]
    for r in result["windows"]:
        answers = r.get("answers")
        lines.append((r["window"], f"{r['seconds']:.1f}", str(r["sent"]), str(r["failed"]), str(r["p50_s"]),
                      str(r["p99_s"]), str(r["slowest_health_s"]),
                      "-" if answers is None else ",".join(A.as_text(a) for a in answers)[:40],
                      "-" if "expectation_met" not in r else ("yes" if r["expectation_met"] else "NO")))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines)


def add_bench_hostile_parser(sub) -> None:
    p = sub.add_parser("hostile", help="hostile input (constraint bombs, huge prompts, KV-event floods and rogue "
                                       "publishers) while good traffic flows: what the good traffic felt")
    names = [a.name for a in A.ATTACKS]
    p.add_argument("--attacks", default=",".join(names), help=f"comma-separated, of: {', '.join(names)}")
    p.add_argument("--concurrency", type=int, default=8, help="good streams in flight at all times (default 8)")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of good traffic before and after (default 5)")
    p.add_argument("--attack-timeout", type=float, default=120.0, help="seconds an attack may take (default 120)")
    p.add_argument("--short", action="store_true", help="3 s before and after, 4 streams (the test suite's)")
    p.add_argument("--result-file", default=None)
    p.set_defaults(func=run_bench_hostile)


def run_bench_hostile(args) -> int:
    from tqdm import tqdm

    names = [n.strip() for n in args.attacks.split(",") if n.strip()]
    unknown = [n for n in names if n not in A.BY_NAME]
    if unknown:
        raise SystemExit(f"kvgate bench hostile: unknown attack(s): {', '.join(unknown)}")
    if args.short:
        args.warmup, args.concurrency = 3.0, 4
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-hostile-"))
    with tqdm(total=len(names), unit="attack", leave=False, file=sys.stderr) as bar:
        result = run_hostile(workdir, names, concurrency=args.concurrency, warmup_s=args.warmup,
                             attack_timeout_s=args.attack_timeout,
                             tick=lambda name: (bar.set_description(name), bar.update(1)))
    print(_table(result))
    for r in result["windows"]:
        if r.get("detail"):
            print(f"  {r['window']}: {r['detail']}")
    print("RSS MiB (start/peak/end): " + ", ".join(
        f"{n} {v['start_mib']:.0f}/{v['peak_mib']:.0f}/{v['end_mib']:.0f}" for n, v in result["rss"].items()))
    print(f"prefix-cache hit rate: baseline {result['prefix_cache_hit_rate']['baseline']}, "
          f"after {result['prefix_cache_hit_rate']['after']}; EPP KV events: {result['epp_kv_events']}")
    print("checks: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in result["checks"].items()))
    print(f"logs: {result['logs']}")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["passed"] else 1
