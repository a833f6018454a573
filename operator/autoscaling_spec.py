"""A ModelServer's autoscaling fields: whether it is autoscaled and by whom, its policy, and the replica count its
Deployment runs.

Autoscaling is on when spec.maxReplicas is set. spec.minReplicas (default 1, zero allowed) and maxReplicas bound
the count; spec.replicas (default 1) is the starting count, clamped to the bounds. The operator's autoscaler
(autoscaler.py, provider `operator`, the default) records each decision in status.autoscaling (desiredReplicas,
with the spec.replicas it decided under); the Deployment runs desiredReplicas while spec.replicas is unchanged.
A user who changes spec.replicas (an edit, `kubectl scale`) is not fought: the Deployment runs the new count
(clamped) at once, and the autoscaler goes on from it (its next scale-down waits scaleDownDelaySeconds). With
provider `keda`, KEDA's HorizontalPodAutoscaler writes spec.replicas through the scale subresource, and the
Deployment runs spec.replicas clamped (keda.py renders the ScaledObject).
"""

from __future__ import annotations

from kvgate.operator.autoscale_policy import Policy

OPERATOR, KEDA = "operator", "keda"
PROVIDERS = (OPERATOR, KEDA)
DEFAULT_MIN_REPLICAS = 1

# spec.autoscaling field -> Policy field (the defaults are Policy's, as documented in the CRD)
_KNOBS = {"targetWaitingPerReplica": "target_waiting_per_replica", "targetKVUtilization": "target_kv_utilization",
          "targetQueueWaitSeconds": "target_queue_wait_s", "tolerance": "tolerance",
          "scaleUpStabilizationSeconds": "scale_up_stabilization_s",
          "scaleDownStabilizationSeconds": "scale_down_stabilization_s",
          "scaleDownDelaySeconds": "scale_down_delay_s", "scaleUpMaxPods": "scale_up_max_pods",
          "scaleUpMaxPercent": "scale_up_max_percent"}


def is_autoscaled(spec: dict) -> bool:
    return spec.get("maxReplicas") is not None


def provider(spec: dict) -> str:
    return (spec.get("autoscaling") or {}).get("provider") or OPERATOR


def bounds(spec: dict) -> tuple[int, int]:
    low = spec.get("minReplicas")
    return (DEFAULT_MIN_REPLICAS if low is None else int(low)), int(spec["maxReplicas"])


def policy_of(spec: dict) -> Policy:
    low, high = bounds(spec)
    knobs = spec.get("autoscaling") or {}
    return Policy(min_replicas=low, max_replicas=high,
                  **{field: knobs[key] for key, field in _KNOBS.items() if knobs.get(key) is not None})


def spec_replicas(spec: dict) -> int:
    """spec.replicas; 1 when unset or null (the CRD's default)."""
    replicas = spec.get("replicas")
    return 1 if replicas is None else int(replicas)


def clamp(count: int, spec: dict) -> int:
    low, high = bounds(spec)
    return min(max(count, low), high)


def rendered_replicas(ms: dict) -> int:
    """The replica count of the ModelServer's engine Deployment (see the module's docstring)."""
    spec = ms.get("spec") or {}
    if not is_autoscaled(spec):
        return spec_replicas(spec)
    status = ms.get("status")
    decided = status.get("autoscaling") if isinstance(status, dict) else None
    decided = decided if isinstance(decided, dict) else {}  # the status schema's shape, unless bypassed
    desired = decided.get("desiredReplicas")
    if (provider(spec) == OPERATOR and isinstance(desired, int) and not isinstance(desired, bool)
            and decided.get("specReplicas") == spec_replicas(spec)):
        return clamp(desired, spec)
    return clamp(spec_replicas(spec), spec)


# The conditions the autoscaler writes (autoscaler.py); the ModelServer reconciler keeps them as they are.
SCALING_ACTIVE, SCALED = "ScalingActive", "Scaled"
AUTOSCALER_CONDITIONS = (SCALING_ACTIVE, SCALED)


def autoscaler_conditions(ms: dict) -> list[dict]:
    """The autoscaler's conditions of `ms`, while it is autoscaled (none once maxReplicas is unset)."""
    spec, status = ms.get("spec"), ms.get("status")
    if not isinstance(spec, dict) or not is_autoscaled(spec) or not isinstance(status, dict):  # any shape: fuzzed
        return []
    return [c for c in status.get("conditions") or [] if isinstance(c, dict) and c.get("type") in AUTOSCALER_CONDITIONS]


def autoscaling_problems(spec: dict) -> list[str]:
    """What the schema's CEL rule and enum say, checked again for clusters that run neither (the rig's 1.20)."""
    problems = []
    if spec.get("autoscaling") and not is_autoscaled(spec):
        problems.append("autoscaling is set without maxReplicas (autoscaling is on only with maxReplicas)")
    if spec.get("minReplicas") is not None and not is_autoscaled(spec):
        problems.append("minReplicas is set without maxReplicas")
    if is_autoscaled(spec):
        low, high = bounds(spec)
        if low > high:
            problems.append(f"minReplicas ({low}) must be <= maxReplicas ({high})")
        if provider(spec) not in PROVIDERS:
            problems.append(f"autoscaling.provider {str(provider(spec))[:40]!r} is not one of {', '.join(PROVIDERS)}")
    return problems
