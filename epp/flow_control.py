"""Flow control (`featureGates: [flowControl]`): while the pool is saturated, requests wait in the EPP instead of
piling onto engines, and leave in the order priority and fairness say — each placed on the state of the moment it
leaves (late binding), not of the moment it came.

Dispatch: strict priority between bands (InferenceObjective priority, higher first); within a band the fairness
policy picks a flow (flow id: the `x-gateway-inference-fairness-id` header, else the objective, else "default") —
round-robin takes turns, global-strict takes the band's best request whatever its flow; within a flow the ordering
policy picks (FCFS, EDF by arrival + x-slo-ttft-ms, or shortest prompt first with aging). A request leaves when the
pool has room: the saturation detector's headroom summed over endpoints (each endpoint's queue threshold minus its
waiting and not-yet-scraped requests; none on an endpoint with stale metrics or a full KV cache), less the requests
let go and not yet routed.
The dispatcher runs while anything waits, on every response's end and every scrape round, else every `poll_s`.

Bounds: requests and bytes per band and overall (429 when full), a TTL (429 for sheddable requests, 503 for the
rest, both with retry-after); a client that goes away leaves the queue at once. An empty pool has no room, so
requests wait for the first endpoint (scale from zero) within the same bounds.

Behind Envoy this needs the request body in FULL_DUPLEX_STREAMED mode (upstream's and kvgate's configs): there
Envoy's ext_proc message_timeout does not cut a held request (a hold longer than the stock config's 10 s
message_timeout completes); in BUFFERED mode the message_timeout does, so the TTL must stay below it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.epp.director import RoutingError
from kvgate.epp.flow_config import EDF, ROUND_ROBIN, SPF, BandConfig, FlowControlConfig
from kvgate.common.epp_protocol import FAIRNESS_ID_HEADER, OBJECTIVE_HEADER, TTFT_OBJECTIVE_HEADER
from kvgate.epp.types import LLMRequest

DISPATCHED = "Dispatched"
REJECTED_CAPACITY = "RejectedCapacity"
EVICTED_TTL = "EvictedTTL"
EVICTED_CANCELLED = "EvictedContextCancelled"
RETRY_AFTER_S = 1  # what a refused client is told to wait: the queue turns over within seconds when it moves
MAX_FLOW_ID_CHARS = 128  # a flow id is client text: kept short in memory, logs and metric labels
DEFAULT_FLOW = "default"
QUEUED, GRANTED, GONE = "queued", "granted", "gone"


@dataclass(eq=False)
class _Ticket:
    request: LLMRequest | None  # None once it left the queue: the expiry heap keeps the ticket until its TTL
    flow_id: str
    priority: int
    size: int
    enqueued_at: float
    expires_at: float
    key: tuple  # the ordering policy's sort key within its flow (smaller leaves first)
    future: asyncio.Future
    state: str = QUEUED


@dataclass(eq=False)
class _Flow:
    heap: list = field(default_factory=list)  # (key, ticket); removed tickets stay until they reach the top
    live: int = 0
    bytes: int = 0

    def head(self) -> _Ticket | None:
        while self.heap and self.heap[0][1].state != QUEUED:
            heapq.heappop(self.heap)
        return self.heap[0][1] if self.heap else None


@dataclass(eq=False)
class _Band:
    config: BandConfig
    flows: dict[str, _Flow] = field(default_factory=dict)  # flows with live requests only
    turns: deque = field(default_factory=deque)  # round-robin: (flow id, flow) in turn order
    count: int = 0
    bytes: int = 0


class Grant:
    """A request let go by the controller; `release()` once it is routed (or failed to be), so that its place in
    the pool's room is no longer reserved (the director's in-flight accounting holds it from then on)."""

    __slots__ = ("_controller",)

    def __init__(self, controller: "FlowController") -> None:
        self._controller = controller

    def release(self) -> None:
        if self._controller is not None:
            self._controller._granted -= 1
            self._controller = None


def flow_id_of(request: LLMRequest) -> str:
    headers = request.headers
    value = headers.get(FAIRNESS_ID_HEADER) or headers.get(OBJECTIVE_HEADER) or DEFAULT_FLOW
    return value.strip()[:MAX_FLOW_ID_CHARS] or DEFAULT_FLOW


def _slo_ttft_s(request: LLMRequest) -> float | None:
    value = request.headers.get(TTFT_OBJECTIVE_HEADER)
    try:
        ms = float(value) if value else None
    except ValueError:
        return None
    return ms / 1000.0 if ms is not None and 0 < ms < 1e9 else None


class FlowController:
    def __init__(self, config: FlowControlConfig, room: Callable[[], int], *, clock=time.monotonic,
                 poll_s: float = 0.05, observe: Callable[[str, int, str, float], None] | None = None) -> None:
        """`room()`: how many more requests the pool takes now (the saturation detector's headroom).
        `observe(flow_id, priority, outcome, seconds)`: each request's time in the controller, as it ends."""
        self.config = config
        self._room = room
        self._clock = clock
        self.poll_s = poll_s
        self._observe = observe
        self._bands: dict[int, _Band] = {}
        self._expiry: list = []  # (expires_at, seq, ticket)
        self._seq = itertools.count()
        self._granted = 0  # let go, not yet routed
        self.count = 0
        self.bytes = 0
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.dispatched = 0  # cumulative, by outcome
        self.rejected = 0
        self.expired = 0
        self.cancelled = 0

    # --- the request's side -------------------------------------------------------------------------------------
    async def admit(self, request: LLMRequest, size: int) -> Grant:
        """Wait until the request may be routed; raises RoutingError (429 full or sheddable past its TTL, 503
        past its TTL) with a retry-after header. Cancelling the caller takes the request out of the queue."""
        now = self._clock()
        if self.count == 0 and self._room() - self._granted > 0:  # nothing waits and there is room: no queue
            return self._grant_now(request, now)
        flow_id = flow_id_of(request)
        # a band is kept only while it holds requests (or is configured): a refused request leaves none behind
        band = self._bands.get(request.priority) or _Band(self.config.band(request.priority))
        limit = self._over_limit(band, size)
        if limit:
            self.rejected += 1
            self._record(flow_id, request.priority, REJECTED_CAPACITY, 0.0)
            raise RoutingError(429, f"the flow control queue is full ({limit}); retry later",
                               {"retry-after": str(RETRY_AFTER_S)})
        ticket = self._enqueue(request, flow_id, band, size, now)
        self._ensure_dispatcher()
        try:
            await ticket.future
        except asyncio.CancelledError:
            if ticket.state == QUEUED:
                self._remove(ticket)
                self.cancelled += 1
                self._record(flow_id, request.priority, EVICTED_CANCELLED, self._clock() - now)
            elif ticket.state == GRANTED:  # let go as the client went away: give its place back
                self._granted -= 1
                self.wake()
            raise
        return Grant(self)

    def _grant_now(self, request: LLMRequest, now: float) -> Grant:
        self._granted += 1
        self.dispatched += 1
        self._record(flow_id_of(request), request.priority, DISPATCHED, 0.0)
        return Grant(self)

    def _over_limit(self, band: _Band, size: int) -> str:
        c, g = band.config, self.config
        if band.count + 1 > c.max_requests:
            return f"priority {c.priority} holds {band.count} requests, its maxRequests"
        if band.bytes + size > c.max_bytes:
            return f"priority {c.priority} holds {band.bytes} bytes; this request's {size} exceed its maxBytes"
        if self.count + 1 > g.max_requests:
            return f"{self.count} requests held, maxRequests"
        if self.bytes + size > g.max_bytes:
            return f"{self.bytes} bytes held; this request's {size} exceed maxBytes"
        return ""

    def _enqueue(self, request: LLMRequest, flow_id: str, band: _Band, size: int, now: float) -> _Ticket:
        seq = next(self._seq)
        expires_at = now + self.config.default_ttl_s
        if band.config.ordering == EDF:
            slo = _slo_ttft_s(request)
            key = (now + slo if slo is not None else expires_at, seq)
        elif band.config.ordering == SPF:
            key = (now + band.config.ms_per_prompt_token / 1000 * request.estimated_prompt_tokens, seq)
        else:
            key = (seq,)
        ticket = _Ticket(request, flow_id, band.config.priority, size, now, expires_at, key,
                         asyncio.get_running_loop().create_future())
        self._bands.setdefault(band.config.priority, band)
        flow = band.flows.get(flow_id)
        if flow is None:
            flow = band.flows[flow_id] = _Flow()
            band.turns.append((flow_id, flow))
        heapq.heappush(flow.heap, (key, ticket))
        flow.live += 1
        flow.bytes += size
        band.count += 1
        band.bytes += size
        self.count += 1
        self.bytes += size
        heapq.heappush(self._expiry, (expires_at, seq, ticket))
        return ticket

    def _remove(self, ticket: _Ticket) -> None:
        """Out of the queue's counts (its heap entries go lazily, so the ticket lets go of the request and its
        body now: the expiry heap keeps a let-go ticket until its TTL, and at saturation that is every request of
        the last minute)."""
        ticket.state = GONE
        ticket.request = None
        band = self._bands[ticket.priority]
        flow = band.flows[ticket.flow_id]
        flow.live -= 1
        flow.bytes -= ticket.size
        band.count -= 1
        band.bytes -= ticket.size
        self.count -= 1
        self.bytes -= ticket.size
        if flow.live == 0:
            del band.flows[ticket.flow_id]  # a turn left in band.turns is skipped when it comes up
        if band.count == 0 and ticket.priority not in self.config.bands:
            del self._bands[ticket.priority]  # template bands live while they hold requests

    # --- the dispatcher -----------------------------------------------------------------------------------------
    def wake(self) -> None:
        """Room may have opened (a response ended, a scrape round came): dispatch now rather than at the poll."""
        if self._wake is not None and self.count:
            self._wake.set()

    def _ensure_dispatcher(self) -> None:
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._dispatch_loop(), name="flow-control")

    async def _dispatch_loop(self) -> None:
        while self.count:
            self.dispatch()
            if not self.count:
                break
            now = self._clock()
            until = min(self.poll_s, max(0.0, self._expiry[0][0] - now)) if self._expiry else self.poll_s
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=until)
            except asyncio.TimeoutError:
                pass

    def dispatch(self) -> int:
        """Expire what is past its TTL, then let go as many as the pool has room for; returns how many left."""
        now = self._clock()
        self._expire(now)
        room = self._room() - self._granted if self.count else 0
        sent = 0
        while room > 0 and self.count:
            ticket = self._next()
            if ticket is None:
                break
            self._remove(ticket)
            ticket.state = GRANTED
            self._granted += 1
            self.dispatched += 1
            self._record(ticket.flow_id, ticket.priority, DISPATCHED, now - ticket.enqueued_at)
            ticket.future.set_result(None)
            room -= 1
            sent += 1
        return sent

    def _next(self) -> _Ticket | None:
        """The request to let go next: the highest band holding any; its flow by the fairness policy; the flow's
        head by the ordering policy."""
        band = self._bands[max(p for p, b in self._bands.items() if b.count)]
        if band.config.fairness == ROUND_ROBIN:
            for _ in range(len(band.turns)):
                flow_id, flow = band.turns.popleft()
                if band.flows.get(flow_id) is not flow:
                    continue  # emptied since its turn was queued (a flow made again has its own turn)
                head = flow.head()
                if flow.live > 1:
                    band.turns.append((flow_id, flow))  # it holds more after this one: back of the line
                return head
            return None
        best = None
        for flow in band.flows.values():
            head = flow.head()
            if head is not None and (best is None or head.key < best.key):
                best = head
        return best

    def _expire(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            _, _, ticket = heapq.heappop(self._expiry)
            if ticket.state != QUEUED:
                continue
            self._remove(ticket)
            self.expired += 1
            waited = now - ticket.enqueued_at
            self._record(ticket.flow_id, ticket.priority, EVICTED_TTL, waited)
            sheddable = ticket.priority < 0
            ticket.future.set_exception(RoutingError(
                429 if sheddable else 503,
                f"the pool stayed saturated for the {self.config.default_ttl_s:g} s this request may wait in the "
                f"flow control queue" + (" (sheddable)" if sheddable else ""),
                {"retry-after": str(RETRY_AFTER_S)}))

    def _record(self, flow_id: str, priority: int, outcome: str, seconds: float) -> None:
        if self._observe is not None:
            self._observe(flow_id, priority, outcome, seconds)

    # --- what the metrics show ----------------------------------------------------------------------------------
    def rows(self) -> tuple[tuple[str, int, int, int], ...]:
        """(flow id, priority, requests, bytes) of every flow holding requests (call on the event loop)."""
        return tuple((flow_id, priority, flow.live, flow.bytes) for priority, band in self._bands.items()
                     for flow_id, flow in band.flows.items())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
