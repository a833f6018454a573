"""The autoscaling decision: a ModelServer's replica count from its pool's load, as the EPP sees it. Pure.

In the spirit of Kubernetes' HorizontalPodAutoscaler, on the gateway's own signals (autoscale_signals.py reads
them from the pool's EPP /metrics; no metrics adapter):

- load per ready endpoint against a target, each signal a ratio (HPA's usage / target):
    waiting   (requests held by the EPP's flow control + requests waiting in the engines' queues) / ready endpoints
              against `targetWaitingPerReplica`;
    kv        the mean KV-cache utilisation of the ready endpoints against `targetKVUtilization`;
    wait      the mean time requests spent in flow control since the last look against `targetQueueWaitSeconds`.
  The ratio is the largest of the three; within `tolerance` of 1 nothing changes (HPA's 10 %). Otherwise the
  recommendation is ceil(ready replicas of this ModelServer × ratio): with several ModelServers in one pool each
  scales its own share by the pool's ratio.
- from zero: requests held for a pool with no ready endpoint recommend max(1, minReplicas) at once.
- to zero (minReplicas 0): only a pool with nothing held, waiting or running recommends minReplicas.
- while replicas are starting (ready < current) a ratio above 1 never recommends fewer than the current count.
- clamped to [minReplicas, maxReplicas]; scale-up at most max(`scaleUpMaxPods`, `scaleUpMaxPercent` % of the
  current count) per decision (HPA's default policy: 4 pods or 100 %).
- stabilisation windows (HPA's `behavior`): the desired count is the highest recommendation of the last
  `scaleDownStabilizationSeconds` when going down (a brief lull never sheds replicas), the lowest of the last
  `scaleUpStabilizationSeconds` when going up (0 by default: scale up at once); and no scale-down within
  `scaleDownDelaySeconds` after a scale-up (a new replica gets time to take its share before it is judged).

Missing signals (no EPP answered) make no decision: the count stays, and the caller reports it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_REPLICAS_LIMIT = 1000  # the CRD's bound on maxReplicas
MAX_HISTORY = 256  # recommendations kept for the stabilisation windows (one per decision: far more than a window)


@dataclass(frozen=True)
class Policy:
    """A ModelServer's scaling knobs (spec.minReplicas, spec.maxReplicas, spec.autoscaling), with the CRD's
    defaults."""
    min_replicas: int = 1
    max_replicas: int = 1
    target_waiting_per_replica: float = 4.0
    target_kv_utilization: float = 0.8
    target_queue_wait_s: float = 1.0
    tolerance: float = 0.1
    scale_up_stabilization_s: float = 0.0
    scale_down_stabilization_s: float = 300.0
    scale_down_delay_s: float = 60.0
    scale_up_max_pods: int = 4
    scale_up_max_percent: float = 100.0


@dataclass(frozen=True)
class Signals:
    """The pool's load, as its EPP(s) exported it (autoscale_signals.py)."""
    ready_endpoints: int  # endpoints the EPP routes to
    held: float = 0.0  # requests held by flow control (all bands)
    held_without_endpoints: float = 0.0  # of those, held while the pool had no ready endpoint
    waiting: float = 0.0  # requests waiting in the engines' own queues, summed over endpoints
    running: float = 0.0  # requests running in the engines, summed over endpoints
    kv_utilization: float = 0.0  # mean KV-cache usage (0..1) of the ready endpoints
    queue_wait_s: float | None = None  # mean time in flow control of the requests that left it since the last look


@dataclass(frozen=True)
class Decision:
    desired: int  # the replica count to run now
    recommendation: int  # this look's recommendation, before the windows
    reason: str  # a condition reason: ScaledUp, ScaledDown, ScaledFromZero, ScaledToZero, Steady, ...
    message: str
    history: tuple[tuple[float, int], ...] = field(default=())  # (time, recommendation), oldest first


def usage_ratios(policy: Policy, s: Signals) -> dict[str, float]:
    """Each signal's usage / target ("waiting", "kv_utilization", and "queue_wait" when known); empty without a
    ready endpoint (no load per endpoint to speak of)."""
    if s.ready_endpoints <= 0:
        return {}
    ratios = {"waiting": (s.held + s.waiting) / s.ready_endpoints / policy.target_waiting_per_replica,
              "kv_utilization": s.kv_utilization / policy.target_kv_utilization}
    if s.queue_wait_s is not None:
        ratios["queue_wait"] = s.queue_wait_s / policy.target_queue_wait_s
    return ratios


def _ratio(policy: Policy, s: Signals) -> tuple[float, str]:
    """The largest usage / target ratio and what it was (for the message). Needs ready_endpoints > 0."""
    ready, ratios = s.ready_endpoints, usage_ratios(policy, s)
    said = {"waiting": f"{s.held + s.waiting:g} waiting ({s.held:g} held by the EPP) on {ready} ready endpoints, "
                       f"target {policy.target_waiting_per_replica:g} each",
            "kv_utilization": f"KV utilisation {s.kv_utilization:.2f}, target {policy.target_kv_utilization:g}"}
    if s.queue_wait_s is not None:
        said["queue_wait"] = f"queue wait {s.queue_wait_s:.2f}s, target {policy.target_queue_wait_s:g}s"
    largest = max(ratios, key=lambda k: ratios[k])  # the first of equals, as before: waiting, KV, wait
    return ratios[largest], said[largest]


def recommend(policy: Policy, s: Signals, current: int, ready: int) -> tuple[int, str]:
    """(this look's recommendation before clamping and windows, why). `current`: the ModelServer's replica count,
    `ready`: its ready replicas."""
    idle = s.held <= 0 and s.waiting <= 0 and s.running <= 0
    if s.ready_endpoints <= 0:
        if s.held > 0 or s.held_without_endpoints > 0:
            return max(1, current), f"{max(s.held, s.held_without_endpoints):g} requests held with no ready endpoint"
        return current, "no ready endpoint and nothing held"
    if idle:
        return 0, "idle: nothing held, waiting or running"
    ratio, what = _ratio(policy, s)
    if abs(ratio - 1.0) <= policy.tolerance:
        return current, f"{what}: within tolerance"
    wanted = math.ceil(ready * ratio - 1e-9)
    if ratio > 1.0:  # replicas still starting count as coming capacity; a scaled-to-zero share comes back
        wanted = max(wanted, current, 1)
    return wanted, what


def _up_limit(policy: Policy, current: int) -> int:
    return current + max(policy.scale_up_max_pods, math.floor(current * policy.scale_up_max_percent / 100.0))


def decide(policy: Policy, signals: Signals | None, current: int, ready: int,
           history: tuple[tuple[float, int], ...], last_scale_up_at: float | None, now: float) -> Decision:
    """The replica count for now. `history`: the previous decisions' recommendations (Decision.history);
    `last_scale_up_at`: when the count last went up (None: never); times in seconds on one clock."""
    low, high = policy.min_replicas, policy.max_replicas
    if signals is None:
        desired = min(max(current, low), high)
        return Decision(desired, desired, "FailedGetMetrics", "no EPP of the pool answered: the count stays",
                        history)
    raw, why = recommend(policy, signals, current, ready)
    rec = min(max(raw, low), high)
    if rec > 0 and raw <= 0 < low:
        why += f" (minReplicas {low})"
    window = max(policy.scale_down_stabilization_s, policy.scale_up_stabilization_s)
    kept = tuple((t, r) for t, r in history if now - t <= window)
    history = (kept + ((now, rec),))[-MAX_HISTORY:]
    down_floor = max(r for t, r in history if now - t <= policy.scale_down_stabilization_s)
    up_ceiling = min(r for t, r in history if now - t <= policy.scale_up_stabilization_s)
    from_zero = current == 0 and rec > 0
    if rec > current:
        desired = rec if from_zero else min(rec, up_ceiling if up_ceiling > current else current,
                                            _up_limit(policy, current))
        desired = max(desired, current)
    elif rec < current:
        desired = max(rec, down_floor)
        if (desired < current <= high and last_scale_up_at is not None
                and now - last_scale_up_at < policy.scale_down_delay_s):
            return Decision(current, rec, "ScaleDownDelayed",
                            f"{why}: recommends {rec}; no scale-down within {policy.scale_down_delay_s:g}s of the "
                            "last scale-up", history)
        desired = min(desired, current)
    else:
        desired = current
    desired = min(max(desired, low), high)
    if desired > current:
        reason = "ScaledFromZero" if current == 0 else "ScaledUp"
    elif desired < current:
        reason = "ScaledToZero" if desired == 0 else "ScaledDown"
    elif rec != current:
        reason = "Stabilizing"
        why += f": recommends {rec}, held at {current} by the stabilisation window"
    else:
        reason = "Steady"
    return Decision(desired, rec, reason, why, history)
