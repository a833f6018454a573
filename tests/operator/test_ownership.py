"""The operator never takes over or deletes an object it did not make (apply.py), and the reconciler turns every
refusal — a taken name, a host mount, a foreign image, a label joining another pool — into a status condition,
leaving what runs alone. Reconciles run against MemoryKube: the operator's own Kube with an in-memory store."""

import copy
import logging

import pytest

from kvgate.operator import naming
from kvgate.operator.apply import NameConflict
from kvgate.operator.config import OperatorConfig
from kvgate.operator.reconciler import Reconciler
from kvgate.operator.tenancy import TenantPolicy
from tests.operator.memory_kube import MemoryKube

IMAGE = "ghcr.io/kvgate/kvgate:0.1.0"


def _owner(kind="InferencePool", name="p", uid="uid-p"):
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": kind, "metadata": {"name": name, "uid": uid,
                                                                                       "namespace": "default"}}


def _config_map(owner, data, labels=None):
    meta = naming.object_meta("p-epp", owner, naming.component_labels("epp", "p") if labels is None else labels)
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": data}


# --- the mechanism -----------------------------------------------------------------------------------------

def test_takeover_refusal_rules():
    mine = _config_map(_owner(), {"a": "1"})
    assert naming.takeover_refusal(None, mine) is None
    assert naming.takeover_refusal(copy.deepcopy(mine), mine) is None
    user = {"kind": "ConfigMap", "metadata": {"name": "p-epp", "labels": {"team": "a"}}}
    assert "not the operator's" in naming.takeover_refusal(user, mine)
    other_owner = _config_map(_owner("ModelServer", "p-epp", "uid-ms"), {})
    assert "ModelServer 'p-epp'" in naming.takeover_refusal(other_owner, mine)
    recreated = _config_map(_owner(uid="uid-new"), {})  # same owner name, a new object: not ours
    assert naming.takeover_refusal(recreated, mine) is not None


def test_apply_refuses_a_users_object_and_writes_nothing():
    kube = MemoryKube()
    users = kube.put({"apiVersion": "v1", "kind": "ConfigMap",
                      "metadata": {"name": "p-epp", "namespace": "default"}, "data": {"mine": "yes"}})
    with pytest.raises(NameConflict) as refused:
        kube.apply(_config_map(_owner(), {"epp.yaml": "x"}))
    assert "ConfigMap default/p-epp" in str(refused.value) and "not the operator's" in str(refused.value)
    assert kube.stored("ConfigMap", "p-epp") == users
    assert not [c for c in kube.calls if c[0] == "PATCH"]


def test_apply_creates_and_updates_its_own():
    kube = MemoryKube()
    kube.apply(_config_map(_owner(), {"epp.yaml": "1"}))
    kube.apply(_config_map(_owner(), {"epp.yaml": "2"}))
    assert kube.stored("ConfigMap", "p-epp")["data"] == {"epp.yaml": "2"}
    with pytest.raises(NameConflict):  # another resource's object of that name is not taken over either
        kube.apply(_config_map(_owner("ModelServer", "p-epp", "uid-ms"), {"epp.yaml": "3"}))


def test_delete_refuses_objects_the_operator_did_not_make():
    kube = MemoryKube()
    users = kube.put({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "default"}})
    with pytest.raises(NameConflict):
        kube.delete(users)
    assert kube.stored("Deployment", "d") is not None


def test_the_guard_is_the_operators_a_client_owning_its_objects_turns_it_off():
    """The conformance suite applies and deletes upstream's manifests (its own, by its field manager) through the
    same layer: without the guard it may; the operator's Kube keeps refusing."""
    kube = MemoryKube()
    kube.guard_ownership = False
    users = kube.put({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "default"}})
    kube.apply({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "d", "namespace": "default"},
                "spec": {"replicas": 2}})
    kube.delete(kube.stored("Deployment", "d") or users)
    assert kube.stored("Deployment", "d") is None


# --- the reconciler ----------------------------------------------------------------------------------------

def _reconciler(kube, policy=TenantPolicy()):
    return Reconciler(kube, OperatorConfig(engine_image=IMAGE, epp_image=IMAGE, envoy_image="envoy:test",
                                           tenant_policy=policy))


def _cluster(samples):
    kube = MemoryKube()
    pool, ms = kube.put(samples["InferencePool"]), kube.put(samples["ModelServer"])
    return kube, pool, ms


def _ready(kube, name="demo-llm"):
    conds = (kube.stored("ModelServer", name).get("status") or {}).get("conditions") or []
    return next(c for c in conds if c["type"] == "Ready")


def test_modelserver_deployment_name_taken_by_a_user(samples):
    kube, pool, ms = _cluster(samples)
    users = kube.put({"apiVersion": "apps/v1", "kind": "Deployment",
                      "metadata": {"name": "demo-llm", "namespace": "default"},
                      "spec": {"selector": {"matchLabels": {"app": "theirs"}}}})  # a selector change would recreate
    _reconciler(kube).reconcile_modelserver("default", "demo-llm")
    ready = _ready(kube)
    assert (ready["status"], ready["reason"]) == ("False", "NameConflict")
    assert "Deployment default/demo-llm" in ready["message"]
    assert kube.stored("Deployment", "demo-llm") == users  # neither taken over nor deleted
    assert not [c for c in kube.calls if c[0] in ("PATCH", "DELETE") and "deployments" in c[1]]


def test_modelserver_reconciles_its_own_deployment(samples):
    kube, pool, ms = _cluster(samples)
    _reconciler(kube).reconcile_modelserver("default", "demo-llm")
    dep = kube.stored("Deployment", "demo-llm")
    assert naming.is_owned_by(dep, ms) and naming.is_managed(dep)
    assert _ready(kube)["reason"] == "ReplicasNotReady"


@pytest.mark.parametrize("edit,reason", [
    (lambda spec: spec["model"].update(path="/m", hostPath={"path": "/"}), "HostPathNotAllowed"),
    (lambda spec: spec.update(image="docker.io/someone/else:1"), "ImageNotAllowed"),
    (lambda spec: spec.update(podLabels={"app": "other"}), "ReservedLabel"),
])
def test_a_refused_edit_keeps_the_running_deployment(samples, edit, reason):
    kube, pool, ms = _cluster(samples)
    reconciler = _reconciler(kube)
    reconciler.reconcile_modelserver("default", "demo-llm")
    before = kube.stored("Deployment", "demo-llm")
    edited = kube.stored("ModelServer", "demo-llm")
    edit(edited["spec"])
    edited["metadata"]["generation"] = 2
    reconciler.reconcile_modelserver("default", "demo-llm")
    ready = _ready(kube)
    assert (ready["status"], ready["reason"], ready["observedGeneration"]) == ("False", reason, 2)
    assert kube.stored("Deployment", "demo-llm") == before


def test_labels_joining_another_pool_are_refused(samples):
    kube, pool, ms = _cluster(samples)
    victim = copy.deepcopy(samples["InferencePool"])
    victim["metadata"].update(name="victim", uid="uid-victim")
    victim["spec"]["selector"]["matchLabels"] = {"tier": "gold"}
    kube.put(victim)
    kube.stored("ModelServer", "demo-llm")["spec"]["podLabels"] = {"tier": "gold"}
    _reconciler(kube).reconcile_modelserver("default", "demo-llm")
    assert _ready(kube)["reason"] == "JoinsOtherPool" and "'victim'" in _ready(kube)["message"]
    assert kube.stored("Deployment", "demo-llm") is None


def test_allowed_host_path_is_applied_and_logged_once_per_generation(samples, caplog):
    kube, pool, ms = _cluster(samples)
    kube.stored("ModelServer", "demo-llm")["spec"]["model"].update(path="/m", hostPath={"path": "/data/models"})
    reconciler = _reconciler(kube, TenantPolicy(allow_host_path=True))
    with caplog.at_level(logging.INFO, logger="kvgate.operator"):
        reconciler.reconcile_modelserver("default", "demo-llm")
        reconciler.reconcile_modelserver("default", "demo-llm")
    uses = [r.getMessage() for r in caplog.records if "hostPath /data/models" in r.getMessage()]
    assert len(uses) == 1 and "allowed by the operator's flags" in uses[0]
    volumes = kube.stored("Deployment", "demo-llm")["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "hostPath": {"path": "/data/models", "type": "Directory"}} in volumes


def _epp_entry(kube):
    parents = (kube.stored("InferencePool", "demo-pool").get("status") or {}).get("parents") or []
    entry = next(p for p in parents if p["controllerName"] == "kvgate.dev/endpoint-picker")
    return next(c for c in entry["conditions"] if c["type"] == "Accepted")


def test_pool_epp_object_name_taken_by_a_user(samples):
    kube, pool, ms = _cluster(samples)
    users = kube.put({"apiVersion": "v1", "kind": "ConfigMap",
                      "metadata": {"name": "demo-pool-epp", "namespace": "default"}, "data": {"x": "y"}})
    _reconciler(kube).reconcile_pool("default", "demo-pool")
    accepted = _epp_entry(kube)
    assert (accepted["status"], accepted["reason"]) == ("False", "NameConflict")
    assert "ConfigMap default/demo-pool-epp" in accepted["message"]
    assert kube.stored("ConfigMap", "demo-pool-epp") == users
    assert kube.stored("Deployment", "demo-pool-epp") is None  # the EPP is not started without its config
    del kube.objects[("configmaps", "default", "demo-pool-epp")]  # the user deletes theirs
    _reconciler(kube).reconcile_pool("default", "demo-pool")  # the name is free again: the EPP comes up
    assert _epp_entry(kube)["status"] == "True" and kube.stored("Deployment", "demo-pool-epp") is not None


def test_pool_network_policy_name_taken_keeps_the_epp_pods_out(samples):
    kube, pool, ms = _cluster(samples)
    kube.put({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
              "metadata": {"name": "demo-pool-epp", "namespace": "default"}, "spec": {"podSelector": {}}})
    _reconciler(kube).reconcile_pool("default", "demo-pool")
    assert _epp_entry(kube)["reason"] == "NameConflict"
    assert kube.stored("Deployment", "demo-pool-epp") is None


def test_gateway_object_name_taken_is_a_condition_not_a_retry_loop(samples):
    kube, pool, ms = _cluster(samples)
    for kind in ("GatewayClass", "Gateway", "HTTPRoute"):
        kube.put(samples[kind])
    gateway = naming.name_of(samples["Gateway"])
    users = kube.put({"apiVersion": "v1", "kind": "ConfigMap",
                      "metadata": {"name": f"{gateway}-envoy", "namespace": "default"}, "data": {}})
    _reconciler(kube).reconcile_gateways()  # no exception: nothing to retry
    conds = {c["type"]: c for c in kube.stored("Gateway", gateway)["status"]["conditions"]}
    assert (conds["Programmed"]["status"], conds["Programmed"]["reason"]) == ("False", "NameConflict")
    assert f"ConfigMap default/{gateway}-envoy" in conds["Programmed"]["message"]
    assert kube.stored("ConfigMap", f"{gateway}-envoy") == users
    assert kube.stored("Deployment", f"{gateway}-envoy") is None
