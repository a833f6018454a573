"""The KEDA ScaledObject of a ModelServer with autoscaling.provider keda (operator/keda.py), checked against KEDA's
own CRD schema (a trimmed copy in fixtures/), and the autoscaler's handling of it (autoscaler.py)."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonschema
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvgate.operator.apply import ApiError
from kvgate.operator.autoscaler import Autoscaler
from kvgate.operator.keda import desired_scaled_object, queries
from tests.operator.memory_kube import MemoryKube

CRD = yaml.safe_load((Path(__file__).parent / "fixtures" / "keda_scaledobjects_crd.yaml").read_text())
SCHEMA = CRD["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
PROMETHEUS = "http://prometheus.monitoring:9090"


def _modelserver(samples, **autoscaling) -> dict:
    ms = copy.deepcopy(samples["ModelServer"])
    ms["spec"].update(minReplicas=0, maxReplicas=6, autoscaling={"provider": "keda", **autoscaling})
    return ms


def unknown_fields(obj, schema, where="") -> list[str]:
    """Fields the API server would prune (not declared in the structural schema)."""
    if isinstance(obj, dict) and schema.get("type") == "object" and "properties" in schema:
        out = []
        for key, value in obj.items():
            if key not in schema["properties"]:
                out.append(f"{where}.{key}")
            else:
                out += unknown_fields(value, schema["properties"][key], f"{where}.{key}")
        return out
    if isinstance(obj, list) and "items" in schema:
        return [f for i, item in enumerate(obj) for f in unknown_fields(item, schema["items"], f"{where}[{i}]")]
    return []


def test_the_scaled_object_is_valid_for_kedas_schema(samples):
    so = desired_scaled_object(_modelserver(samples, scaleUpMaxPercent=0), "demo-pool", PROMETHEUS)
    jsonschema.validate(so, SCHEMA)
    assert unknown_fields(so, SCHEMA) == []
    spec = so["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelServer", "name": "demo-llm"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"], spec["cooldownPeriod"]) == (0, 6, 300)
    assert [t["metadata"]["threshold"] for t in spec["triggers"]] == ["4", "0.8", "1"]
    assert spec["triggers"][0]["metadata"]["activationThreshold"] == "0"  # from zero on the first held request
    assert {t["metadata"]["serverAddress"] for t in spec["triggers"]} == {PROMETHEUS}
    assert spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleUp"]["policies"] == [
        {"type": "Pods", "value": 4, "periodSeconds": 15}]
    assert so["metadata"]["ownerReferences"][0]["kind"] == "ModelServer"


def test_windows_are_capped_at_hpas_limit(samples):
    so = desired_scaled_object(_modelserver(samples, scaleDownStabilizationSeconds=7200), "demo-pool", PROMETHEUS)
    behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 3600
    jsonschema.validate(so, SCHEMA)


def test_the_queries_name_metrics_the_epp_exports(samples):
    """Every metric a query names is on a real EPP exporter's page (flow control on)."""
    from kvgate.epp.metrics import EndpointGauges, EndpointRow, EppMetrics, Snapshot
    from prometheus_client import generate_latest

    metrics = EppMetrics()
    gauges = EndpointGauges(director=None)
    gauges.snapshot = Snapshot((EndpointRow("a:1", 1, 1, 0.5, 1.0, 1, False, True),), flow_rows=(("f", 0, 1, 9),))
    metrics.registry.register(gauges)
    metrics.observe_flow("f", 0, "Dispatched", 0.5)
    names = {s.name for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
             for s in f.samples}
    import re
    for query in queries(_modelserver(samples), "demo-pool").values():
        named = set(re.findall(r"([a-z_:]+)\{", query))
        assert named and named <= names, named - names
        assert 'namespace="default",pool="demo-pool"' in query


class KedaKube(MemoryKube):
    """MemoryKube that serves (or not) KEDA's API group."""

    def __init__(self, installed: bool) -> None:
        super().__init__()
        self.installed = installed

    def request(self, method, path, body=None, *, query=None, content_type=None):
        if path == "/apis/keda.sh/v1alpha1":
            if not self.installed:
                raise ApiError(404, method, path, "")
            return {"resources": [{"name": "scaledobjects", "kind": "ScaledObject"}]}
        if "scaledobjects" in path and not self.installed:
            raise ApiError(404, method, path, "")
        return super().request(method, path, body, query=query, content_type=content_type)


@pytest.mark.parametrize("installed, address, reason", [(False, PROMETHEUS, "KedaNotInstalled"),
                                                        (True, None, "KedaNotConfigured"),
                                                        (True, PROMETHEUS, "KedaScaledObject")])
def test_the_autoscaler_renders_it_only_where_keda_is_installed_and_configured(samples, installed, address, reason):
    kube = KedaKube(installed)
    kube.put(samples["InferencePool"])
    kube.put(_modelserver(samples))
    Autoscaler(kube, "default", lambda key: None, keda_prometheus_address=address).run_once()
    ms = kube.stored("ModelServer", "demo-llm")
    active = next(c for c in ms["status"]["conditions"] if c["type"] == "ScalingActive")
    assert (active["status"], active["reason"]) == ("True" if reason == "KedaScaledObject" else "False", reason)
    assert (kube.stored("ScaledObject", "demo-llm") is not None) == (reason == "KedaScaledObject")
    assert "autoscaling" not in ms["status"]  # the operator's own autoscaler stays out


def test_a_modelserver_that_leaves_keda_loses_its_scaled_object(samples):
    kube = KedaKube(True)
    kube.put(samples["InferencePool"])
    kube.put(_modelserver(samples))
    scaler = Autoscaler(kube, "default", lambda key: None, keda_prometheus_address=PROMETHEUS)
    scaler.run_once()
    assert kube.stored("ScaledObject", "demo-llm") is not None
    kube.stored("ModelServer", "demo-llm")["spec"]["autoscaling"]["provider"] = "operator"
    scaler.metrics_port = 1  # no EPP here: the operator's autoscaler keeps the count
    scaler.run_once()
    assert kube.stored("ScaledObject", "demo-llm") is None
