"""The autoscaler's decisions and the signals it decided on, as operator metrics (served by OperatorMetrics on
`kvgate operator --metrics-port`; a prometheus-client collector read at scrape time).

Per autoscaled ModelServer (provider operator), labels `namespace` and `modelserver` (the ModelServer's own; the
chart's operator PodMonitor honours them), from the autoscaler's last look:
    kvgate_operator_autoscale_desired_replicas     the count decided (status.autoscaling.desiredReplicas)
    kvgate_operator_autoscale_current_replicas     the count the look started from (the Deployment's spec)
    kvgate_operator_autoscale_ready_replicas       the engine Deployment's ready replicas
    kvgate_operator_autoscale_min_replicas / _max_replicas   spec.minReplicas / spec.maxReplicas
    kvgate_operator_autoscale_scaling_active       1 when the look had the pool's signals, 0 when no EPP answered
                                                   (the ScalingActive condition, FailedGetMetrics)
    kvgate_operator_autoscale_ready_endpoints      the pool's endpoints in rotation, as the EPP sees them
    kvgate_operator_autoscale_waiting_requests     requests held by flow control plus waiting in the engines
    kvgate_operator_autoscale_held_without_endpoints   requests held while the pool had no ready endpoint
    kvgate_operator_autoscale_kv_utilization       mean KV-cache usage of the ready endpoints (0..1)
    kvgate_operator_autoscale_queue_wait_seconds   mean flow-control wait since the previous look (once known)
    kvgate_operator_autoscale_usage_ratio{signal}  usage / target per signal (waiting, kv_utilization, queue_wait):
                                                   the largest, outside 1 ± tolerance, moves the count
    kvgate_operator_autoscale_scaled_total{reason} count changes, by the Event's reason (ScaledUp, ScaledDown,
                                                   ScaledFromZero, ScaledToZero)
The signal gauges are absent while no EPP answers; the ratios while the pool has no ready endpoint. Per pool
(labels `namespace`, `pool`):
    kvgate_operator_autoscale_epp_read_failures_total   EPP /metrics pages not read or refused
And kvgate_operator_autoscale_untracked_modelservers: autoscaled ModelServers over the cap, not exported.

Bounded: the series of a ModelServer (or pool) the last look did not see are dropped (deleted, no longer
autoscaled, moved to KEDA); at most MAX_TRACKED ModelServers and pools are exported. Only the leading replica
looks, so only its series exist: a replica that stops leading (or stops) clears them all.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvgate.operator.autoscale_policy import Decision, Policy, Signals, usage_ratios

log = logging.getLogger("kvgate.operator.autoscaler")

MAX_TRACKED = 1000  # ModelServers (and pools) exported; ~20 series each
SCALE_REASONS = ("ScaledUp", "ScaledDown", "ScaledFromZero", "ScaledToZero")
PREFIX = "kvgate_operator_autoscale_"
Key = tuple[str, str]  # (namespace, name)


@dataclass
class _Look:
    """One ModelServer's last look, and its count changes so far."""
    desired: int = 0
    current: int = 0
    ready: int = 0
    min_replicas: int = 0
    max_replicas: int = 0
    signals: Signals | None = None
    ratios: dict[str, float] = field(default_factory=dict)
    scaled: dict[str, int] = field(default_factory=dict)


class AutoscaleMetrics:
    def __init__(self, max_tracked: int = MAX_TRACKED) -> None:
        self.max_tracked = max_tracked
        self._lock = threading.Lock()
        self._looks: dict[Key, _Look] = {}
        self._read_failures: dict[Key, int] = {}
        self._untracked: set[Key] = set()

    # --- written by the autoscaler ------------------------------------------------------------------------------
    def observe(self, key: Key, policy: Policy, signals: Signals | None, current: int, ready: int,
                decision: Decision) -> None:
        """Record one look at the ModelServer `key` (a count change counts once, by the decision's reason)."""
        with self._lock:
            look = self._looks.get(key)
            if look is None:
                if len(self._looks) >= self.max_tracked:
                    if key not in self._untracked:
                        self._untracked.add(key)
                        log.warning("autoscaler metrics: %d ModelServers exported already; %s/%s is not",
                                    self.max_tracked, *key)
                    return
                look = self._looks[key] = _Look()
            look.desired, look.current, look.ready = decision.desired, current, ready
            look.min_replicas, look.max_replicas = policy.min_replicas, policy.max_replicas
            look.signals = signals
            look.ratios = usage_ratios(policy, signals) if signals is not None else {}
            if decision.desired != current and decision.reason in SCALE_REASONS:
                look.scaled[decision.reason] = look.scaled.get(decision.reason, 0) + 1

    def read_failed(self, pool: Key) -> None:
        """One EPP page of `pool` not read or refused."""
        with self._lock:
            if pool in self._read_failures or len(self._read_failures) < self.max_tracked:
                self._read_failures[pool] = self._read_failures.get(pool, 0) + 1

    def forget(self, key: Key) -> None:
        """Drop the ModelServer `key`'s series (no decision for it now)."""
        with self._lock:
            self._looks.pop(key, None)
            self._untracked.discard(key)

    def retain(self, modelservers: set[Key], pools: set[Key]) -> None:
        """Keep only these ModelServers' and pools' series (those the last look saw)."""
        with self._lock:
            for key in set(self._looks) - modelservers:
                del self._looks[key]
            for key in set(self._read_failures) - pools:
                del self._read_failures[key]
            self._untracked &= modelservers

    def clear(self) -> None:
        """Drop every series: this replica no longer looks (a standby, or stopped)."""
        with self._lock:
            self._looks.clear()
            self._read_failures.clear()
            self._untracked.clear()

    # --- read by the registry at scrape time ----------------------------------------------------------------------
    def describe(self):
        return []  # families vary with what is tracked; the registry then reads collect() when scraped

    def collect(self):
        labels = ["namespace", "modelserver"]
        gauges = {name: GaugeMetricFamily(PREFIX + name, text, labels=labels) for name, text in (
            ("desired_replicas", "The replica count the operator's autoscaler decided at its last look"),
            ("current_replicas", "The replica count the autoscaler's last look started from"),
            ("ready_replicas", "The engine Deployment's ready replicas at the autoscaler's last look"),
            ("min_replicas", "The ModelServer's spec.minReplicas"),
            ("max_replicas", "The ModelServer's spec.maxReplicas"),
            ("scaling_active", "1 when the autoscaler's last look read the pool's EPPs, 0 when none answered"),
            ("ready_endpoints", "The pool's endpoints in rotation, as its EPP exported them"),
            ("waiting_requests", "Requests held by the pool's flow control plus waiting in its engines"),
            ("held_without_endpoints", "Requests held by the pool's EPP while it had no ready endpoint"),
            ("kv_utilization", "Mean KV-cache utilisation (0..1) of the pool's ready endpoints"),
            ("queue_wait_seconds", "Mean flow-control wait of the requests dispatched since the previous look"))}
        ratio = GaugeMetricFamily(PREFIX + "usage_ratio", "Each autoscaling signal's usage / target at the last look",
                                  labels=labels + ["signal"])
        scaled = CounterMetricFamily(PREFIX + "scaled", "Replica count changes made by the autoscaler, by reason",
                                     labels=labels + ["reason"])
        failures = CounterMetricFamily(PREFIX + "epp_read_failures", "EPP /metrics pages the autoscaler could "
                                       "not read or refused", labels=["namespace", "pool"])
        with self._lock:
            looks = [(key, look, dict(look.scaled), dict(look.ratios)) for key, look in self._looks.items()]
            read_failures = dict(self._read_failures)
            untracked = len(self._untracked)
        for key, look, counts, ratios in looks:
            values = {"desired_replicas": look.desired, "current_replicas": look.current,
                      "ready_replicas": look.ready, "min_replicas": look.min_replicas,
                      "max_replicas": look.max_replicas, "scaling_active": 1 if look.signals is not None else 0}
            s = look.signals
            if s is not None:
                values.update(ready_endpoints=s.ready_endpoints, waiting_requests=s.held + s.waiting,
                              held_without_endpoints=s.held_without_endpoints, kv_utilization=s.kv_utilization)
                if s.queue_wait_s is not None:
                    values["queue_wait_seconds"] = s.queue_wait_s
            for name, value in values.items():
                gauges[name].add_metric(list(key), float(value))
            for signal, value in ratios.items():
                ratio.add_metric([*key, signal], value)
            for reason, count in counts.items():
                scaled.add_metric([*key, reason], count)
        for key, count in read_failures.items():
            failures.add_metric(list(key), count)
        yield from gauges.values()
        yield ratio
        yield scaled
        yield failures
        yield GaugeMetricFamily(PREFIX + "untracked_modelservers", "Autoscaled ModelServers over the exported cap "
                                f"({self.max_tracked}), whose series are not exported", value=untracked)
