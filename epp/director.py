"""Per-request decisions: objective and model rewrite, admission, scheduling, and in-flight accounting.

In-flight accounting is exact at every decision (scheduling/live_load.py): the round snapshot's metric columns
stay cached, and a live overlay adds every request routed since — in flight, and not yet in the scrape the
snapshot holds — so a burst within one scrape round spreads instead of herding onto the round's best endpoint.
"""

from __future__ import annotations

import random
import time

from kvgate.common.epp_protocol import OBJECTIVE_HEADER
from kvgate.epp.scheduling.framework import CycleState
from kvgate.epp.scheduling.live_load import LoadTracker
from kvgate.epp.types import EndpointState, LLMRequest


class RoutingError(Exception):
    """A request that cannot be routed; answered with an ImmediateResponse of this HTTP status (and headers, such
    as flow control's retry-after)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def _record_decision(trace: dict, profile, cycle: CycleState, plugin_ns_before: dict) -> None:
    """A traced decision's profile, top scores (TOP_SCORES, best first) and each plugin's time in it."""
    from kvgate.epp.tracing import TOP_SCORES

    trace["profile"] = profile.name
    if cycle.snapshot is not None and cycle.scores is not None:
        endpoints = cycle.snapshot.endpoints
        best = sorted(range(len(endpoints)), key=lambda i: -cycle.scores[i])[:TOP_SCORES]
        trace["scores"] = [(endpoints[i].address, float(cycle.scores[i])) for i in best]
    trace["plugins"] = {(point, name): (ns - plugin_ns_before.get((point, kind, name), 0)) / 1e9
                        for (point, kind, name), ns in profile.timings.total_ns().items()
                        if ns != plugin_ns_before.get((point, kind, name), 0)}


class Director:
    def __init__(self, datastore, datalayer, scheduler, admission, metrics=None, seed: int | None = None,
                 trust_pool_readiness: bool = False, flow=None, peers=None) -> None:
        """`flow`: builds this director's flow_control.FlowController from its `dispatch_room` (None: no flow
        control); `peers`: builds its peer_sync.PeerSync from the director (None: no peer sync). Both are built
        last, over a director whose every other attribute is set."""
        self.datastore = datastore
        self.datalayer = datalayer
        self.scheduler = scheduler
        self.admission = admission
        self.metrics = metrics
        self.rng = random.Random(seed)
        # Kubernetes mode: the pool's endpoints are pods Kubernetes calls Ready (their readiness probe passed), so
        # when none has answered a scrape (servers without a metrics endpoint, like the conformance suite's
        # echo backends) they are still routable. Standalone endpoints have no such gate: unscraped means unknown.
        self.trust_pool_readiness = trust_pool_readiness
        self.load = LoadTracker()
        self._pool_of, self._pool = None, frozenset()  # in_pool's set of the datastore's endpoint list
        self.in_flight = self.load.by_address  # address → AddressLoad (requests, tokens, flights)
        self._selected_from: list[EndpointState] | None = None  # the snapshot `_selected` was chosen from
        self._selected: list[EndpointState] = []
        # flow_control.FlowController when the config's featureGates name flowControl: requests wait in it while
        # the pool is saturated, and legacy shedding (admission.admit) is off
        self.flow = flow(self.dispatch_room) if flow is not None else None
        # peer_sync.PeerSync when active-active replicas share their picks
        self.peers = peers(self) if peers is not None else None

    def states(self) -> list[EndpointState]:
        """Every endpoint of the pool with its metrics and this EPP's exact in-flight counts (stale ones
        included): what the metrics gauges show."""
        return self.datalayer.states(self._in_flight_counts())

    def candidates(self, subset: list[str] | None, round_snapshot: bool = False) -> list[EndpointState]:
        """The endpoints a request may go to: within the subset hint, the available ones (scraped at least once,
        scrapes not failing: an engine that is not up yet, or has died, gets no request), and of those the fresh
        ones when any is fresh. Metrics older than the staleness threshold describe an endpoint that may be
        overloaded: it is picked only when every available candidate is stale, so routing degrades rather than
        stops. With `trust_pool_readiness`, a pool with no available endpoint falls back to all its endpoints.

        `round_snapshot`: the datalayer's per-scrape-round snapshot, reused across decisions (the scheduler's
        per-snapshot caches hold, and without a subset hint so does this selection), else states built now.
        """
        if round_snapshot:
            states = self.datalayer.snapshot(self._in_flight_counts)
            if subset is None and states is self._selected_from:
                return self._selected
        else:
            states = self.datalayer.states(self._in_flight_counts())
        selected = self._select(states, subset)
        if round_snapshot and subset is None:
            self._selected_from, self._selected = states, selected
        return selected

    def _select(self, states: list[EndpointState], subset: list[str] | None) -> list[EndpointState]:
        if subset is not None:
            allowed = set(subset)
            states = [s for s in states if s.address in allowed]
        usable = [s for s in states if s.available]
        if not usable and self.trust_pool_readiness:
            usable = states
        fresh = [s for s in usable if not s.stale]
        return fresh if fresh else usable

    def _in_flight_counts(self) -> dict[str, tuple[int, int]]:
        return self.load.counts()

    def waits_before_pick(self, request: LLMRequest) -> bool:
        """Whether the request has to wait before `pick`: for a plugin's slow work, or in flow control (see
        `before_pick`)."""
        return self.flow is not None or self.scheduler.needs_prepare(request)

    async def before_pick(self, request: LLMRequest, body_bytes: int):
        """Plugins' slow per-request work (the precise prefix scorer tokenizing a long prompt), off the event loop
        and each within its own time budget, so that no other decision waits on it; then, with flow control, the
        wait for room in the pool. Returns flow control's Grant (release it once `pick` returned or raised) or
        None; raises RoutingError when flow control refuses the request."""
        if self.scheduler.needs_prepare(request):
            await self.scheduler.prepare(request)
        if self.flow is None:
            return None
        self.classify(request)
        started = time.perf_counter()
        try:
            return await self.flow.admit(request, body_bytes)
        finally:
            request.flow_wait_s = time.perf_counter() - started

    def classify(self, request: LLMRequest) -> None:
        """The request's priority (its InferenceObjective) and target model (InferenceModelRewrite), once."""
        if request.classified:
            return
        request.classified = True
        request.priority = self.datastore.priority(request.headers.get(OBJECTIVE_HEADER))
        if request.model:
            request.target_model = self.datastore.rewrite(request.model, self.rng)

    def dispatch_room(self) -> int:
        """How many more requests the pool takes now, by the saturation detector (flow control's dispatch gate):
        counted over the round's snapshot with this EPP's requests routed since the scrape."""
        states = self.candidates(None, round_snapshot=True)
        if not states:
            return 0
        load = self.load.view(self.datalayer.snapshot(self._in_flight_counts))
        return self.admission.room(states, load.column("unseen_requests", states))

    def pick(self, request: LLMRequest, subset: list[str] | None = None, trace: dict | None = None
             ) -> list[EndpointState]:
        """Ordered endpoints for the request (primary first); raises RoutingError (503 / 429). `trace`, when given
        (the request is traced), gets the decision's details: candidates, top scores, profile, plugin times."""
        started = time.perf_counter()
        self.classify(request)
        states = self.candidates(subset, round_snapshot=True)
        if not states:
            why = ("the subset hint matches no ready endpoint of the pool" if subset is not None
                   else "the pool has no ready endpoints (none answers its metrics scrape)")
            raise RoutingError(503, f"no eligible endpoint: {why}")
        # The exact in-flight overlay, laid on the round's whole snapshot (columns map the candidates onto it).
        load = self.load.view(self.datalayer.snapshot(self._in_flight_counts))
        if request.priority < 0 and self.flow is None and not self.admission.admit(
                request, states, load.column("unseen_requests", states)):
            raise RoutingError(429, "the pool is saturated and this request is sheddable (priority < 0)")
        cycle = CycleState(load)  # this decision's plugin state, from scoring to the pick hook
        if trace is not None:
            trace["candidates"] = len(states)
            plugin_ns = self.scheduler.primary.timings.total_ns()
        ordered = self.scheduler.schedule(request, states, cycle)
        if trace is not None:
            _record_decision(trace, self.scheduler.primary, cycle, plugin_ns)
        if not ordered:
            raise RoutingError(503, "no eligible endpoint: every endpoint was filtered out")
        if request.priority < 0 and self.scheduler.objectives_unmeetable(cycle):
            raise RoutingError(429, "no endpoint is predicted to meet this sheddable request's latency objectives "
                                    "(x-slo-ttft-ms / x-slo-tpot-ms)")
        primary, ordered = self._commit(request, states, ordered, cycle)
        prompt = request.estimated_prompt_tokens
        uncached = self.scheduler.picked_uncached_tokens(cycle, prompt)  # what the pick adds to its prefill backlog
        tokens = prompt + (request.max_tokens or 0)
        self.load.add(request, primary.address, tokens, uncached)
        if self.peers is not None:
            self.peers.publish_pick(request, primary.address, tokens, uncached,
                                    self.scheduler.share_pick(request, primary, cycle))
        if self.metrics is not None:
            self.metrics.scheduling_seconds.observe(time.perf_counter() - started)
        return ordered

    def _commit(self, request: LLMRequest, states: list[EndpointState], ordered: list[EndpointState],
                cycle: CycleState) -> tuple[EndpointState, list[EndpointState]]:
        """Run the pick hooks on the first endpoint of `ordered` they do not fail on: one whose data a hook fails on
        goes to the scheduler's quarantine and the next takes its place; when the hooks failed on every one, the
        decision runs once more without them. (primary, the order from it)."""
        for attempt in range(2):
            for i, primary in enumerate(ordered):
                try:
                    self.scheduler.on_picked(request, primary, cycle)
                    return primary, ordered[i:] if i else ordered
                except Exception as exc:  # noqa: BLE001 - this endpoint's data; raised again if every one's
                    if attempt == 1 and i == len(ordered) - 1:
                        raise
                    self.scheduler.quarantine(primary.address, exc, "the pick hook")
            cycle.clear()
            cycle.snapshot = None
            ordered = self.scheduler.schedule(request, states, cycle)  # the quarantined ones left out
            if not ordered:
                break
        raise RoutingError(503, "no eligible endpoint: the pick hooks failed on every endpoint's data")

    def release(self, request: LLMRequest, address: str, prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        """The response ended (or broke): undo the in-flight accounting and tell the plugins."""
        self.load.release(request, address)
        self.scheduler.on_response_complete(request, address, prompt_tokens, completion_tokens)
        if self.peers is not None:
            self.peers.publish_done(request)
        if self.flow is not None:
            self.flow.wake()  # its place in the pool is free: a held request may go
        if self.metrics is not None and (prompt_tokens or completion_tokens):
            self.metrics.tokens.labels(address, "prompt").inc(prompt_tokens)
            self.metrics.tokens.labels(address, "completion").inc(completion_tokens)

    # --- a peer replica's picks (epp/peer_sync.py): laid on this replica's state as if it had picked them ----------
    def in_pool(self, address: str) -> bool:
        endpoints = self.datastore.endpoints  # replaced, never changed in place, when the pool changes
        if endpoints is not self._pool_of:
            self._pool_of, self._pool = endpoints, {e.address for e in endpoints}
        return address in self._pool

    def peer_picked(self, flight, tokens: int, uncached: int, shared) -> None:
        """`flight` (a PeerFlight: its pick id and endpoint) counts in the live load and the plugins' state."""
        self.load.add(flight, flight.address, tokens, uncached)
        self.scheduler.apply_peer_pick(flight.pick_id, flight.address, shared)

    def peer_released(self, flight) -> None:
        self.load.release(flight, flight.address)
        self.scheduler.apply_peer_done(flight.pick_id, flight.address)
        if self.flow is not None:
            self.flow.wake()
