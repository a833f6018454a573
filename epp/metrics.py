"""The EPP's own Prometheus metrics (served on --metrics-port)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily


class EndpointGauges:
    """Per-endpoint queue / KV / staleness / in-flight, read from the datalayer at scrape time."""

    def __init__(self, director) -> None:
        self.director = director

    def collect(self):
        queue = GaugeMetricFamily("kvgate_epp_endpoint_queue_size", "Waiting requests per endpoint.", labels=["endpoint"])
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
        now = time.monotonic()
        for s in self.director.states():
            labels = [s.address]
            queue.add_metric(labels, s.metrics.waiting_queue_size)
            kv.add_metric(labels, s.metrics.kv_cache_usage)
            running.add_metric(labels, s.metrics.running_requests)
            stale.add_metric(labels, 1.0 if s.stale else 0.0)
            age.add_metric(labels, now - s.metrics.updated_at if s.metrics.updated_at else float("inf"))
            flight.add_metric(labels, s.in_flight_requests)
        yield from (queue, kv, running, stale, age, flight)
        stats = getattr(self.director.scheduler, "prefix_stats", None)
        if callable(stats):
            values = stats()
            if values:
                size = GaugeMetricFamily("kvgate_epp_prefix_index_size", "Block hashes in the prefix index.")
                size.add_metric([], values.get("index_size", 0))
                ratio = GaugeMetricFamily("kvgate_epp_prefix_index_hit_ratio",
                                          "Prompt blocks found in the picked endpoint's index / blocks looked up.")
                ratio.add_metric([], values.get("hit_ratio", 0.0))
                yield size
                yield ratio


class EppMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kvgate_epp_requests", "Requests by result code (200 = routed).", ["code"], registry=r)
        self.scheduling_seconds = Histogram(
            "kvgate_epp_scheduling_duration_seconds", "Time to decide an endpoint.", registry=r,
            buckets=(0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1))
        self.tokens = Counter("kvgate_epp_tokens", "Tokens served per endpoint, from response usage.",
                              ["endpoint", "kind"], registry=r)

    def watch(self, director) -> None:
        self.registry.register(EndpointGauges(director))
