"""The faults of `kvgate bench chaos`, each injected into a running local stack while streaming load flows.

A fault is a function `(stack) -> Injected`: it breaks something and says which endpoint (if any) it hit and
when. The runner (bench/chaos/runner.py) owns the load, the timing and the verdict; faults stay small and pure
side effects on the stack's processes.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvgate.bench.chaos import attacks
from kvgate.stack.local_stack import LocalStack

# Stacks of a shape with a rogue KV-event publisher: its PUB socket, bound before the stack started where the EPP
# believes the last engine publishes (bench/chaos/runner.py StackPool), by the stack's workdir.
ROGUE_PUBLISHERS: dict[Path, object] = {}


@dataclass
class Injected:
    at: float  # time.monotonic() of the fault
    victim: str | None = None  # the endpoint hit, for engine faults
    victim_in_flight: int | None = None  # what the victim was running just before (an engine's own metrics; an
    #                                      EPP replica's streams as Envoy counts them)
    pid: int | None = None  # the process hit (EPP faults: recovery is a new one, ready)
    epp: str | None = None  # the EPP child hit among replicas (active-passive, recovery: another one leads;
    #                         active-active, recovery: it is back in Envoy's rotation)


def _engine_in_flight(address: str) -> int | None:
    import httpx

    try:
        text = httpx.get(f"http://{address}/metrics", timeout=1.0).text
    except httpx.HTTPError:
        return None
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def _signal_engine(stack: LocalStack, index: int, sig: int) -> Injected:
    address = stack.endpoints[index]
    in_flight = _engine_in_flight(address)
    child = stack.child(f"engine-{index}")
    at = time.monotonic()
    if sig == signal.SIGKILL:  # the whole replica dies, as a container does
        os.killpg(child.proc.pid, sig)
    else:  # as Kubernetes signals a container: its main process only (the server drains its engine loop itself)
        os.kill(child.proc.pid, sig)
    return Injected(at, address, in_flight)


def replica_kill(stack: LocalStack) -> Injected:
    """SIGKILL one replica (its whole process group): the supervisor restarts it after its backoff."""
    return _signal_engine(stack, 1, signal.SIGKILL)


def replica_drain(stack: LocalStack) -> Injected:
    """SIGTERM one replica: it turns unready, admits nothing new and finishes its running streams."""
    return _signal_engine(stack, 1, signal.SIGTERM)


def engine_loop_kill(stack: LocalStack) -> Injected:
    """SIGKILL the engine-loop process of one replica (its server lives on, finds the loop dead, fails what it
    was running and exits; the supervisor restarts it)."""
    address = stack.endpoints[1]
    in_flight = _engine_in_flight(address)
    server = stack.child("engine-1").proc.pid
    loops = [pid for pid in Path(f"/proc/{server}/task/{server}/children").read_text().split()
             if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]  # not multiprocessing's resource tracker
    if not loops:
        raise RuntimeError("the replica has no engine-loop process (start it with --engine-loop process)")
    at = time.monotonic()
    os.kill(int(loops[0]), signal.SIGKILL)
    return Injected(at, address, in_flight)


def epp_kill(stack: LocalStack) -> Injected:
    """SIGKILL the EPP: the streams whose bodies it carried break; the supervisor restarts it."""
    pid = stack.child("epp").proc.pid
    at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return Injected(at, pid=pid)


def epp_drain(stack: LocalStack) -> Injected:
    """SIGTERM the EPP: it drains the streams it carries; new ones take the gateway's failure mode until the
    supervisor has restarted it."""
    pid = stack.child("epp").proc.pid
    at = time.monotonic()
    os.kill(pid, signal.SIGTERM)
    return Injected(at, pid=pid)


def epp_leader_kill(stack: LocalStack) -> Injected:
    """SIGKILL the leading EPP of active-passive replicas (the one whose health port answers SERVING): the streams
    it carried break and new ones fail (FailClose) until a follower's lease wait ends, it leads and turns SERVING,
    and Envoy's health check finds it. The supervisor restarts the killed one, which comes back as a follower."""
    from kvgate.stack.local_stack import epp_ready

    leaders = [name for name, _, health_port in stack.epps if epp_ready(health_port)]
    if len(leaders) != 1:
        raise RuntimeError(f"expected one leading EPP, found {leaders or 'none'} (logs: {stack.stack.workdir})")
    pid = stack.child(leaders[0]).proc.pid
    at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return Injected(at, pid=pid, epp=leaders[0])


def _envoy_streams_to(admin_port: int, cluster: str, port: int) -> int | None:
    """The streams Envoy has open to `cluster`'s host on `port` (its /clusters `rq_active`): for an EPP, the
    ext-proc streams it carries, each a request whose body passes through it. The EPP's own
    `kvgate_epp_endpoint_in_flight_requests` would not do: with peer sync it counts its peers' picks too."""
    import httpx

    try:
        text = httpx.get(f"http://127.0.0.1:{admin_port}/clusters", timeout=1.0).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and parts[1].rsplit(":", 1)[-1] == str(port) \
                and parts[2] == "rq_active":
            return int(parts[3])
    return None


def epp_replica_kill(stack: LocalStack) -> Injected:
    """SIGKILL one of two EPPs serving at once (active-active hosts of Envoy's EPP cluster): the streams it
    carried break; Envoy ejects it at their resets (or at a new stream's connect failure) and sends new streams to
    the other one. The supervisor restarts it, and Envoy takes it back once its health check passes."""
    if len(stack.epps) < 2:
        raise RuntimeError("the stack has one EPP (a shape with epp_replicas=2)")
    name, grpc_port, _ = stack.epps[1]
    held = _envoy_streams_to(stack.admin_port, "epp-local", grpc_port)
    pid = stack.child(name).proc.pid
    at = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    return Injected(at, victim_in_flight=held, pid=pid, epp=name)


def _in_background(attack, target: attacks.Target) -> Injected:
    at = time.monotonic()
    threading.Thread(target=attack, args=(target,), daemon=True, name=f"fault-{attack.__name__}").start()
    return Injected(at)


def kv_replay_flood(stack: LocalStack) -> Injected:
    """2000 replay requests to every engine's KV-event replay socket, answers read as fast as they come."""
    return _in_background(attacks.replay_flood, attacks.Target(stack.url, stack.endpoints, stack.model,
                                                               stack.event_sockets))


def kv_rogue_publisher(stack: LocalStack) -> Injected:
    """Malformed KV-event batches, for 2 s, where the EPP listens for one engine's events."""
    rogue = ROGUE_PUBLISHERS.get(stack.stack.workdir)
    if rogue is None:
        raise RuntimeError("the stack has no rogue publisher (a shape with rogue_publisher=True)")
    return _in_background(attacks.rogue_publisher, attacks.Target(stack.url, stack.endpoints, stack.model,
                                                                  stack.event_sockets, rogue=rogue))
