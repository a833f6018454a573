"""Several EPP replicas per pool (annotation kvgate.dev/epp-replicas): leader election's flag and Lease
rules only then, spread across nodes, a PodDisruptionBudget, and nothing of it while the operator's HA is off."""

from __future__ import annotations

import copy

import pytest

from kvgate.epp.leader import lease_name
from kvgate.operator import pool as p
from kvgate.operator.config import OperatorConfig
from kvgate.operator.reconciler import Reconciler
from tests.operator.memory_kube import MemoryKube


def _annotated(pool: dict, value: str | None) -> dict:
    pool = copy.deepcopy(pool)
    annotations = pool["metadata"].setdefault("annotations", {})
    annotations.pop(p.REPLICAS_ANNOTATION, None)
    if value is not None:
        annotations[p.REPLICAS_ANNOTATION] = value
    return pool


def _by_kind(objects: list[dict]) -> dict[str, dict]:
    return {o["kind"]: o for o in objects}


@pytest.mark.parametrize("value, replicas", [(None, 1), ("1", 1), ("3", 3), ("5", 5)])
def test_replicas_annotation(samples, value, replicas):
    assert p.epp_replicas(_annotated(samples["InferencePool"], value)) == replicas


@pytest.mark.parametrize("value", ["0", "6", "-1", "two", "", " 2", "2.0", "9" * 50])
def test_bad_replicas_annotation_says_why(samples, value):
    with pytest.raises(ValueError, match="a whole number from 1 to 5"):
        p.epp_replicas(_annotated(samples["InferencePool"], value))


def test_one_replica_holds_no_lease_rules_and_runs_no_election(samples):
    objects = _by_kind(p.render_epp_objects(samples["InferencePool"], "img", p.DEFAULT_EPP_CONFIG))
    assert not any("coordination.k8s.io" in r["apiGroups"] for r in objects["Role"]["rules"])
    deployment = objects["Deployment"]
    assert deployment["spec"]["replicas"] == 1 and "affinity" not in deployment["spec"]["template"]["spec"]
    assert "--ha-enable-leader-election" not in deployment["spec"]["template"]["spec"]["containers"][0]["command"]


def test_several_replicas_elect_over_their_one_lease_and_spread(samples):
    pool = samples["InferencePool"]
    objects = _by_kind(p.render_epp_objects(pool, "img", p.DEFAULT_EPP_CONFIG, replicas=3))
    lease_rules = [r for r in objects["Role"]["rules"] if r["apiGroups"] == ["coordination.k8s.io"]]
    assert lease_rules == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "update"],
         "resourceNames": [lease_name(pool["metadata"]["namespace"], pool["metadata"]["name"])]}]
    spec = objects["Deployment"]["spec"]
    assert spec["replicas"] == 3
    assert "--ha-enable-leader-election" in spec["template"]["spec"]["containers"][0]["command"]
    term = spec["template"]["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term[0]["podAffinityTerm"]["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    pdb = p.pod_disruption_budget(pool)
    assert pdb["spec"] == {"maxUnavailable": 1, "selector": {"matchLabels": spec["selector"]["matchLabels"]}}


def _reconcile(kube, ha: bool):
    Reconciler(kube, OperatorConfig(engine_image="img", epp_image="img", envoy_image="envoy",
                                    epp_high_availability=ha)).reconcile_pool("default", "demo-pool")


def _epp_entry(kube) -> dict:
    pool = kube.stored("InferencePool", "demo-pool")
    return next(e for e in pool["status"]["parents"] if e["controllerName"] == p.EPP_CONTROLLER_NAME)


def test_the_operator_runs_replicas_only_with_ha_on_and_keeps_the_budget_in_step(samples):
    kube = MemoryKube()
    for kind in ("GatewayClass", "Gateway", "HTTPRoute", "ModelServer"):
        kube.put(samples[kind])
    kube.put(_annotated(samples["InferencePool"], "2"))
    _reconcile(kube, ha=False)  # HA off: one replica, and the status says why
    assert kube.stored("Deployment", "demo-pool-epp")["spec"]["replicas"] == 1
    assert kube.stored("PodDisruptionBudget", "demo-pool-epp") is None
    assert "HighAvailabilityDisabled" in str(_epp_entry(kube)["conditions"])
    _reconcile(kube, ha=True)
    assert kube.stored("Deployment", "demo-pool-epp")["spec"]["replicas"] == 2
    assert kube.stored("PodDisruptionBudget", "demo-pool-epp")["spec"]["maxUnavailable"] == 1
    assert "HighAvailabilityDisabled" not in str(_epp_entry(kube)["conditions"])
    kube.put(_annotated(kube.stored("InferencePool", "demo-pool"), None))  # back to one: the budget goes
    _reconcile(kube, ha=True)
    assert kube.stored("Deployment", "demo-pool-epp")["spec"]["replicas"] == 1
    assert kube.stored("PodDisruptionBudget", "demo-pool-epp") is None
    kube.put(_annotated(kube.stored("InferencePool", "demo-pool"), "many"))
    _reconcile(kube, ha=True)
    assert "InvalidReplicas" in str(_epp_entry(kube)["conditions"])
    assert kube.stored("Deployment", "demo-pool-epp")["spec"]["replicas"] == 1
