"""The EPP's own Prometheus metrics (served on --metrics-port by prometheus_client's HTTP thread).

That thread must never walk what the event loop changes (the director's in-flight map, the datalayer's
collectors): it did, and a scrape under load failed with "dictionary changed size during iteration". So the
event loop publishes an immutable Snapshot after each datalayer round (`EndpointGauges.publish`, a round
listener: no hook in main.py), replacing one reference; the exporter only reads that reference. Staleness
and metrics age are computed at scrape time from the snapshot's timestamps.

Every per-endpoint series goes when its endpoint leaves the pool: the gauges because the next snapshot no
longer has a row for it, the token counters because publish() removes their series (a response that ends
after its endpoint left counts once more and goes at the next round).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


REPUBLISH_SECONDS = 1.0
MAX_FLOW_LABELS = 100  # distinct fairness ids given their own flow-control histogram series


class EndpointRow(NamedTuple):
    address: str
    waiting: int
    running: int
    kv_cache_usage: float
    updated_at: float  # time.monotonic() of the last successful scrape; 0 = never
    in_flight_requests: int
    stale: bool  # when published: old numbers or failing scrapes (age is re-checked at scrape time)
    available: bool = True  # in rotation: scraped at least once and its scrapes are not failing
    prefill_tokens_per_s: float | None = None  # the datalayer's online estimate (None: not yet measured)
    prefill_rate_timed: bool = False  # the estimate is the engine's own step timing (the speed-aware loads use it)


class Snapshot(NamedTuple):
    rows: tuple[EndpointRow, ...] = ()
    staleness: float = 2.0
    plugin_stats: Mapping[str, Mapping[str, float]] = {}  # Scheduler.stats(): per stats group, summed
    flow_rows: tuple[tuple[str, int, int, int], ...] | None = None  # FlowController.rows(); None: flow control off
    # Datalayer.endpoint_counts(): per endpoint, failed scrapes by reason and dropped values by (family, reason)
    endpoint_counts: tuple = ()
    scheduling_faults: Mapping[str, int] = {}  # Scheduler.endpoint_faults: decisions a plugin failed on its data
    scrapes: int = 0  # successful /metrics scrapes of every endpoint together (Datalayer.stats)


# The precise scorer's gauges; every other key of its stats is a cumulative count of KV-event batches or blocks.
_KV_EVENT_GAUGES = ("index_size", "speculative_entries", "subscribed_endpoints")


class EndpointCounter:
    """A labelled Counter whose first label is the endpoint, remembering each endpoint's series so that they
    can be removed when it leaves. Used like the Counter: `.labels(endpoint, ...).inc(n)` (event loop only)."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self._series: dict[str, set[tuple[str, ...]]] = {}

    def labels(self, endpoint: str, *rest: str):
        self._series.setdefault(endpoint, set()).add(rest)
        return self.counter.labels(endpoint, *rest)

    def retain(self, endpoints: Iterable[str]) -> None:
        """Remove the series of every endpoint not in `endpoints`."""
        keep = endpoints if isinstance(endpoints, (set, frozenset)) else set(endpoints)
        for endpoint in [e for e in self._series if e not in keep]:
            for rest in self._series.pop(endpoint):
                self.counter.remove(endpoint, *rest)


class EndpointGauges:
    """Per-endpoint queue / KV / staleness / in-flight gauges, from the snapshot the event loop publishes."""

    def __init__(self, director, tokens: EndpointCounter | None = None) -> None:
        self.director = director
        self.tokens = tokens
        self.snapshot = Snapshot()  # replaced whole by publish(); read by collect() on another thread
        self._read = True  # set by collect() (a plain flag: a lost update only delays one publish by a round)
        self._published_at = 0.0

    def publish(self, force: bool = False) -> None:
        """On the event loop: take the numbers the exporter shows, and drop the token series of departed
        endpoints. Its CPU grows with the endpoints, so a round publishes only when the exporter was read since
        the last one, or once a second: what a scrape reads is at most one round (or, after a quiet spell,
        1 s) old."""
        now = time.monotonic()
        if not (force or self._read or now - self._published_at >= REPUBLISH_SECONDS):
            return
        self._read = False
        self._published_at = now
        states = self.director.states()  # every endpoint, stale ones included
        rows = tuple(EndpointRow(s.address, s.metrics.waiting_queue_size, s.metrics.running_requests,
                                 s.metrics.kv_cache_usage, s.metrics.updated_at, s.in_flight_requests, s.stale,
                                 s.available, s.metrics.prefill_tokens_per_s, s.metrics.prefill_rate_timed)
                     for s in states)
        flow = getattr(self.director, "flow", None)
        self.snapshot = Snapshot(rows, self.director.datalayer.staleness, self.director.scheduler.stats(),
                                 flow.rows() if flow is not None else None,
                                 tuple(self.director.datalayer.endpoint_counts()),
                                 dict(self.director.scheduler.endpoint_faults),
                                 self.director.datalayer.stats()["scrapes"])
        if self.tokens is not None:
            self.tokens.retain({row.address for row in rows})

    def collect(self):
        snapshot = self.snapshot  # one read: everything below comes from the same, immutable snapshot
        self._read = True
        queue = GaugeMetricFamily("kvgate_epp_endpoint_queue_size", "Waiting requests per endpoint.",
                                  labels=["endpoint"])
        kv = GaugeMetricFamily("kvgate_epp_endpoint_kv_cache_usage", "KV cache usage (0..1) per endpoint.",
                               labels=["endpoint"])
        running = GaugeMetricFamily("kvgate_epp_endpoint_running_requests", "Running requests per endpoint.",
                                    labels=["endpoint"])
        stale = GaugeMetricFamily("kvgate_epp_endpoint_stale", "1 when the endpoint's metrics are stale.",
                                  labels=["endpoint"])
        age = GaugeMetricFamily("kvgate_epp_endpoint_metrics_age_seconds", "Age of the last scrape.",
                                labels=["endpoint"])
        flight = GaugeMetricFamily("kvgate_epp_endpoint_in_flight_requests", "Requests routed, not finished.",
                                   labels=["endpoint"])
        available = GaugeMetricFamily("kvgate_epp_endpoint_available",
                                      "1 while the endpoint is in rotation (scraped, its scrapes not failing).",
                                      labels=["endpoint"])
        rate = GaugeMetricFamily("kvgate_epp_endpoint_prefill_tokens_per_second",
                                 "Prompt tokens computed per busy second, estimated online from the engine's own "
                                 "prefill timing, else from its prefix-cache counters (only endpoints measured so "
                                 "far).", labels=["endpoint"])
        timed = GaugeMetricFamily("kvgate_epp_endpoint_prefill_rate_timed",
                                  "1 when the endpoint's prefill rate is its engine's own step timing, which the "
                                  "speed-aware loads (loadUnit: seconds) read; 0: not timed (yet), the pool's median "
                                  "timed speed stands in.", labels=["endpoint"])
        now = time.monotonic()
        for row in snapshot.rows:
            labels = [row.address]
            queue.add_metric(labels, row.waiting)
            kv.add_metric(labels, row.kv_cache_usage)
            running.add_metric(labels, row.running)
            seconds = now - row.updated_at if row.updated_at else float("inf")
            stale.add_metric(labels, 1.0 if row.stale or seconds > snapshot.staleness else 0.0)
            age.add_metric(labels, seconds)
            flight.add_metric(labels, row.in_flight_requests)
            available.add_metric(labels, 1.0 if row.available else 0.0)
            if row.prefill_tokens_per_s is not None:
                rate.add_metric(labels, row.prefill_tokens_per_s)
            timed.add_metric(labels, 1.0 if row.prefill_rate_timed else 0.0)
        yield from (queue, kv, running, stale, age, flight, available, rate, timed)
        yield from _endpoint_input_families(snapshot)
        scrapes = CounterMetricFamily("kvgate_epp_scrapes", "Successful /metrics scrapes, every endpoint together: "
                                      "its rate over the endpoints is each endpoint's scrapes per second, whose "
                                      "inverse is the interval the datalayer achieves.")
        scrapes.add_metric([], snapshot.scrapes)
        yield scrapes
        values = snapshot.plugin_stats.get("prefix_index") or {}
        if values:
            size = GaugeMetricFamily("kvgate_epp_prefix_index_size", "Block hashes in the prefix index.")
            size.add_metric([], values.get("index_size", 0))
            ratio = GaugeMetricFamily("kvgate_epp_prefix_index_hit_ratio",
                                      "Prompt blocks found in the picked endpoint's index / blocks looked up.")
            total = values.get("total_blocks", 0)
            ratio.add_metric([], values.get("hit_blocks", 0) / total if total else 0.0)
            yield size
            yield ratio
        kv_events = snapshot.plugin_stats.get("kv_events") or {}
        if kv_events:
            blocks = GaugeMetricFamily("kvgate_epp_precise_index_blocks",
                                       "(endpoint, block) entries the precise prefix index holds from KV events.")
            blocks.add_metric([], kv_events.get("index_size", 0))
            subscribed = GaugeMetricFamily("kvgate_epp_kv_events_subscribed_endpoints",
                                           "Endpoints whose KV-cache events the EPP subscribes to.")
            subscribed.add_metric([], kv_events.get("subscribed_endpoints", 0))
            counts = CounterMetricFamily("kvgate_epp_kv_events", "KV-cache event batches and blocks received, by "
                                         "what happened (batches, blocks_stored, blocks_removed, gaps, replays_ok, "
                                         "replays_failed, restarts, reconnects, bad_payloads, error: a message "
                                         "rejected or failing, or the subscriber thread dying, thread_restarts, "
                                         "...).", labels=["event"])
            for key, value in sorted(kv_events.items()):
                if key not in _KV_EVENT_GAUGES:
                    counts.add_metric([key], value)
            yield from (blocks, subscribed, counts)
        affinity = snapshot.plugin_stats.get("affinity") or {}
        if affinity:
            spills = CounterMetricFamily("kvgate_epp_affinity_spills", "Requests the prefix-cache affinity filter "
                                         "sent to a cold endpoint because their prefix's share of the recent "
                                         "requests outgrew its warm endpoints (spillShare).")
            spills.add_metric([], affinity.get("spills", 0))
            no_room = CounterMetricFamily("kvgate_epp_affinity_spills_without_room", "Requests the prefix-cache "
                                          "affinity filter would have spilled but kept, because a copy of their "
                                          "prefix fits on no cold endpoint (spillFit).")
            no_room.add_metric([], affinity.get("spills_without_room", 0))
            yield spills
            yield no_room
            if "second_homes_opened" in affinity:
                homes = CounterMetricFamily("kvgate_epp_affinity_second_homes", "The prefix-cache affinity filter's "
                                            "second homes (secondHome latency), by what happened: opened, declined "
                                            "(a home busier than a cold start elsewhere, where the cold start did "
                                            "not pay), lapsed (no pick there within the window), evicted (the "
                                            "prompt left its cache), crowded (the copy no longer fits beside the "
                                            "endpoint's groups).", labels=["event"])
                for event in ("opened", "declined"):
                    homes.add_metric([event], affinity.get(f"second_homes_{event}", 0))
                for event in ("lapsed", "evicted", "crowded"):
                    homes.add_metric([event], affinity.get(f"homes_{event}", 0))
                yield homes
        latency = snapshot.plugin_stats.get("latency_model") or {}
        if latency:
            yield from _latency_model_families(latency)
        if snapshot.flow_rows is not None:
            size = GaugeMetricFamily("inference_extension_flow_control_queue_size", "Requests held by flow control, "
                                     "per flow and priority band.", labels=["fairness_id", "priority"])
            held = GaugeMetricFamily("inference_extension_flow_control_queue_bytes", "Request bytes held by flow "
                                     "control, per flow and priority band.", labels=["fairness_id", "priority"])
            for flow_id, priority, count, nbytes in snapshot.flow_rows:
                size.add_metric([flow_id, str(priority)], count)
                held.add_metric([flow_id, str(priority)], nbytes)
            yield size
            yield held
            # Scale from zero: requests waiting for a pool with no endpoint in rotation (the operator's autoscaler
            # starts a replica for them; autoscale_signals.py).
            empty = GaugeMetricFamily("kvgate_epp_flow_control_held_without_endpoints", "Requests held by flow "
                                      "control while the pool has no endpoint in rotation (0 while it has one).")
            in_rotation = any(row.available for row in snapshot.rows)
            empty.add_metric([], 0 if in_rotation else sum(count for _, _, count, _ in snapshot.flow_rows))
            yield empty


def _endpoint_input_families(snapshot: Snapshot):
    """What each endpoint's /metrics pages cost it: failed scrapes by reason, values dropped by the parse's range
    checks (epp/datalayer/value_bounds.py), and decisions a scheduling plugin failed on its data (it then sat out
    picks for a while: epp/scheduling/framework.py)."""
    failures = CounterMetricFamily("kvgate_epp_endpoint_scrape_failures", "Failed /metrics scrapes per endpoint, by "
                                   "reason: timeout, connect, http_status, too_large (over --metrics-max-bytes), "
                                   "malformed (not HTTP/1.x as a scrape reads it), no_metrics (no queue, running or "
                                   "KV-usage family), error.", labels=["endpoint", "reason"])
    rejected = CounterMetricFamily("kvgate_epp_endpoint_metric_values_rejected", "Values an endpoint's /metrics pages "
                                   "carried that the EPP dropped, by metric family and reason: non_finite, "
                                   "out_of_range, bad_label, too_many_series.", labels=["endpoint", "metric", "reason"])
    cpu = CounterMetricFamily("kvgate_epp_endpoint_scrape_cpu_seconds", "CPU seconds of the EPP's event loop spent "
                              "reading and parsing an endpoint's /metrics answers (its rate: the share of the loop they "
                              "take; each answer holds the next scrape back ten times its cost).", labels=["endpoint"])
    faults = CounterMetricFamily("kvgate_epp_endpoint_scheduling_faults", "Decisions a scheduling plugin failed on "
                                 "an endpoint's data, after which the endpoint sat out picks for a while.",
                                 labels=["endpoint"])
    for address, failed_by, dropped, cpu_s in snapshot.endpoint_counts:
        cpu.add_metric([address], cpu_s)
        for reason, n in sorted(failed_by.items()):
            failures.add_metric([address, reason], n)
        for (family, reason), n in sorted(dropped.items()):
            rejected.add_metric([address, family, reason], n)
    for address, n in sorted(snapshot.scheduling_faults.items()):
        faults.add_metric([address], n)
    yield from (failures, rejected, cpu, faults)


def _latency_model_families(values: Mapping[str, float]):
    """predicted-latency-scorer's learned model: how often and how well it predicted, and per-request objectives.
    Relative error over a window = rate(abs_error) / rate(measured)."""
    observed = CounterMetricFamily("kvgate_epp_latency_observations", "Streamed responses whose TTFT / TPOT the "
                                   "latency model was given (and had predicted at the pick).", labels=["kind"])
    error = CounterMetricFamily("kvgate_epp_latency_prediction_abs_error_seconds", "Sum of |predicted - measured| "
                                "over those responses.", labels=["kind"])
    measured = CounterMetricFamily("kvgate_epp_latency_measured_seconds", "Sum of the measured values.",
                                   labels=["kind"])
    for kind in ("ttft", "tpot"):
        observed.add_metric([kind], values.get(f"{kind}_observations", 0))
        error.add_metric([kind], values.get(f"{kind}_abs_error_seconds", 0))
        measured.add_metric([kind], values.get(f"{kind}_measured_seconds", 0))
    objectives = CounterMetricFamily("kvgate_epp_latency_objectives", "Requests with x-slo-ttft-ms / x-slo-tpot-ms "
                                     "objectives: stated, bad (ignored headers), unmeetable (no endpoint predicted "
                                     "to meet them), met and missed (as measured).", labels=["result"])
    for result, key in (("stated", "objectives"), ("bad", "objectives_bad"), ("unmeetable", "objectives_unmeetable"),
                        ("met", "objectives_met"), ("missed", "objectives_missed")):
        objectives.add_metric([result], values.get(key, 0))
    relative = GaugeMetricFamily("kvgate_epp_latency_relative_error", "Quantiles of |predicted - measured| / "
                                 "measured over the last 1000 responses.", labels=["kind", "quantile"])
    for kind in ("ttft", "tpot"):
        for q in (50, 90):
            value = values.get(f"{kind}_relative_error_p{q}")
            if value is not None:
                relative.add_metric([kind, f"0.{q}"], value)
    return observed, error, measured, objectives, relative


class EppMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvgate_epp_requests", "Requests by result code (200 = routed).", ["code"], registry=r)
        self.request_path_seconds = Histogram(
            "kvgate_epp_request_path_duration_seconds", "Time on a routed request's path in the EPP: from its body "
            "(or headers, without one) to the routing answer — body parse, slow plugin work, the decision; flow "
            "control's wait left out (its queue duration histogram has it).",
            registry=r, buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                 1.0, 2.5))
        self.scheduling_seconds = Histogram(
            "kvgate_epp_scheduling_duration_seconds", "Time to decide an endpoint.", registry=r,
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1))
        self.tokens = EndpointCounter(Counter("kvgate_epp_tokens", "Tokens served per endpoint, from response usage.",
                                              ["endpoint", "kind"], registry=r))
        self.gauges: EndpointGauges | None = None
        self.serving = Gauge("kvgate_epp_serving", "1 while this replica reports ready to the health check Envoy "
                             "routes by: it can route and, with leader election, leads (the active replica).",
                             registry=r)
        # upstream's name and labels (its inference_pool and model labels aside): time in flow control per outcome
        self.flow_seconds = Histogram(
            "inference_extension_flow_control_request_queue_duration_seconds", "Time requests spend in flow control, "
            "from their arrival to their outcome (Dispatched, RejectedCapacity, EvictedTTL, EvictedContextCancelled).",
            ["fairness_id", "priority", "outcome"], registry=r,
            buckets=(0.0001, 0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0))
        self._flow_ids: set[str] = set()
        self._request_counts: dict[int, object] = {}

    def request_count(self, code: int):
        """The requests counter's child for a result code (a handful of codes: looked up once each)."""
        child = self._request_counts.get(code)
        if child is None:
            child = self._request_counts[code] = self.requests.labels(str(code))
        return child

    def observe_flow(self, flow_id: str, priority: int, outcome: str, seconds: float) -> None:
        """FlowController's observer. Flow ids are client text: past MAX_FLOW_LABELS distinct ones the histogram
        files the rest under "other" (its series live as long as the process)."""
        if flow_id not in self._flow_ids:
            if len(self._flow_ids) >= MAX_FLOW_LABELS:
                flow_id = "other"
            else:
                self._flow_ids.add(flow_id)
        self.flow_seconds.labels(flow_id, str(priority), outcome).observe(seconds)

    def watch(self, director) -> None:
        """Export the director's endpoints; call on the event loop. The datalayer's rounds publish the snapshot."""
        self.gauges = EndpointGauges(director, self.tokens)
        self.gauges.publish(force=True)
        director.datalayer.round_listeners.append(self.gauges.publish)
        self.registry.register(self.gauges)


class PeerSyncCollector:
    """Active-active peer sync (epp/peer_sync.py): its counts as of its last heartbeat (`PeerSync.published`,
    replaced whole on the event loop; read here on the exporter's thread)."""

    def __init__(self, sync) -> None:
        self.sync = sync

    def collect(self):
        values = dict(self.sync.published)
        events = CounterMetricFamily("kvgate_epp_peer_sync", "Peer sync messages and events: picks_sent, dones_sent, "
                                     "picks_applied, dones_applied, bad_messages, foreign_endpoint (a peer's pick "
                                     "of an endpoint not in this pool), peers_lost, flights_dropped, "
                                     "too_many_peers, handshakes_failed (with the pool's key: connections whose CURVE "
                                     "handshake failed, from or to a process without the key).",
                                     labels=["event"])
        peers = GaugeMetricFamily("kvgate_epp_peer_sync_peers", "Peer replicas heard from within the timeout.")
        flights = GaugeMetricFamily("kvgate_epp_peer_sync_flights", "Peers' requests in flight, as they told.")
        peers.add_metric([], values.pop("peers", 0))
        flights.add_metric([], values.pop("peer_flights", 0))
        for key, value in sorted(values.items()):
            events.add_metric([key], value)
        yield from (events, peers, flights)
