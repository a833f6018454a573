"""A KEDA ScaledObject for a ModelServer with autoscaling.provider keda: the same signals as the operator's own
autoscaler (autoscale_policy.py), as Prometheus queries KEDA's prometheus scaler runs. Pure.

The ScaledObject (named as the ModelServer, owned by it) targets the ModelServer itself through its scale
subresource: KEDA's HorizontalPodAutoscaler writes spec.replicas, and the operator renders the engine
Deployment's replicas from it (autoscaling_spec.rendered_replicas). The queries read the pool's EPP pods as the
chart's PodMonitor labels them (`namespace`, `pool` = the InferencePool's name, `pod`), from the Prometheus the
operator names (`--keda-prometheus-address`: a platform's, never a ModelServer's choice). With several EPP
replicas each exports every endpoint, so sums are taken per EPP pod and the largest kept:

    waiting (AverageValue, target targetWaitingPerReplica; activation above 0, which is also scale from zero:
             requests held for an empty pool are in the flow-control queue)
        (max(sum by (pod) (kvgate_epp_endpoint_queue_size{SEL})) or vector(0))
      + (max(sum by (pod) (inference_extension_flow_control_queue_size{SEL})) or vector(0))
    kv (Value, target targetKVUtilization): HPA's desired = ceil(replicas × value / target)
        max(avg by (pod) (kvgate_epp_endpoint_kv_cache_usage{SEL})) or vector(0)
    wait (Value, target targetQueueWaitSeconds): the mean time in flow control over the last minute
        (sum(rate(inference_extension_flow_control_request_queue_duration_seconds_sum{SEL,outcome="Dispatched"}[1m]))
         / (sum(rate(..._count{SEL,outcome="Dispatched"}[1m])) > 0)) or vector(0)

where SEL is namespace="<namespace>",pool="<pool>". The policy's knobs map onto HPA's behaviour:
scaleUp/scaleDownStabilizationSeconds are the windows (capped at HPA's 3600 s), scaleUpMaxPods and
scaleUpMaxPercent its scale-up policies per 15 s, and scaleDownStabilizationSeconds also KEDA's cooldownPeriod
before scaling to zero. HPA has no scale-down delay after a scale-up (scaleDownDelaySeconds is the operator's own)
and its tolerance is cluster-wide (autoscaling.tolerance is the operator's own).
"""

from __future__ import annotations

from kvgate.operator import naming
from kvgate.operator.apply import MODELSERVER
from kvgate.operator.autoscaling_spec import bounds, policy_of

API_VERSION, KIND = "keda.sh/v1alpha1", "ScaledObject"
POLLING_INTERVAL_S = 15  # KEDA's default; HPA's sync period
HPA_MAX_WINDOW_S = 3600
_WAIT = "inference_extension_flow_control_request_queue_duration_seconds"


def _selector(ms: dict, pool_name: str) -> str:
    # Kubernetes names hold no quote or backslash: the label values need no escaping.
    return f'namespace="{naming.namespace_of(ms)}",pool="{pool_name}"'


def queries(ms: dict, pool_name: str) -> dict[str, str]:
    """The PromQL of each trigger, by trigger name."""
    sel = _selector(ms, pool_name)
    dispatched = f'{sel},outcome="Dispatched"'
    return {
        "waiting": f"(max(sum by (pod) (kvgate_epp_endpoint_queue_size{{{sel}}})) or vector(0)) + "
                   f"(max(sum by (pod) (inference_extension_flow_control_queue_size{{{sel}}})) or vector(0))",
        "kv": f"max(avg by (pod) (kvgate_epp_endpoint_kv_cache_usage{{{sel}}})) or vector(0)",
        "wait": f"(sum(rate({_WAIT}_sum{{{dispatched}}}[1m])) / "
                f"(sum(rate({_WAIT}_count{{{dispatched}}}[1m])) > 0)) or vector(0)",
    }


def _number(value: float) -> str:
    return f"{value:g}"


def desired_scaled_object(ms: dict, pool_name: str, prometheus_address: str) -> dict:
    spec = ms["spec"]
    policy = policy_of(spec)
    low, high = bounds(spec)
    q = queries(ms, pool_name)

    def trigger(name: str, metric_type: str, threshold: float, activation: str | None = None) -> dict:
        metadata = {"serverAddress": prometheus_address, "query": q[name], "threshold": _number(threshold)}
        if activation is not None:
            metadata["activationThreshold"] = activation
        return {"type": "prometheus", "name": name, "metricType": metric_type, "metadata": metadata}

    up_policies = [{"type": "Pods", "value": policy.scale_up_max_pods, "periodSeconds": POLLING_INTERVAL_S}]
    if policy.scale_up_max_percent > 0:
        up_policies.append({"type": "Percent", "value": int(policy.scale_up_max_percent),
                            "periodSeconds": POLLING_INTERVAL_S})
    name = naming.name_of(ms)
    return {
        "apiVersion": API_VERSION, "kind": KIND,
        "metadata": naming.object_meta(name, ms, naming.component_labels("engine", naming.engine_deployment_name(ms))),
        "spec": {
            "scaleTargetRef": {"apiVersion": MODELSERVER.api_version, "kind": MODELSERVER.kind, "name": name},
            "minReplicaCount": low, "maxReplicaCount": high,
            "pollingInterval": POLLING_INTERVAL_S,
            "cooldownPeriod": int(policy.scale_down_stabilization_s),
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                "scaleUp": {"stabilizationWindowSeconds": min(int(policy.scale_up_stabilization_s), HPA_MAX_WINDOW_S),
                            "selectPolicy": "Max", "policies": up_policies},
                "scaleDown": {"stabilizationWindowSeconds": min(int(policy.scale_down_stabilization_s),
                                                                HPA_MAX_WINDOW_S)},
            }}},
            "triggers": [trigger("waiting", "AverageValue", policy.target_waiting_per_replica, activation="0"),
                         trigger("kv", "Value", policy.target_kv_utilization),
                         trigger("wait", "Value", policy.target_queue_wait_s)],
        },
    }
