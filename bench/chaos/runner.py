"""Runs chaos scenarios: a local stack (sim engines, `kvgate epp`, Envoy — kvgate's config or the stock
upstream-shaped one), supervised as `kvgate up` supervises it, streaming load through it, one fault, and the
count of what happened to every request.

Per scenario: `warmup_s` of load, the fault, `hold_s` more of load, then the load stops and every request ends.
A row says how many requests were sent, succeeded (200, every token, usage, [DONE]) and failed, how many were
running on the victim when it was hit (the victim's own metrics just before), how many failed requests the
victim had not taken (no response headers from it: what routing and retries must avoid), how long the EPP took
to take the victim out of rotation, and how long until things were back (the restarted replica in rotation
again, or a new EPP process healthy in Envoy; for active-passive EPPs, another EPP than the one killed healthy in
Envoy: the follower leading — the killed one, restarted, only follows). Each scenario states its expectation,
checked on the row (`verdict`); `until-follower-leads`: FailClose with two EPPs electing a leader over a lease
file — what the dead leader carried and what arrives before the follower leads fails, and the follower must be
healthy in Envoy within the lease duration, a retry period and two of Envoy's 1 s health checks;
`epp-replica-streams`: FailClose with two EPPs serving at once — only the streams the killed one carried (Envoy's
count just before) fail, plus at most one request per load worker sent to it before Envoy ejected it; out of
rotation is when Envoy stopped listing it healthy, recovered when its restarted process is healthy there again.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from kvgate.bench.routing.runner import all_counters, epp_kv_event_counts, hit_rate
from kvgate.bench.chaos import attacks, faults
from kvgate.bench.chaos.load import Outcome, StreamLoad, tenant_prompts
from kvgate.epp.scheduling.config import FALLBACK_CONFIG_YAML, KVGATE_PROFILE_FALLBACK_YAML
from kvgate.common.processes import free_port
from kvgate.stack.local_stack import (EPP_LEASE_TIMINGS, LocalStack, StackSpec, epp_healthy_in_envoy, epp_ready,
                                      launch_local_stack)
from kvgate.stack.supervisor import Stack

SIM_MODEL = "sim-model"
# Streams of a few seconds: long enough that a fault lands in the middle of many of them.
SIM_ENGINE_ARGS = ["--sim-step-overhead-ms", "10", "--sim-decode-ms-per-seq", "0.05"]


@dataclass(frozen=True)
class StackShape:
    envoy: str = "kvgate"  # or "upstream"
    fail_open: bool = False
    fallbacks: bool = False
    replicas: int = 4
    engine_loop: str = "thread"
    # kvgate's profile (precise prefix routing from engine KV events, the EPP tokenizing), the load over a few
    # tenants' shared prompts, and a rogue publisher bound where the EPP listens for the last engine's events
    kv_events: bool = False
    # EPPs as hosts of Envoy's EPP cluster; with leader_election, active-passive over a lease file with these
    # timings (lease duration, renew deadline, retry period, seconds)
    epp_replicas: int = 1
    leader_election: bool = False
    lease_timings: tuple[float, float, float] = EPP_LEASE_TIMINGS


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str
    fault: Callable[[LocalStack], faults.Injected]
    shape: StackShape
    expect: str  # "no-failure" | "victim-only" | "victim-only-and-window" | "epp-streams" | "until-epp-back"
    #              | "no-failure-cache-kept" | "until-follower-leads" | "epp-replica-streams"


# Scenarios sharing a stack shape run one after another on one stack (each waits for the last to heal).
_KVGATE = StackShape(fallbacks=True, engine_loop="process")
_PRECISE = StackShape(kv_events=True)
HIT_RATE_SLACK = 0.15  # no-failure-cache-kept: the prefix-cache hit rate after the fault, at most this below before
_LEADER = StackShape(epp_replicas=2, leader_election=True, lease_timings=(2.0, 1.5, 0.25))
# until-follower-leads: the lease runs out (as the follower saw it: up to a retry period late), it leads, and
# Envoy's next health check (1 s apart; a second one's slack) finds it SERVING
LEADER_RECOVER_S = _LEADER.lease_timings[0] + _LEADER.lease_timings[2] + 2.0
SCENARIOS = [
    Scenario("replica-kill", "SIGKILL a replica; kvgate's Envoy, EPP with fallbacks", faults.replica_kill,
             _KVGATE, "victim-only"),
    Scenario("replica-drain", "SIGTERM a replica (rollout / scale-down)", faults.replica_drain, _KVGATE,
             "no-failure"),
    Scenario("engine-loop-kill", "SIGKILL a replica's engine-loop process", faults.engine_loop_kill, _KVGATE,
             "victim-only"),
    Scenario("replica-kill-default", "SIGKILL a replica; kvgate's Envoy, the default EPP config (one endpoint)",
             faults.replica_kill, StackShape(), "victim-only-and-window"),
    Scenario("epp-kill-failclose", "SIGKILL the EPP, FailClose", faults.epp_kill, StackShape(),
             "until-epp-back"),
    Scenario("epp-kill-active-active", "SIGKILL one of two EPPs serving at once (active-active, peer-synced), "
             "FailClose", faults.epp_replica_kill, StackShape(epp_replicas=2), "epp-replica-streams"),
    Scenario("replica-kill-upstream", "SIGKILL a replica; stock upstream-shaped Envoy, default EPP config",
             faults.replica_kill, StackShape(envoy="upstream"), "victim-only-and-window"),
    Scenario("epp-drain-failopen", "SIGTERM the EPP (rollout), FailOpen", faults.epp_drain,
             StackShape(fail_open=True), "no-failure"),
    Scenario("epp-kill-failopen", "SIGKILL the EPP, FailOpen", faults.epp_kill, StackShape(fail_open=True),
             "epp-streams"),
    Scenario("epp-leader-kill", "SIGKILL the leading EPP of two (active-passive, a file lease: 2 s lease, 1.5 s "
             "renew deadline, 0.25 s retry), FailClose", faults.epp_leader_kill, _LEADER, "until-follower-leads"),
    Scenario("kv-replay-flood", "2000 KV-event replay requests to every engine; kvgate's profile",
             faults.kv_replay_flood, _PRECISE, "no-failure-cache-kept"),
    Scenario("kv-rogue-publisher", "malformed KV-event batches where the EPP listens for an engine; kvgate's "
             "profile", faults.kv_rogue_publisher, _PRECISE, "no-failure-cache-kept"),
]
BY_NAME = {s.name: s for s in SCENARIOS}


@dataclass
class Row:
    fault: str
    what: str
    sent: int
    succeeded: int
    failed: int
    victim_in_flight: int | None  # running on the victim just before the fault (its metrics)
    failed_not_on_victim: int  # failures of requests the victim had not taken (no response headers from it)
    out_of_rotation_s: float | None
    recover_s: float | None
    expect: str
    passed: bool
    errors: dict[str, int] = field(default_factory=dict)  # failure kinds, counted
    error_examples: dict[str, str] = field(default_factory=dict)  # one answer or exception per kind
    # kv_events shapes: the engines' prefix-cache hit rate during the warm-up and after the fault, and how many
    # engine event batches the EPP read after the fault (0: its reader stopped)
    hit_rate_before: float | None = None
    hit_rate_after: float | None = None
    kv_batches_after_fault: int | None = None


def verdict(expect: str, row: Row, epp_streams: int, concurrency: int = 0) -> bool:
    if expect == "no-failure":
        return row.failed == 0
    if expect == "victim-only":  # only what the victim had taken fails; everything else is served
        return row.failed_not_on_victim == 0 and row.out_of_rotation_s is not None
    if expect == "victim-only-and-window":  # ... plus what was routed there before its scrapes failed (no retry)
        return row.out_of_rotation_s is not None and row.out_of_rotation_s <= 1.0
    if expect == "epp-streams":  # what the EPP carried (bodies pass through it) breaks; new ones fail open
        return row.failed <= epp_streams and row.recover_s is not None
    if expect == "until-epp-back":  # FailClose: refused until the EPP is back, then served
        return row.recover_s is not None
    if expect == "until-follower-leads":  # FailClose: refused until the follower leads, within its lease's bound
        return row.recover_s is not None and row.recover_s <= LEADER_RECOVER_S
    if expect == "epp-replica-streams":  # what the killed replica carried breaks; new streams go to the other one
        #                                    (a worker's request sent to it before Envoy ejected it fails too)
        return (row.victim_in_flight is not None and row.failed <= row.victim_in_flight + concurrency
                and row.recover_s is not None)
    if expect == "no-failure-cache-kept":  # nothing lost, routing keeps its hit rate, the EPP still reads events
        return (row.failed == 0 and (row.kv_batches_after_fault or 0) > 0 and None not in (
            row.hit_rate_before, row.hit_rate_after) and row.hit_rate_after >= row.hit_rate_before - HIT_RATE_SLACK)
    raise ValueError(expect)


def _error_kind(o: Outcome) -> str:
    if o.status is not None and o.status != 200:
        return f"HTTP {o.status}"
    if o.error:
        return o.error.split(":", 1)[0]
    return "incomplete stream"


class StackPool:
    """One running stack per shape, started on first use and supervised (restarts, as `kvgate up` does) by a
    thread until closed."""

    def __init__(self, workdir: Path, startup_timeout: float = 120.0) -> None:
        self.workdir = workdir
        self.startup_timeout = startup_timeout
        self.stacks: dict[StackShape, LocalStack] = {}
        self.log: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._supervise, daemon=True)
        self._thread.start()

    def _supervise(self) -> None:
        while not self._stop.wait(0.1):
            for up in list(self.stacks.values()):
                self.log.extend(up.stack.supervise())

    def get(self, shape: StackShape) -> LocalStack:
        if shape not in self.stacks:
            self._stop_stacks()
            d = Path(tempfile.mkdtemp(prefix=f"stack-{len(self.log)}-", dir=self.workdir))
            stack = Stack(d)
            port = free_port()
            kv: dict = {}
            if shape.kv_events:  # the rogue binds first: the EPP connects once, then only backs off
                rogue_address = f"tcp://[::1]:{free_port()}"
                faults.ROGUE_PUBLISHERS[d] = attacks.bind_rogue(rogue_address)
                kv = {"kv_events": True, "epp_kv_event_override": {shape.replicas - 1: rogue_address},
                      "engine_hosts": [f"127.0.0.{2 + i}" for i in range(shape.replicas)]}
            config = KVGATE_PROFILE_FALLBACK_YAML if shape.kv_events else (
                FALLBACK_CONFIG_YAML if shape.fallbacks else None)
            try:
                self.stacks[shape] = launch_local_stack(stack, StackSpec(
                    replicas=shape.replicas, model=SIM_MODEL, backend="sim", host="127.0.0.1", port=port,
                    fail_open=shape.fail_open, epp_config_text=config, envoy_flavor=shape.envoy,
                    engine_args=[*SIM_ENGINE_ARGS, "--engine-loop", shape.engine_loop],
                    startup_timeout=self.startup_timeout, epp_replicas=shape.epp_replicas,
                    epp_leader_election=shape.leader_election, epp_lease_timings=shape.lease_timings, **kv))
            except BaseException:
                stack.stop()
                self._close_rogue(d)
                raise
        return self.stacks[shape]

    @staticmethod
    def _close_rogue(workdir: Path) -> None:
        rogue = faults.ROGUE_PUBLISHERS.pop(workdir, None)
        if rogue is not None:
            rogue.close(0)

    def _stop_stacks(self) -> None:
        for up in self.stacks.values():  # one stack at a time: the machine's cores go to the one measured
            up.stack.stop()
            self._close_rogue(up.stack.workdir)
        self.stacks.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._stop_stacks()


class _Poller:
    """The EPP's view of one endpoint (`kvgate_epp_endpoint_available`), polled every 20 ms on a thread of its own
    with a kept-alive connection: when it left rotation and when it came back, relative to the fault."""

    def __init__(self, up: LocalStack, endpoint: str, since: float, until: float) -> None:
        self.url, self.endpoint, self.since, self.until = f"http://127.0.0.1:{up.metrics_port}/metrics", endpoint, since, until
        self.out_s: float | None = None
        self.back_s: float | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _available(self, client: httpx.Client) -> bool | None:
        return _available_on(client, self.url, self.endpoint)

    def _run(self) -> None:
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < self.until and self.back_s is None:
                state = self._available(client)
                now = time.monotonic() - self.since
                if state is False and self.out_s is None:
                    self.out_s = now
                elif state is True and self.out_s is not None:
                    self.back_s = now
                time.sleep(0.02)

    def join(self) -> None:
        self._thread.join(max(0.0, self.until - time.monotonic()) + 2)


def _available_on(client, url: str, endpoint: str) -> bool | None:
    """The EPP's `kvgate_epp_endpoint_available` for `endpoint` (None: no answer or no such endpoint)."""
    try:
        text = client.get(url, timeout=1.0).text  # whole page: the EPP's custom collectors do not describe() names
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith(f'kvgate_epp_endpoint_available{{endpoint="{endpoint}"}}'):
            return float(line.rsplit(" ", 1)[1]) > 0
    return None


def _available(up: LocalStack, endpoint: str) -> bool | None:
    return _available_on(httpx, f"http://127.0.0.1:{up.metrics_port}/metrics", endpoint)


def _healthy_epps(up: LocalStack) -> set[str]:
    """The EPP children (by name) that Envoy's health check finds healthy now."""
    try:
        text = httpx.get(f"http://127.0.0.1:{up.admin_port}/clusters", timeout=2).text
    except httpx.HTTPError:
        return set()
    by_port = {str(grpc_port): name for name, grpc_port, _ in up.epps}
    return {by_port.get(line.split("::")[1].rsplit(":", 1)[-1], line.split("::")[1]) for line in text.splitlines()
            if line.startswith("epp-local::") and line.endswith("::health_flags::healthy")}


def _epp_back(up: LocalStack, hosts: int = 1) -> bool:
    if up.envoy_flavor == "kvgate":
        return epp_healthy_in_envoy(up.admin_port, "epp-local", hosts)
    return epp_ready(up.health_port)


async def _watch(until: float, check: Callable[[], bool | None], interval: float = 0.02) -> float | None:
    """Seconds until `check()` is true (polled in a thread), or None before `until`."""
    start = time.monotonic()
    while time.monotonic() < until:
        if await asyncio.to_thread(check):
            return time.monotonic() - start
        await asyncio.sleep(interval)
    return None


async def run_scenario(pool: StackPool, scenario: Scenario, *, concurrency: int, max_tokens: int, warmup_s: float,
                       hold_s: float, recover_within_s: float = 30.0,
                       tick: Callable[[], None] = lambda: None) -> Row:
    up = pool.get(scenario.shape)
    shape = scenario.shape
    await asyncio.to_thread(_wait_stack_whole, up, 60.0, 1 if shape.leader_election else shape.epp_replicas)
    kv = scenario.shape.kv_events
    load = StreamLoad(up.url, up.model, concurrency=concurrency, max_tokens=max_tokens,
                      prompt_for=tenant_prompts() if kv else None)
    cache = [await asyncio.to_thread(all_counters, up.endpoints)] if kv else []
    runner = asyncio.create_task(load.run())
    await asyncio.sleep(warmup_s)
    epp_streams = sum(1 for o in load.outcomes if o.ended_at is None)  # streams the EPP carries right now
    if kv:
        cache.append(await asyncio.to_thread(all_counters, up.endpoints))
        batches_at_fault = (await asyncio.to_thread(epp_kv_event_counts, up.metrics_port)).get("batches", 0)
    injected = await asyncio.to_thread(scenario.fault, up)
    deadline = injected.at + hold_s
    poller = _Poller(up, injected.victim, injected.at, deadline + recover_within_s) if injected.victim else None
    out_task = None
    if injected.epp is not None and shape.leader_election:  # a leader: back once Envoy finds another EPP ready
        def back() -> bool:
            return bool(_healthy_epps(up) - {injected.epp})
    elif injected.epp is not None:  # one of active-active EPPs: out once Envoy ejected it, back once restarted
        #                             and healthy there again
        out_task = asyncio.create_task(_watch(deadline, lambda: injected.epp not in _healthy_epps(up)))

        def back() -> bool:
            return up.child(injected.epp).proc.pid != injected.pid and injected.epp in _healthy_epps(up)
    else:  # the EPP killed: back once its restarted process is healthy
        def back() -> bool:
            return up.child("epp").proc.pid != injected.pid and _epp_back(up)
    back_task = None if injected.victim or injected.pid is None else asyncio.create_task(_watch(
        deadline + recover_within_s, back, 0.05))
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        tick()
    if kv:
        cache.append(await asyncio.to_thread(all_counters, up.endpoints))
        batches_after = (await asyncio.to_thread(epp_kv_event_counts, up.metrics_port)).get("batches", 0)
    load.stop()
    await runner
    if poller is not None:  # out of rotation when the EPP said so; back when it took the restarted replica again
        await asyncio.to_thread(poller.join)
        out_s, recover_s = poller.out_s, poller.back_s
    else:
        out_s, recover_s = (await out_task if out_task else None), (await back_task if back_task else None)
    failed = [o for o in load.outcomes if not o.ok(max_tokens)]
    errors: dict[str, int] = {}
    examples: dict[str, str] = {}
    for o in failed:
        kind = _error_kind(o)
        errors[kind] = errors.get(kind, 0) + 1
        examples.setdefault(kind, (o.error or "")[:160])
    on_victim = [o for o in failed if injected.victim and o.endpoint == injected.victim]  # it had taken them
    row = Row(scenario.name, scenario.what, len(load.outcomes), len(load.outcomes) - len(failed), len(failed),
              injected.victim_in_flight, len(failed) - len(on_victim),
              None if out_s is None else round(out_s, 3), None if recover_s is None else round(recover_s, 2),
              scenario.expect, False, errors, examples)
    if kv:
        row.hit_rate_before, row.hit_rate_after = hit_rate(cache[0], cache[1]), hit_rate(cache[1], cache[2])
        row.kv_batches_after_fault = batches_after - batches_at_fault
    row.passed = verdict(scenario.expect, row, epp_streams, concurrency)
    return row


def _wait_stack_whole(up: LocalStack, timeout: float, epp_hosts: int = 1) -> None:
    """Before a scenario: every replica back in rotation and `epp_hosts` EPPs healthy (the previous fault healed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _epp_back(up, epp_hosts) and all(_available(up, e) for e in up.endpoints):
            return
        time.sleep(0.1)
    raise TimeoutError(f"the stack did not heal within {timeout:g} s (logs: {up.stack.workdir})")


def rows_as_dicts(rows: list[Row]) -> list[dict]:
    return [asdict(r) for r in rows]


def default_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvgate-chaos-"))
