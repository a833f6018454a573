"""How the EPP stops on SIGTERM: a leader hands the Lease over (`hand_over`), then the ext-proc server drains
(`drain`) so that no stream the gateway routed here is refused or cut before its time."""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger("kvgate.epp")

# On SIGTERM the streams in flight get this long to finish (a rollout's old pod lingers for them; the operator's
# terminationGracePeriodSeconds covers it): long generations finish, a stuck stream cannot hold the pod forever.
DEFAULT_SHUTDOWN_TIMEOUT_S = 60.0
# The lame-duck phase of a drain (see drain()): Envoy's gRPC health check drops a NOT_SERVING EPP at its next
# check (1 s apart; only network failures wait for the unhealthy threshold of 3), a Service's endpoints take a
# moment to drop the pod. (The operator's EPP pods also sleep 5 s in preStop, answering SERVING, before SIGTERM.)
LAME_DUCK_QUIET_S = 1.0
# Behind a Service the gateway's connection moves to the new pod only on GOAWAY: the lame duck ends after this.
LAME_DUCK_MAX_S = 5.0
# After a successor took the Lease: Envoy's EPP health check runs every second (common/envoy_config.py), so within
# this it has seen the successor SERVING; only then does the old leader turn NOT_SERVING and drain.
HANDOVER_GRACE_S = 1.5


async def hand_over(elector, was_leading: bool) -> None:
    """On SIGTERM with leader election: release the Lease, and if this EPP was the ready leader, keep serving
    until a follower holds the Lease and Envoy's health check (1 s apart) has had time to find it ready: with
    healthy_panic_threshold 0 (kvgate's config then) Envoy answers 500 while no EPP is ready. Bounded: two retry
    periods and a second for a successor, then the drain goes on regardless."""
    loop = asyncio.get_running_loop()
    try:
        await loop.run_in_executor(None, elector.stop)
        if not was_leading:
            return
        successor = await loop.run_in_executor(None, elector.wait_for_successor,
                                               2 * elector.retry_period + 1.0)
    except Exception:  # the API server unreachable (a urllib3 error, not an ApiException): the drain still runs
        log.exception("leader election: the hand-over failed; draining anyway")
        return
    if successor is None:
        log.warning("leader election: no follower took the Lease; draining anyway")
        return
    log.info("leader election: %s leads now; serving %.1f s more while the gateways find it ready", successor,
             HANDOVER_GRACE_S)
    await asyncio.sleep(HANDOVER_GRACE_S)


async def drain(server, extproc, health, shutdown_timeout: float, report_not_serving: bool = True) -> None:
    """SIGTERM: readiness turns NOT_SERVING at once (`--drain-health not-serving`, for a gateway that addresses
    this EPP itself: its health check takes it out and sends the next streams to another EPP or the failure mode;
    behind a Service, `serving`: the gateway's one host is the Service, whose health must not flip while a new
    pod serves), and the EPP goes on serving every stream, new ones too, while the gateway notices (or the pod
    leaves the Service's endpoints): until no stream has started for `LAME_DUCK_QUIET_S` — addressed directly,
    within `shutdown_timeout` (the gateway may not know another EPP yet); behind a Service, at most
    `LAME_DUCK_MAX_S`.
    Closing earlier would refuse streams Envoy has already routed here — and Envoy can fail open only before it
    has sent a body chunk, so those would be 500s even under FailOpen. Then grpc's stop sends GOAWAY (the
    gateway's next streams open a new connection: the new EPP pod, or its failure mode) and the streams in
    flight, whose response bodies pass through here, finish within `shutdown_timeout`; only those still
    running then are cut.

    `server`: the ext-proc grpc.aio server; `extproc`: its servicer (streams started, active); `health`: the
    readiness.Health the health server serves."""
    if report_not_serving:
        await health.report(False)
    loop = asyncio.get_running_loop()
    began = loop.time()
    # A gateway that addresses this EPP leaves it when its health check and its endpoint list say so; until its
    # list names another EPP it keeps sending here (one host, unhealthy: Envoy's panic routing), and a stream
    # refused here is a 500. So the lame duck lasts while streams keep coming, within the shutdown timeout. Behind
    # a Service, only GOAWAY moves the gateway's connection to the new pod: the lame duck lasts while the Service
    # drops this pod, at most LAME_DUCK_MAX_S.
    budget = shutdown_timeout if report_not_serving else min(LAME_DUCK_MAX_S, shutdown_timeout)
    while loop.time() - began < budget and loop.time() - max(extproc.last_started, began) < LAME_DUCK_QUIET_S:
        await asyncio.sleep(0.1)
    remaining = max(0.0, shutdown_timeout - (loop.time() - began))
    if extproc.active:
        log.info("draining: %d streams in flight, up to %.0f s", extproc.active, remaining)
    stopping = asyncio.create_task(server.stop(grace=remaining))  # GOAWAY now; cancels what runs at the end
    deadline = loop.time() + remaining
    while extproc.active and loop.time() < deadline - 0.05:
        await asyncio.sleep(0.05)
    cut = extproc.active
    await stopping
    if cut:
        log.warning("cut %d streams still running after %g s", cut, shutdown_timeout)
