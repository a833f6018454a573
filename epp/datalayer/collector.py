"""The datalayer: scrape each endpoint's Prometheus /metrics every `interval` and keep the latest numbers.

Modelled on upstream's datalayer (a collector per endpoint, a data source, an extractor, an injected ticker):
- one Ticker wakes the Datalayer every `interval`; each round, every idle EndpointCollector writes one GET
  on its keep-alive MetricsConnection (the source), and the answer is parsed in the connection's callback
  by the dialect's extractor (`parse_metrics`). One wakeup per round, not one sleeping task per endpoint.
- a request unanswered after `timeout` fails at the first round past it (so the timeout is precise to one
  interval) and drops its connection; the next round reconnects. An endpoint is never asked twice at once: a slow one is scraped as often as it answers.
- prometheus_client servers are asked for only the dialect's families (`?name[]=`); an engine that answers
  the filtered URL with an error or a page without them is scraped unfiltered from then on.
- a body byte-identical to the last one is not parsed again (its numbers are the same).
- each scrape also feeds the endpoint's prefill-rate estimator (prefill_rate.py: EndpointMetrics.prefill_tokens_per_s).
- a page is input: its body is bounded (`max_bytes`, http_client.py), every value is checked against its range
  as it is parsed (value_bounds.py; what is dropped is counted per endpoint, family and reason, and logged at most
  every LOG_EVERY_S per endpoint), and an endpoint whose answer took c seconds of CPU to read and parse (answered
  or failed) is not asked again for READ_BACKOFF·c, so that no endpoint's answers take more than 1/READ_BACKOFF of
  the event loop.
- a failed scrape keeps the previous numbers; they turn stale once older than `staleness` seconds, which
  the saturation detector and plugins can see — or at once after FAILURES_OUT_OF_ROTATION consecutive failed
  scrapes: a dead engine (connection refused, HTTP 503 from a dead engine loop) leaves rotation within about
  two intervals (~100 ms), not after the staleness threshold; one that hangs leaves at its first timeout
  past that count. The first successful scrape brings it back.
- an answer is read (HTTP framing, in httptools) as it arrives, and queued; the pages are parsed from the queue
  ANSWER_TURN_S of the loop's time at a time, the loop polling its sockets between turns, so that a burst of answers
  holds a request's messages back for one turn, not for all of them (`kvgate bench epp --parts scale`).
- a round is spread over the interval: its endpoints are asked in slices of ROUND_SLICE, the slices evenly apart,
  so that the answers of a large pool come back spread too, and a request's messages on the same event loop wait
  for one slice's answers at most, never a whole round's (a pool of up to ROUND_SLICE endpoints is asked at once).
- scraping takes at most SCRAPE_LOOP_SHARE of the event loop, the pool together: a round whose sends and answers
  took c seconds of the loop's CPU is followed by the next no sooner than c / SCRAPE_LOOP_SHARE after it began.
  The interval holds wherever the pool's pages cost less than that; past it, each endpoint is scraped less often,
  as often as the share allows, rather than the requests waiting on the loop. `kvgate_epp_scrapes_total`'s rate over the
  endpoints shows the interval achieved; the in-flight overlay (scheduling/live_load.py) counts the requests
  routed since an endpoint's last scrape, whatever its age.
After each round the Datalayer calls its round listeners on the event loop: the EPP's Prometheus exporter
publishes its snapshot there.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping

from kvgate.epp.datalayer.dialects import DIALECTS, dialect_for
from kvgate.epp.datalayer.exposition import MetricsParseError, comparable, parse_metrics
from kvgate.epp.datalayer.http_client import DEFAULT_MAX_BYTES, MetricsConnection, ScrapeError
from kvgate.epp.datalayer.prefill_rate import PrefillRateEstimator
from kvgate.epp.datalayer.value_bounds import Rejections
from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState

# Consecutive failed scrapes that count an endpoint as stale whatever the age of its numbers: 2, so that one
# lost scrape (a GC pause, a dropped keep-alive connection) does not flap it, and a dead one goes in ~2 rounds.
FAILURES_OUT_OF_ROTATION = 2
PREFILL_TIMING_SERIES = DIALECTS["vllm"].prefill_seconds.name  # the series the log names (kvgate engines export it)
READ_BACKOFF = 10.0  # an endpoint whose answer took c seconds to read and parse waits READ_BACKOFF·c for its next
LOG_EVERY_S = 30.0  # at most one log line per endpoint this often about values its pages carried out of range
ROUND_SLICE = 50  # endpoints asked at once; a round of more is spread over the interval in slices of this many
ANSWER_TURN_S = 0.0005  # pages parsed from the queue at a time, at least one, before the loop polls its sockets
SCRAPE_LOOP_SHARE = 0.5  # of the event loop's time, at most, that scraping the pool takes (its CPU, sends and answers)

log = logging.getLogger("kvgate.epp.datalayer")

OnChange = Callable[[str, EndpointMetrics | None], None]


class Ticker:
    """Yields once per `interval`; when a round overran (a busy loop), the cadence restarts instead of bursting."""

    def __init__(self, interval: float) -> None:
        self.interval = interval

    async def ticks(self) -> AsyncIterator[float]:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            yield loop.time()
            next_at += self.interval
            delay = next_at - loop.time()
            if delay < 0:
                next_at, delay = loop.time(), 0.0
            await asyncio.sleep(delay)


class EndpointCollector:
    """One endpoint's scraping: its connection, the latest metrics and the counters."""

    __slots__ = ("endpoint", "metrics", "connection", "scrapes", "failures", "consecutive_failures", "failing", "sent_at", "filtered",
                 "prefill_rate", "timing_said", "last_body", "connecting", "removed", "failed_by", "rejected",
                 "not_before", "rejections_said_at", "rejections_unsaid", "cpu_s", "queued", "_layer")

    def __init__(self, endpoint: Endpoint, layer: "Datalayer") -> None:
        self.endpoint = endpoint  # replaced in place when the pod's metadata changes
        self.metrics = EndpointMetrics()  # updated_at 0: never scraped, so stale
        self.connection = MetricsConnection(endpoint.address, timeout=layer.timeout, max_bytes=layer.max_bytes)
        self.scrapes = 0
        self.failures = 0
        self.consecutive_failures = 0
        self.failing = False
        self.sent_at: float | None = None  # loop time of the request in flight (or of the connect)
        self.filtered = layer.filter_families  # ask for only the dialect's families
        self.last_body = b""
        self.prefill_rate = PrefillRateEstimator()
        self.timing_said: bool | None = None  # what the log last said of the engine's prefill timing (None: nothing)
        self.connecting: asyncio.Task | None = None
        self.removed = False
        self.failed_by: dict[str, int] = {}  # failed scrapes by reason (timeout, connect, too_large, ...)
        self.rejected: dict[tuple[str, str], int] = {}  # values dropped by (family, reason), value_bounds.py
        self.not_before = 0.0  # loop time before which no scrape starts (READ_BACKOFF)
        self.cpu_s = 0.0  # CPU seconds of the event loop its answers took to read and parse, in all
        self.rejections_said_at: float | None = None  # when the log last named this endpoint's rejected values
        self.rejections_unsaid = 0  # rejected since then
        self.queued = False  # its answer waits in the layer's queue to be parsed
        self._layer = layer

    def path(self) -> str:
        return dialect_for(self.endpoint.engine_type).metrics_path(self.filtered)

    def scrape(self, now: float) -> None:
        """Start one scrape unless one is in flight; fail the one in flight once past the timeout."""
        if self.sent_at is not None:
            if now - self.sent_at >= self._layer.timeout and not self.queued:
                if self.connecting is not None:
                    task, self.connecting = self.connecting, None
                    task.cancel()
                    self.on_answer(0, b"", TimeoutError(f"no connection in {self._layer.timeout}s"))
                else:
                    self.connection.abort(TimeoutError(f"no answer in {self._layer.timeout}s"))
            return
        if now < self.not_before:
            return
        self.sent_at = now
        path = self.path()
        if path != self.connection.path:
            self.connection.set_path(path)
        if self.connection.connected:
            self.connection.send(self.answered)
        else:
            self.connecting = asyncio.get_running_loop().create_task(
                self._connect_and_send(), name=f"metrics connect {self.endpoint.address}")

    async def _connect_and_send(self) -> None:
        me = asyncio.current_task()
        try:
            await self.connection.connect()
        except asyncio.CancelledError:
            raise  # by the timeout (which recorded the failure), by removal or by stop
        except Exception as e:  # noqa: BLE001 - refused, unreachable...: a failed scrape
            if self.connecting is me:
                self.connecting = None
                self.on_answer(0, b"", e)
            return
        if self.connecting is not me:
            return
        self.connecting = None
        if self.removed:
            self.connection.close()
        else:
            self.connection.send(self.answered)

    def answered(self, status: int, body: bytes, exc: BaseException | None) -> None:
        """The connection's callback: the answer (or failure) joins the layer's queue, parsed in its turn."""
        self.queued = True
        self._layer.queue_answer(self, status, body, exc)

    def on_answer(self, status: int, body: bytes, exc: BaseException | None) -> None:
        """An answer's turn (or a failure found here): parse, record, notify. Never raises into the event loop."""
        self.sent_at = None
        self.queued = False
        layer = self._layer
        if self.removed or not layer.running:  # removed, or the connection closed by stop(): not a failure
            return
        cost = self.connection.cost_s
        try:
            if exc is not None:
                raise exc
            if status != 200:
                raise ScrapeError(f"HTTP {status}", "http_status")
            if body == self.last_body:  # byte-identical: same numbers, only fresher
                metrics = dataclasses.replace(self.metrics, updated_at=time.monotonic())
            else:
                started = time.thread_time()  # CPU, not wall time: a preempted loop is not the page's cost
                rejections = Rejections()
                try:
                    metrics = parse_metrics(body.decode("utf-8", "replace"), dialect_for(self.endpoint.engine_type),
                                            time.monotonic(), rejections)
                finally:
                    cost += time.thread_time() - started
                if rejections:
                    self._count_rejections(rejections)
                self.last_body = body
        except Exception as e:  # noqa: BLE001 - any failure keeps the old numbers; staleness reports it
            self.cpu_s += cost
            layer.scrape_cpu_s += cost
            self.not_before = time.monotonic() + READ_BACKOFF * cost
            self.last_body = b""
            if self.filtered and (isinstance(e, MetricsParseError) or 400 <= status < 500):
                self.filtered = False  # the engine does not take the name[] filter: read its whole page
                log.info("scraping %s: the filtered page failed (%s); reading the whole page from now on",
                         self.endpoint.metrics_url, str(e) or type(e).__name__)
            self.failures += 1
            self.consecutive_failures += 1
            reason = _failure_reason(e)
            self.failed_by[reason] = self.failed_by.get(reason, 0) + 1
            if not self.failing:
                self.failing = True
                log.warning("scraping %s failed: %s", self.endpoint.metrics_url, str(e) or type(e).__name__)
            return
        self.cpu_s += cost
        layer.scrape_cpu_s += cost
        self.not_before = time.monotonic() + READ_BACKOFF * cost
        metrics.prefill_tokens_per_s = self.prefill_rate.update(metrics)
        metrics.prefill_rate_timed = self.prefill_rate.timed and metrics.prefill_tokens_per_s is not None
        self._say_prefill_timing(self.prefill_rate.timed)
        self.scrapes += 1
        self.consecutive_failures = 0
        if self.failing:
            self.failing = False
            log.info("scraping %s recovered", self.endpoint.metrics_url)
        changed = comparable(metrics) != comparable(self.metrics)
        self.metrics = metrics
        if changed:
            layer._notify(self.endpoint.address, metrics)

    def _count_rejections(self, rejections: Rejections) -> None:
        """Count what a page carried out of range, and say so at most every LOG_EVERY_S."""
        for key, n in rejections.counts.items():
            self.rejected[key] = self.rejected.get(key, 0) + n
        now = time.monotonic()
        total = sum(rejections.counts.values())
        if self.rejections_said_at is not None and now - self.rejections_said_at < LOG_EVERY_S:
            self.rejections_unsaid += total
            return
        (family, reason), example = next(iter(rejections.examples.items()))
        earlier = f"; {self.rejections_unsaid} more since the last report" if self.rejections_unsaid else ""
        log.warning("scraping %s: dropped %d value(s) its page carried, e.g. %s %s (%s)%s", self.endpoint.metrics_url,
                    total, family, example, reason, earlier)
        self.rejections_said_at, self.rejections_unsaid = now, 0

    def _say_prefill_timing(self, timed: bool) -> None:
        """Log, at the first scrape and whenever it changes, which load signal this endpoint's prefill speed comes
        from: the engine's own step timing (`timed`: this scrape's page had it; speed-aware loads, in seconds) or
        nothing the EPP trusts for speed."""
        if timed == self.timing_said:
            return
        self.timing_said = timed
        if timed:
            log.info("%s times its own prefill (%s): its loads count in seconds of its measured prefill speed",
                     self.endpoint.address, PREFILL_TIMING_SERIES)
        else:
            log.info("%s exports no prefill timing (%s; e.g. a vLLM engine): its loads count at the median speed "
                     "of the timed endpoints, or in tokens where none is timed", self.endpoint.address,
                     PREFILL_TIMING_SERIES)

    def close(self) -> None:
        self.removed = True
        if self.connecting is not None:
            self.connecting.cancel()
        self.connection.close()


class Datalayer:
    """Metrics of the pool's endpoints. Call every method from the event loop that ran start()."""

    def __init__(self, interval: float = 0.05, timeout: float = 1.0, staleness: float = 2.0,
                 on_change: OnChange | None = None, *, ticker: Ticker | None = None,
                 filter_families: bool = True, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if interval <= 0 or timeout <= 0 or staleness <= 0 or max_bytes <= 0:
            raise ValueError("interval, timeout, staleness and max_bytes must be positive")
        self.interval = interval
        self.timeout = timeout
        self.max_bytes = max_bytes  # of one /metrics body
        self.staleness = staleness
        self.on_change = on_change  # (address, new metrics) on a changed scrape; (address, None) on removal
        self.filter_families = filter_families
        self.ticker = ticker or Ticker(interval)
        self.round_listeners: list[Callable[[], None]] = []  # called on the loop after each round
        self._collectors: dict[str, EndpointCollector] = {}
        self._order: tuple[EndpointCollector, ...] = ()  # what a round walks; rebuilt on change
        self._task: asyncio.Task | None = None
        self._started = False
        self._snapshot: list[EndpointState] | None = None  # snapshot(): the round's states, and when built
        self._snapshot_at = 0.0
        self._in_flight_source: Callable[[], Mapping[str, tuple[int, int]]] | None = None  # snapshot()'s argument
        self._snapshot_used = False  # a decision asked for the snapshot since it was built
        self.scrape_cpu_s = 0.0  # CPU seconds of the event loop scraping took: sends, answers read and parsed
        self.rounds = 0  # rounds begun
        self._answers: collections.deque = collections.deque()  # (collector, status, body, exc) to parse
        self._parsing = False  # a parse turn is scheduled

    @property
    def running(self) -> bool:
        return self._started

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        self._task = asyncio.get_running_loop().create_task(self._run(), name="metrics ticker")

    async def stop(self) -> None:
        """Stops the ticker and closes every connection (the metrics stay)."""
        self._started = False
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        pending = []
        for c in self._collectors.values():
            if c.connecting is not None:
                pending.append(c.connecting)
                c.connecting.cancel()
                c.connecting = None
            c.connection.close()
            c.sent_at = None
        for c, *_ in self._answers:
            c.queued = False
        self._answers.clear()
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)

    def set_endpoints(self, endpoints: Iterable[Endpoint]) -> None:
        """Make the collected set exactly `endpoints` (by address); idempotent, keeps metrics of kept ones."""
        self._snapshot = None
        wanted = {e.address: e for e in endpoints}
        changed = False
        for address in [a for a in self._collectors if a not in wanted]:
            self._collectors.pop(address).close()
            changed = True
            self._notify(address, None)
        for address, endpoint in wanted.items():
            c = self._collectors.get(address)
            if c is None:
                self._collectors[address] = EndpointCollector(endpoint, self)
                changed = True
            else:
                c.endpoint = endpoint  # new pod name or engine type: the next scrape reads it
        if changed:
            self._order = tuple(self._collectors.values())

    def endpoints(self) -> list[Endpoint]:
        return [c.endpoint for c in self._collectors.values()]

    def metrics(self, address: str) -> EndpointMetrics | None:
        c = self._collectors.get(address)
        return c.metrics if c is not None else None

    def every_endpoint_scraped_once(self) -> bool:
        """Every endpoint's first scrape has ended, in success or failure."""
        return all(c.scrapes or c.failures for c in self._collectors.values())

    def states(self, in_flight: Mapping[str, tuple[int, int]] | None = None) -> list[EndpointState]:
        """A snapshot for scheduling; `in_flight` maps address → (requests, tokens) this EPP has routed there."""
        now = time.monotonic()
        limit = self.staleness
        in_flight = in_flight or {}
        out = []
        for address, c in self._collectors.items():
            m = c.metrics
            requests, tokens = in_flight.get(address, (0, 0))
            failing = c.consecutive_failures >= FAILURES_OUT_OF_ROTATION
            stale = m.updated_at == 0.0 or now - m.updated_at > limit or failing
            out.append(EndpointState(c.endpoint, m, stale, requests, tokens, available=c.scrapes > 0 and not failing))
        return out

    def snapshot(self, in_flight: Callable[[], Mapping[str, tuple[int, int]]] | None = None
                 ) -> list[EndpointState]:
        """states() for one scrape round: the same list of the same objects for the round, so the scheduler's
        per-snapshot caches hold between requests (building the states costs more than a decision over kept ones;
        `kvgate bench epp --parts scheduling` prints a decision over a kept snapshot against one over new states
        every request). While the datalayer runs, the next round's snapshot is built when the round's scrapes are
        out, off any request's path (at a thousand endpoints the states take milliseconds to build), if a decision
        used the last one; otherwise here, at the first decision after a quiet round, an endpoint set change, or
        (not running) an interval. `in_flight` is called only on a rebuild: the in-flight counts and staleness in a
        snapshot lag by at most one round, like the metrics."""
        self._in_flight_source = in_flight
        self._snapshot_used = True
        if self._snapshot is None or (not self._started and time.monotonic() - self._snapshot_at >= self.interval):
            self._build_snapshot()
        return self._snapshot

    def _build_snapshot(self) -> None:
        source = self._in_flight_source
        self._snapshot = self.states(source() if source is not None else None)
        self._snapshot_at = time.monotonic()

    def _renew_snapshot(self) -> None:
        """After a round: the next snapshot built now if decisions are being made, else left to the next decision."""
        if self._snapshot_used:
            self._snapshot_used = False
            self._build_snapshot()
        else:
            self._snapshot = None

    def endpoint_counts(self) -> list[tuple[str, dict[str, int], dict[tuple[str, str], int], float]]:
        """(address, failed scrapes by reason, dropped values by (family, reason), seconds of the loop its answers
        took) of every endpoint: copies."""
        return [(a, dict(c.failed_by), dict(c.rejected), c.cpu_s) for a, c in self._collectors.items()]

    def stats(self) -> dict[str, int]:
        return {"endpoints": len(self._collectors),
                "scrapes": sum(c.scrapes for c in self._collectors.values()),
                "failures": sum(c.failures for c in self._collectors.values())}

    def queue_answer(self, collector: EndpointCollector, status: int, body: bytes, exc: BaseException | None) -> None:
        self._answers.append((collector, status, body, exc))
        if not self._parsing:
            self._parsing = True
            asyncio.get_running_loop().call_soon(self._parse_turn)

    def _parse_turn(self) -> None:
        """Parse queued answers for ANSWER_TURN_S (one at least); what is left waits for the loop's next pass, after
        the sockets that turned ready meanwhile (a request's messages) were served."""
        answers = self._answers
        deadline = time.perf_counter() + ANSWER_TURN_S
        while answers:
            collector, status, body, exc = answers.popleft()
            collector.on_answer(status, body, exc)
            if time.perf_counter() >= deadline:
                break
        if answers:
            asyncio.get_running_loop().call_soon(self._parse_turn)
        else:
            self._parsing = False

    def _notify(self, address: str, metrics: EndpointMetrics | None) -> None:
        if self.on_change is None:
            return
        try:
            self.on_change(address, metrics)
        except Exception:  # a listener's bug must not stop the collector
            log.exception("datalayer on_change listener failed for %s", address)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        async for now in self.ticker.ticks():
            began, cpu_before = now, self.scrape_cpu_s
            self.rounds += 1
            order = self._order
            slices = max(1, -(-len(order) // ROUND_SLICE))
            for k in range(slices):
                if k:  # the slices evenly over the interval
                    await asyncio.sleep(max(0.0, began + k * self.interval / slices - loop.time()))
                    now = loop.time()
                self._scrape_slice(order[k * ROUND_SLICE:(k + 1) * ROUND_SLICE], now)
            try:
                self._renew_snapshot()
            except Exception:  # a surprise in one endpoint's state must not stop scraping (decisions rebuild it)
                log.exception("datalayer snapshot failed")
                self._snapshot = None
            for listener in self.round_listeners:
                try:
                    listener()
                except Exception:  # a listener's bug must not stop scraping
                    log.exception("datalayer round listener failed")
            # The pool's share of the loop: this round's sends and the answers read since the last round began.
            hold = (self.scrape_cpu_s - cpu_before) / SCRAPE_LOOP_SHARE - (loop.time() - began)
            if hold > 0:
                await asyncio.sleep(hold)

    def _scrape_slice(self, collectors: tuple[EndpointCollector, ...], now: float) -> None:
        started = time.thread_time()
        for c in collectors:
            if not c.removed:
                try:
                    c.scrape(now)
                except Exception:  # one endpoint's surprise must not stop the pool's scraping
                    log.exception("scraping %s failed unexpectedly", c.endpoint.metrics_url)
                    c.connection.abort(ScrapeError("unexpected failure", "error"))
                    c.sent_at = None
        self.scrape_cpu_s += time.thread_time() - started


def _failure_reason(e: BaseException) -> str:
    """A failed scrape's kind, as kvgate_epp_endpoint_scrape_failures_total counts it."""
    if isinstance(e, ScrapeError):
        return e.reason
    if isinstance(e, TimeoutError):
        return "timeout"
    if isinstance(e, OSError):
        return "connect"
    if isinstance(e, MetricsParseError):
        return "no_metrics"
    return "error"
