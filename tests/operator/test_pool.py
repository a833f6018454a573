import copy

import pytest

from kvgate.epp.scheduling.config import parse_config
from kvgate.operator import naming
from kvgate.operator import pool as p
from tests.operator.conftest import NOW, round_trips

IMAGE = "kvgate:test"


def _by_kind(objs):
    return {o["kind"]: o for o in objs}


def test_sample_pool_epp_objects(samples):
    pool = samples["InferencePool"]
    objs = p.desired_epp_objects(pool, IMAGE, None)
    assert [o["kind"] for o in objs] == ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "Deployment", "Service"]
    for obj in objs:
        assert round_trips(obj), obj["kind"]
        assert obj["metadata"]["ownerReferences"][0]["uid"] == "uid-demo-pool"
        assert naming.is_managed(obj) and obj["metadata"]["namespace"] == "default"
    k = _by_kind(objs)
    (c,) = k["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert c["command"] == ["kvgate", "epp", "--pool-name", "demo-pool", "--pool-namespace", "default",
                            "--grpc-host", "0.0.0.0", "--grpc-port", "9002", "--grpc-health-port", "9003",
                            "--metrics-port", "9090", "--config-file", "/config/epp.yaml"]
    assert "tcpSocket" in c["readinessProbe"] and "grpc" not in c["readinessProbe"]
    assert k["Deployment"]["spec"]["template"]["spec"]["serviceAccountName"] == "demo-pool-epp"
    svc = k["Service"]
    assert svc["metadata"]["name"] == "demo-pool-epp"
    ports = {port["name"]: port for port in svc["spec"]["ports"]}
    assert ports["grpc"]["port"] == 9002 and ports["grpc"]["appProtocol"] == "kubernetes.io/h2c"
    assert (ports["grpc-health"]["port"], ports["metrics"]["port"]) == (9003, 9090)
    pod_labels = k["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert all(pod_labels[key] == v for key, v in svc["spec"]["selector"].items())
    parse_config(k["ConfigMap"]["data"]["epp.yaml"])  # the EPP accepts the default config


def test_rbac_is_exactly_read_only_on_the_listed_resources(samples):
    role = _by_kind(p.desired_epp_objects(samples["InferencePool"], IMAGE))["Role"]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
               for v in rule["verbs"]}
    expected = {(g, r, v) for g, r in [("", "pods"), ("inference.networking.k8s.io", "inferencepools"),
                                       ("inference.networking.x-k8s.io", "inferenceobjectives"),
                                       ("inference.networking.x-k8s.io", "inferencemodelrewrites")]
                for v in ("get", "list", "watch")}
    assert granted == expected
    binding = _by_kind(p.desired_epp_objects(samples["InferencePool"], IMAGE))["RoleBinding"]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-pool-epp", "namespace": "default"}]


def test_config_change_rolls_pods_and_output_is_deterministic(samples):
    pool = samples["InferencePool"]
    assert p.desired_epp_objects(pool, IMAGE) == p.desired_epp_objects(copy.deepcopy(pool), IMAGE)
    other = p.DEFAULT_EPP_CONFIG.replace("weight: 3", "weight: 5")
    a = _by_kind(p.desired_epp_objects(pool, IMAGE))["Deployment"]["spec"]["template"]["metadata"]
    b = _by_kind(p.desired_epp_objects(pool, IMAGE, other))["Deployment"]["spec"]["template"]["metadata"]
    assert a["annotations"]["kvgate.dev/config-digest"] != b["annotations"]["kvgate.dev/config-digest"]


@pytest.mark.parametrize("mutate,reason", [
    (lambda pool: pool["spec"]["endpointPickerRef"].update(kind="Deployment"), "InvalidExtensionRef"),
    (lambda pool: pool["spec"]["endpointPickerRef"].update(port={"number": 9090}), "InvalidExtensionRef"),
])
def test_unusable_pools_give_problems_not_objects(samples, mutate, reason):
    pool = copy.deepcopy(samples["InferencePool"])
    mutate(pool)
    assert p.epp_problems(pool, None)[0]["reason"] == reason
    assert p.desired_epp_objects(pool, IMAGE) == []


def test_bad_config_is_a_problem(samples):
    assert p.epp_problems(samples["InferencePool"], "kind: Nope\n")[0]["reason"] == "InvalidConfig"
    assert p.desired_epp_objects(samples["InferencePool"], IMAGE, "plugins: [") == []


def test_ownership_rule(samples):
    pool, ms = samples["InferencePool"], samples["ModelServer"]
    ours = _by_kind(p.desired_epp_objects(pool, IMAGE))["Service"]
    users = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "demo-pool-epp", "namespace": "default"}}
    assert p.manages_epp(pool, None, [ms])            # absent: the operator creates it
    assert p.manages_epp(pool, ours, [ms])            # ours: the operator keeps it up to date
    assert not p.manages_epp(pool, users, [ms])       # the user's: left alone
    labelled_only = copy.deepcopy(ours)
    labelled_only["metadata"]["ownerReferences"] = []
    assert not p.manages_epp(pool, labelled_only, [ms])
    assert not p.manages_epp(pool, None, [])          # no ModelServer joins it: not kvgate's pool
    annotated = copy.deepcopy(pool)
    annotated["metadata"]["annotations"] = {p.EPP_ANNOTATION: "managed"}
    assert p.manages_epp(annotated, None, [])
    annotated["metadata"]["annotations"] = {p.EPP_ANNOTATION: "external"}
    assert not p.manages_epp(annotated, None, [ms])


def _gateway(name="g", ns="infra"):
    return {"kind": "Gateway", "metadata": {"name": name, "namespace": ns}}


def test_pool_status_per_gateway(samples):
    pool = samples["InferencePool"]
    svc = _by_kind(p.desired_epp_objects(pool, IMAGE))["Service"]
    status = p.pool_status(pool, [_gateway("b"), _gateway("a")], svc, now=NOW)
    assert [e["parentRef"]["name"] for e in status["parents"]] == ["a", "b"]
    entry = status["parents"][0]
    assert entry["parentRef"] == {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "a",
                                  "namespace": "infra"}
    assert entry["controllerName"] == "kvgate.dev/gateway-controller"
    conds = {c["type"]: (c["status"], c["reason"]) for c in entry["conditions"]}
    assert conds == {"Accepted": ("True", "Accepted"), "ResolvedRefs": ("True", "ResolvedRefs")}


def test_pool_status_missing_epp_service_and_foreign_parents_kept(samples):
    pool = copy.deepcopy(samples["InferencePool"])
    foreign = {"parentRef": {"name": "x"}, "controllerName": "other.dev/c", "conditions": []}
    pool["status"] = {"parents": [foreign]}
    status = p.pool_status(pool, [_gateway()], None, now=NOW)
    assert status["parents"][0] == foreign
    resolved = next(c for c in status["parents"][1]["conditions"] if c["type"] == "ResolvedRefs")
    assert (resolved["status"], resolved["reason"]) == ("False", "InvalidExtensionRef")
    assert p.pool_status(pool, [], None, now=NOW) == {"parents": [foreign]}


def test_pool_status_is_stable_across_resyncs(samples):
    pool = copy.deepcopy(samples["InferencePool"])
    first = p.pool_status(pool, [_gateway()], None, now=NOW)
    pool["status"] = first
    assert p.pool_status(pool, [_gateway()], None, now="2030-01-01T00:00:00Z") == first


def test_epp_resolution_checks_port_and_type(samples):
    pool = samples["InferencePool"]
    svc = {"spec": {"ports": [{"port": 9002}]}}
    assert p.epp_resolution(pool, svc)[0]
    assert not p.epp_resolution(pool, {"spec": {"ports": [{"port": 1}]}})[0]
    assert not p.epp_resolution(pool, {"spec": {"type": "ExternalName", "ports": [{"port": 9002}]}})[0]
    no_ref = copy.deepcopy(pool)
    del no_ref["spec"]["endpointPickerRef"]
    assert p.epp_resolution(no_ref, svc) == (False, "endpointPickerRef is not set")
