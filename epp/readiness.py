"""The EPP's gRPC health service: liveness SERVING from the start; readiness SERVING once the EPP can route and,
with leader election, while it leads (the protocol's rule for an active-passive EPP: followers are live but not
ready)."""

from __future__ import annotations

import asyncio
import logging
import threading

log = logging.getLogger("kvgate.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# Upstream's EPP reports its readiness under this gRPC health service name (its manifests probe it).
UPSTREAM_HEALTH_SERVICE = "inference-extension"
READINESS_SERVICES = ("readiness", EXT_PROC_SERVICE, UPSTREAM_HEALTH_SERVICE, "")

# Readiness waits for an endpoint it can route to (a first good scrape), at most this long after the pool's
# endpoints are known: a restarted EPP is not sent traffic it would answer 503, and a pool whose servers export
# no metrics (Kubernetes mode routes to their Ready pods) still gets an EPP.
READY_WITHOUT_SCRAPE_S = 2.0


class Health:
    """The health servicer the health server serves: liveness always SERVING, every readiness service name as
    `report` last said (NOT_SERVING until then)."""

    def __init__(self) -> None:
        from grpc_health.v1 import health

        self.servicer = health.aio.HealthServicer()

    async def start(self) -> None:
        from grpc_health.v1 import health_pb2

        await self.servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self.report(False)

    async def report(self, ready: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in READINESS_SERVICES:
            await self.servicer.set(name, status)


def can_route(director, datastore, seconds_since_sync: float) -> bool:
    """Whether the EPP may report ready: an empty pool (503 until pods come), an available endpoint, or the bound —
    which in standalone mode (no Ready pods to fall back on) also waits for every endpoint's first scrape to
    end: on a loaded machine a first scrape can take longer than the bound, and an EPP that turned ready before
    it would answer 503 for a pool that is fine."""
    if not datastore.endpoints or any(s.available for s in director.states()):
        return True
    if seconds_since_sync < READY_WITHOUT_SCRAPE_S:
        return False
    return director.trust_pool_readiness or director.datalayer.every_endpoint_scraped_once()


class Readiness:
    """The loop that keeps the health service's readiness true until stop: it checks whether the EPP can route
    (every 0.05 s until it can, then every 0.5 s) and turns SERVING once it can and leads. A leadership change
    (`set_leading`, from the elector's thread) wakes the loop at once."""

    def __init__(self, director, datastore, health: Health, leading: bool, on_serving=None) -> None:
        self.director, self.datastore, self.health = director, datastore, health
        self.on_serving = on_serving  # called with each new `serving` (the EPP's kvgate_epp_serving gauge)
        self.leading = leading  # True without leader election
        self.ready = False  # the EPP can route (set once)
        self.serving = False  # what the health service reports: ready and leading
        # Set with `ready`, for the elector's thread: a candidate once it can route, so a cold replica never leads.
        self.routable = threading.Event()
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._synced_at: float | None = None

    def set_leading(self, now: bool) -> None:
        """The elector's on_change: called from its thread."""
        self._loop.call_soon_threadsafe(self._set_leading, now)

    def _set_leading(self, now: bool) -> None:
        self.leading = now
        self._wake.set()

    async def run(self, stop: asyncio.Event, poll=None) -> None:
        """Until stop: `poll()` (the endpoints file's re-read, when there is one), then readiness updated."""
        while not stop.is_set():
            if poll is not None:
                poll()
            self._check_routable()
            if (self.ready and self.leading) != self.serving:
                self.serving = self.ready and self.leading
                await self.health.report(self.serving)
                if self.on_serving is not None:
                    self.on_serving(self.serving)
            self._wake.clear()
            try:
                await asyncio.wait_for(_first(stop.wait(), self._wake.wait()), timeout=0.5 if self.ready else 0.05)
            except asyncio.TimeoutError:
                pass

    def _check_routable(self) -> None:
        if not self.datastore.synced or self.ready:
            return
        loop = self._loop
        self._synced_at = self._synced_at or loop.time()
        if can_route(self.director, self.datastore, loop.time() - self._synced_at):
            self.ready = True
            self.routable.set()
            log.info("ready %.2f s after the pool's endpoints were known", loop.time() - self._synced_at)


async def _first(*aws) -> None:
    """Wait for the first of these awaitables; cancel the rest."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in tasks:
            t.cancel()
