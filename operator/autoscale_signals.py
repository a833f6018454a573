"""A pool's load from its EPPs' /metrics pages: the autoscaler's inputs (autoscale_policy.Signals). Pure.

Each page is Prometheus text, read by the autoscaler with a size and time bound (autoscaler.py) and parsed here
with prometheus-client's parser. Every value read is checked: finite, not negative, KV usage at most 1; a page
with a value out of range, or one that does not parse, is refused whole (ValueError, naming the sample), so one
bad EPP costs only its own pool's decision, never a wrong count.

Read from each page (names in epp/metrics.py):
    inference_extension_flow_control_queue_size               requests held by flow control (summed over flows)
    kvgate_epp_flow_control_held_without_endpoints            of those, held while the pool has no endpoint
    kvgate_epp_endpoint_available / _queue_size / _running_requests / _kv_cache_usage
                                                              per endpoint: in rotation, waiting, running, KV
    inference_extension_flow_control_request_queue_duration_seconds (outcome Dispatched)
                                                              time in flow control: its _sum and _count, whose
                                                              growth since the last look gives the mean wait
The pool's figures are the largest of its EPPs' (active-passive replicas each see every endpoint; only the
leader holds requests); the wait is the pooled growth of the EPPs' sums over that of their counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvgate.operator.autoscale_policy import Signals

MAX_SAMPLES = 200_000  # samples read from one page (an EPP of 1000 endpoints exports ~20 000)
MAX_COUNT = 1e9  # a larger request count or queue is not a real reading
DISPATCHED = "Dispatched"
_WAIT = "inference_extension_flow_control_request_queue_duration_seconds"


@dataclass(frozen=True)
class EppReading:
    """One EPP's page, reduced to what the policy reads."""
    endpoints: int = 0  # in rotation
    held: float = 0.0
    held_without_endpoints: float = 0.0
    waiting: float = 0.0
    running: float = 0.0
    kv_utilization: float = 0.0  # mean over the endpoints in rotation
    wait_sum_s: float = 0.0  # cumulative, Dispatched outcome
    wait_count: float = 0.0


def _value(name: str, labels: dict, value: float, upper: float = MAX_COUNT) -> float:
    if not (math.isfinite(value) and 0.0 <= value <= upper):
        shown = ",".join(f"{k}={str(v)[:60]}" for k, v in sorted(labels.items()))
        raise ValueError(f"{name}{{{shown}}} = {value!r} is out of range [0, {upper:g}]")
    return value


def parse_epp_page(text: str) -> EppReading:
    """An EPP's /metrics page, reduced; ValueError when it does not parse or a value is out of range."""
    per_endpoint: dict[str, dict[str, float]] = {}
    held = held_empty = wait_sum = wait_count = 0.0
    samples = 0
    try:
        families = list(text_string_to_metric_families(text))
    except Exception as exc:  # the parser raises ValueError, IndexError, ... on malformed text
        raise ValueError(f"not Prometheus text: {str(exc)[:200]}") from None
    for family in families:
        for s in family.samples:
            samples += 1
            if samples > MAX_SAMPLES:
                raise ValueError(f"more than {MAX_SAMPLES} samples")
            name, labels = s.name, s.labels
            if name == "inference_extension_flow_control_queue_size":
                held += _value(name, labels, s.value)
            elif name == "kvgate_epp_flow_control_held_without_endpoints":
                held_empty = _value(name, labels, s.value)
            elif name in ("kvgate_epp_endpoint_available", "kvgate_epp_endpoint_queue_size",
                          "kvgate_epp_endpoint_running_requests", "kvgate_epp_endpoint_kv_cache_usage"):
                upper = 1.0 if name.endswith(("_available", "_kv_cache_usage")) else MAX_COUNT
                per_endpoint.setdefault(labels.get("endpoint", ""), {})[name] = _value(name, labels, s.value, upper)
            elif name in (f"{_WAIT}_sum", f"{_WAIT}_count") and labels.get("outcome") == DISPATCHED:
                value = _value(name, labels, s.value, math.inf if name.endswith("_sum") else MAX_COUNT * 1e3)
                if name.endswith("_sum"):
                    wait_sum += value
                else:
                    wait_count += value
    live = [e for e in per_endpoint.values() if e.get("kvgate_epp_endpoint_available", 0.0) >= 1.0]
    return EppReading(
        endpoints=len(live), held=held, held_without_endpoints=held_empty,
        waiting=sum(e.get("kvgate_epp_endpoint_queue_size", 0.0) for e in live),
        running=sum(e.get("kvgate_epp_endpoint_running_requests", 0.0) for e in live),
        kv_utilization=(sum(e.get("kvgate_epp_endpoint_kv_cache_usage", 0.0) for e in live) / len(live)
                        if live else 0.0),
        wait_sum_s=wait_sum, wait_count=wait_count)


def pool_signals(readings: dict[str, EppReading], previous: dict[str, EppReading]) -> Signals | None:
    """The pool's Signals from its EPPs' readings (by EPP pod), with the readings of the last look (for the
    wait's growth); None without any reading."""
    if not readings:
        return None
    grown_sum = grown_count = 0.0
    for pod, now in readings.items():
        before = previous.get(pod)
        if before is not None and now.wait_count >= before.wait_count and now.wait_sum_s >= before.wait_sum_s:
            grown_sum += now.wait_sum_s - before.wait_sum_s
            grown_count += now.wait_count - before.wait_count
    values = list(readings.values())
    return Signals(ready_endpoints=max(r.endpoints for r in values), held=max(r.held for r in values),
                   held_without_endpoints=max(r.held_without_endpoints for r in values),
                   waiting=max(r.waiting for r in values), running=max(r.running for r in values),
                   kv_utilization=max(r.kv_utilization for r in values),
                   queue_wait_s=grown_sum / grown_count if grown_count > 0 else None)
