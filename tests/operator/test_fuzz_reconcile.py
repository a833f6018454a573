"""Property-based fuzzing of ModelServer and InferencePool specs through the operator's reconcilers.

Each case puts a fuzzed ModelServer and InferencePool (with a Gateway routing to the pool) into MemoryKube — the
operator's own Kube over an in-memory store — and runs the reconcile keys the kopf handlers enqueue for them:
ModelServer, InferencePool, PoolMembers and Gateways. The specs are of two kinds:
- schema-valid with absurd values (the API server admits these): replicas 10^9, ports 0 and 70000, huge strings,
  odd label keys, empty selectors, extreme engine settings, every annotation the operator reads;
- schema-invalid (any field replaced by any JSON value): the API server refuses these, but a handler must
  still not crash on one (an older CRD, a cluster without the schema, a client that bypasses it).
Every case must end with the keys reconciled (no exception escapes: one would be a retry loop, not an answer)
and the ModelServer carrying a Ready condition with a message, the pool (when the operator runs its EPP) its
EPP entry's Accepted condition with a message; a rendered engine Deployment only for a Ready-able spec.
"""

import copy
import time
from pathlib import Path

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.operator.config import OperatorConfig
from kvgate.operator.gateway import BREAKER_ANNOTATIONS, STREAM_IDLE_ANNOTATION
from kvgate.operator.reconciler import GATEWAYS_KEY, Reconciler
from kvgate.operator.network_policy import INGRESS_FROM_ANNOTATION, METRICS_FROM_ANNOTATION, POLICY_ANNOTATION
from kvgate.operator.pool import CONFIG_ANNOTATION, EPP_ANNOTATION
from tests.operator.memory_kube import MemoryKube

MAX_EXAMPLES = 300  # ~8 s on a shared core
CASE_LIMIT_S = 5.0
IMAGE = "ghcr.io/kvgate/kvgate:0.1.0"
REPO = Path(__file__).resolve().parents[2]


def _schema(crd_file: str) -> dict:
    crd = yaml.safe_load((REPO / "crds" / crd_file).read_text())
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]


MODELSERVER_SCHEMA = _schema("kvgate.dev_modelservers.yaml")
POOL_SCHEMA = _schema("inference.networking.k8s.io_inferencepools.yaml")

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=20))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)), max_leaves=8)
HUGE = "x" * 70_000
names = st.sampled_from(["demo", "a", "a" * 253, "a.b-c", "demo-pool", "UPPER", "ünï", "../x", "a b", "", HUGE])
big_ints = st.sampled_from([0, 1, 2, 65535, 65536, 70000, 2**31 - 1, 2**31, 10**9, 2**63, 10**30, -1])
# In the schema's ranges, at their edges: what the API server admits.
ports = st.sampled_from([1, 8000, 65535])
counts = st.sampled_from([1, 2, 2048, 10**9, 2**31 - 1])
label_keys = st.sampled_from(["app", "tier", "kvgate.dev/x", "app.kubernetes.io/name", "app.kubernetes.io/instance",
                              "a/b/c", "-bad", "x" * 300, "", "ü"])
label_values = st.sampled_from(["demo-llm", "gold", "", "x" * 300, "a b", "ü"])
labels = st.dictionaries(label_keys, label_values, max_size=3)
quantities = st.sampled_from(["2Gi", "1", "1.5Mi", "999999999Ti", "0.0001Ki", "0", "1e9", "-1Gi", "1Pi", 1, 0, -5,
                              2**63, 10**30])

model = st.fixed_dictionaries({}, optional={
    "path": st.sampled_from(["demo", "/m", "/", "relative", "/" + HUGE]),
    "servedModelName": names,
    "pvc": st.fixed_dictionaries({"claimName": names}, optional={"readOnly": st.booleans()}),
    "hostPath": st.fixed_dictionaries({"path": st.sampled_from(["/", "/data/models", "/" + HUGE])}),
    "image": st.fixed_dictionaries({"reference": names},
                                   optional={"pullPolicy": st.sampled_from(["Always", "IfNotPresent", "Never"])}),
})
engine = st.fixed_dictionaries({}, optional={
    "backend": st.sampled_from(["torch", "sim"]), "device": st.sampled_from(["auto", "cpu", "cuda", "cuda:99"]),
    "dtype": st.sampled_from(["auto", "float32", "bfloat16", "float16"]),
    "blockSize": st.sampled_from([1, 16, 1024]), "maxNumSeqs": counts, "maxNumBatchedTokens": counts,
    "maxModelLen": counts, "kvCacheMemory": quantities, "enablePrefixCaching": st.booleans(),
    "shutdownGracePeriodSeconds": st.sampled_from([1, 30, 3600]),
    "apiKeySecretRef": st.fixed_dictionaries({"name": names,
                                              "key": st.sampled_from(["token", ".k", "..", "a/b", HUGE])}),
})
modelserver_specs = st.fixed_dictionaries({"poolRef": st.fixed_dictionaries({"name": st.sampled_from(
    ["demo-pool", "demo-pool", "demo-pool", "other", "a" * 253])}), "model": st.one_of(st.just({}), model)},
    optional={
    "replicas": st.sampled_from([0, 1, 2, 10**9, 2**31 - 1]), "engine": engine,
    "image": st.sampled_from([IMAGE, IMAGE, "docker.io/evil:1", "", HUGE]),
    "imagePullPolicy": st.sampled_from(["Always", "IfNotPresent", "Never"]),
    "resources": st.fixed_dictionaries({}, optional={"limits": st.dictionaries(st.sampled_from(["cpu", "memory"]),
                                                                                quantities, max_size=2),
                                                     "requests": st.just({"cpu": "1"}), "junk": json_values}),
    "extraArgs": st.lists(st.sampled_from(["--port=1", "--host", "--seed", "1", "--api-key", "", HUGE]),
                          max_size=4),
    "podLabels": labels, "nodeSelector": labels,
    "tolerations": st.lists(st.fixed_dictionaries({}, optional={
        "key": label_keys, "operator": st.sampled_from(["Exists", "Equal"]), "effect": st.just("NoSchedule"),
        "tolerationSeconds": st.sampled_from([0, -1, 2**62]), "junk": json_values}), max_size=2),
})
pool_specs = st.fixed_dictionaries({
    "selector": st.fixed_dictionaries({"matchLabels": st.one_of(st.just({"app": "demo-llm"}), labels)}),
    "targetPorts": st.one_of(st.just([{"number": 8000}]),
                             st.lists(st.fixed_dictionaries({"number": ports}), min_size=1, max_size=8, unique_by=str)),
}, optional={
    "endpointPickerRef": st.fixed_dictionaries({"name": st.sampled_from(["demo-pool-epp", "x" * 300, "other"])},
                                               optional={"port": st.fixed_dictionaries({"number": ports}),
                                                         "failureMode": st.sampled_from(["FailOpen", "FailClose"]),
                                                         "kind": st.sampled_from(["Service", "Deployment", ""]),
                                                         "group": st.sampled_from(["", "apps", "x" * 300])}),
    "appProtocol": st.sampled_from(["http", "kubernetes.io/h2c", "grpc"]),
})
annotations = st.dictionaries(st.sampled_from([
    EPP_ANNOTATION, EPP_ANNOTATION, CONFIG_ANNOTATION, METRICS_FROM_ANNOTATION, INGRESS_FROM_ANNOTATION,
    POLICY_ANNOTATION, STREAM_IDLE_ANNOTATION, *BREAKER_ANNOTATIONS, "other"]),
    st.one_of(st.sampled_from(["managed", "external", "disabled", "epp-config", "epp-config/epp.yaml", "Bad Name",
                               "- podSelector: {}", "[" * 5000, "&a [*a]", "1s", "-1", "10" * 200, "99999999999999999999", "", HUGE]),
              st.text(max_size=30)), max_size=3)


def _break(draw, spec: dict) -> dict:
    """`spec` with one field (at any depth) replaced by any JSON value: what the CRD schema would refuse."""
    spec = copy.deepcopy(spec)
    node, path = spec, []
    while isinstance(node, dict) and node and draw(st.integers(0, 2)):
        key = draw(st.sampled_from(sorted(node)))
        if not isinstance(node[key], dict):
            break
        node, path = node[key], path + [key]
    node[draw(st.one_of(st.sampled_from(sorted(node) or ["x"]), st.text(max_size=8)))] = draw(
        st.one_of(json_values, big_ints, st.sampled_from(["", "x", 0, -1, [], {}, None, [1, "a"], {"a": 1}])))
    return spec


@st.composite
def cases(draw) -> tuple[dict, dict, dict, str | None]:
    ms_spec, pool_spec = draw(modelserver_specs), draw(pool_specs)
    # About a third of the specs are schema-invalid: a field broken (1 in 4), the whole spec junk (1 in 16).
    ms_spec = draw(st.sampled_from([lambda: ms_spec] * 11 + [lambda: _break(draw, ms_spec)] * 4 + [
        lambda: draw(st.one_of(json_values, st.just(None)))]))()
    pool_spec = draw(st.sampled_from([lambda: pool_spec] * 11 + [lambda: _break(draw, pool_spec)] * 4 + [
        lambda: draw(st.one_of(json_values, st.just(None)))]))()
    config = draw(st.sampled_from([None, "plugins: [", "kind: x", "[" * 3000, HUGE,
                                   "apiVersion: llm-d.ai/v1\nkind: EndpointPickerConfig\nplugins:\n"
                                   "- type: max-score-picker\n  parameters: {maxNumOfEndpoints: 2}\n"]))
    return ms_spec, pool_spec, draw(annotations), config


def _objects(ms_spec, pool_spec, pool_annotations, config) -> list[dict]:
    meta = {"namespace": "default"}
    objs = [
        {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelServer", "metadata": {**meta, "name": "demo-llm"},
         "spec": ms_spec},
        {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
         "metadata": {**meta, "name": "demo-pool", "annotations": pool_annotations}, "spec": pool_spec},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "GatewayClass", "metadata": {"name": "kvgate"},
         "spec": {"controllerName": "kvgate.dev/gateway-controller"}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway", "metadata": {**meta, "name": "gw"},
         "spec": {"gatewayClassName": "kvgate", "listeners": [{"name": "http", "protocol": "HTTP", "port": 8080}]}},
        {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {**meta, "name": "r"},
         "spec": {"parentRefs": [{"name": "gw"}], "rules": [{"backendRefs": [
             {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "demo-pool"}]}]}},
    ]
    if config is not None:
        objs.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {**meta, "name": "epp-config"},
                     "data": {"epp.yaml": config}})
    return objs


def _condition(obj: dict | None, kind: str) -> dict | None:
    conds = ((obj or {}).get("status") or {}).get("conditions") or []
    return next((c for c in conds if c.get("type") == kind), None)


def _epp_accepted(pool: dict) -> dict | None:
    for entry in (pool.get("status") or {}).get("parents") or []:
        if entry.get("controllerName") == "kvgate.dev/endpoint-picker":
            return next((c for c in entry["conditions"] if c["type"] == "Accepted"), None)
    return None


def _valid(spec, schema) -> bool:
    return jsonschema.Draft7Validator(schema).is_valid(spec)


@pytest.mark.slow
def test_fuzzed_specs_end_in_objects_or_conditions():
    seen = {"cases": 0, "schema_valid": 0, "deployments": 0, "ready_false": 0, "epp_entries": 0, "slowest_s": 0.0,
            "reasons": {}}

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=cases())
    def check(case):
        ms_spec, pool_spec, pool_annotations, config = case
        kube = MemoryKube()
        for obj in _objects(ms_spec, pool_spec, pool_annotations, config):
            kube.put(obj)
        reconciler = Reconciler(kube, OperatorConfig(engine_image=IMAGE, epp_image=IMAGE, envoy_image="envoy:test"))
        start = time.monotonic()
        for key in [("ModelServer", "default", "demo-llm"), ("InferencePool", "default", "demo-pool"),
                    ("PoolMembers", "default", "demo-pool"), GATEWAYS_KEY, ("ConfigUsers", "default", "epp-config")]:
            reconciler.reconcile(key)  # an exception here is the defect: the worker would retry it forever
        elapsed = time.monotonic() - start
        seen["slowest_s"] = max(seen["slowest_s"], elapsed)
        assert elapsed < CASE_LIMIT_S, elapsed

        ready = _condition(kube.stored("ModelServer", "demo-llm"), "Ready")
        assert ready and isinstance(ready["message"], str) and ready["message"] and ready["reason"], ready
        deployment = kube.stored("Deployment", "demo-llm")
        if ready["status"] == "False" and ready["reason"] not in ("ReplicasNotReady", "DeploymentPending"):
            assert deployment is None, ready  # a refused spec renders nothing
            seen["ready_false"] += 1
            seen["reasons"][ready["reason"]] = seen["reasons"].get(ready["reason"], 0) + 1
        else:
            assert deployment is not None and deployment["spec"]["template"]["spec"]["containers"], ready
            seen["deployments"] += 1
        accepted = _epp_accepted(kube.stored("InferencePool", "demo-pool"))
        if accepted is not None:
            assert accepted["message"] and accepted["reason"], accepted
            seen["epp_entries"] += 1
        seen["schema_valid"] += _valid(ms_spec, MODELSERVER_SCHEMA) and _valid(pool_spec, POOL_SCHEMA)
        seen["cases"] += 1

    check()
    print(f"\nreconcile fuzz: {seen['cases']} cases ({seen['schema_valid']} schema-valid), "
          f"{seen['deployments']} engine Deployments, {seen['ready_false']} Ready=False, "
          f"{seen['epp_entries']} pool EPP entries, slowest {seen['slowest_s']:.3f} s; Ready=False reasons "
          f"{dict(sorted(seen['reasons'].items()))}")
    assert seen["cases"] >= MAX_EXAMPLES and seen["deployments"] and seen["ready_false"] and seen["schema_valid"], seen


# --- the defects the fuzzing found, each pinned: before, each reconcile raised (and was retried forever) ---------

def _reconcile_all(ms_spec, pool_spec, pool_annotations=None) -> MemoryKube:
    kube = MemoryKube()
    for obj in _objects(ms_spec, pool_spec, pool_annotations or {}, None):
        kube.put(obj)
    reconciler = Reconciler(kube, OperatorConfig(engine_image=IMAGE, epp_image=IMAGE, envoy_image="envoy:test"))
    for key in [("ModelServer", "default", "demo-llm"), ("InferencePool", "default", "demo-pool"), GATEWAYS_KEY]:
        reconciler.reconcile(key)
    return kube


GOOD_POOL = {"selector": {"matchLabels": {"app": "demo-llm"}}, "targetPorts": [{"number": 8000}],
             "endpointPickerRef": {"name": "demo-pool-epp", "port": {"number": 9002}}}


@pytest.mark.parametrize("ms_spec,reason,message", [
    ({"poolRef": {"name": "demo-pool"}, "model": "demo"}, "InvalidSpec", "spec.model: expected a mapping, got str"),
    ({"poolRef": {"name": "demo-pool"}, "model": {}, "replicas": None}, None, None),  # null: unset
    ({"poolRef": {"name": "demo-pool"}, "model": {}, "engine": 1}, "InvalidSpec", "spec.engine: expected a mapping"),
    ({"poolRef": {"name": "demo-pool"}, "model": {}, "podLabels": {"a": 1}}, "InvalidSpec", "spec.podLabels.a"),
    ({"poolRef": {"name": "demo-pool"}, "model": {}, "replicas": "3"}, "InvalidSpec", "expected an integer, got str"),
    ({"poolRef": ["demo-pool"], "model": {}}, "InvalidSpec", "spec.poolRef: expected a mapping, got list"),
    (True, "InvalidSpec", "spec: expected a mapping, got bool"),
    ({"poolRef": {"name": "demo-pool"}, "model": {}, "engine": {"apiKeySecretRef": ["llm-keys", "token"]}},
     "InvalidSpec", "spec.engine.apiKeySecretRef: expected a mapping, got list"),
    ({"poolRef": {"name": "demo-pool"}, "model": {},
      "engine": {"apiKeySecretRef": {"name": "llm-keys", "key": None}}}, "InvalidSpec",
     "spec.engine.apiKeySecretRef.key: required"),
])
def test_misshapen_modelserver_is_a_condition(ms_spec, reason, message):
    kube = _reconcile_all(ms_spec, GOOD_POOL)
    ready = _condition(kube.stored("ModelServer", "demo-llm"), "Ready")
    if reason is None:
        assert kube.stored("Deployment", "demo-llm")["spec"]["replicas"] == 1
    else:
        assert (ready["status"], ready["reason"]) == ("False", reason) and message in ready["message"], ready
        assert kube.stored("Deployment", "demo-llm") is None


@pytest.mark.parametrize("pool_spec,message", [
    ({**GOOD_POOL, "targetPorts": [{"number": "8000"}]}, "spec.targetPorts[0].number: expected an integer"),
    ({**GOOD_POOL, "targetPorts": 8000}, "spec.targetPorts: expected a list, got int"),
    ({**GOOD_POOL, "targetPorts": [{"number": None}]}, "spec.targetPorts[0].number: required"),
    ({**GOOD_POOL, "targetPorts": [{"number": 70000}]}, "70000 is out of range [1, 65535]"),
    ({**GOOD_POOL, "selector": {"matchLabels": ["app"]}}, "spec.selector.matchLabels: expected a mapping"),
    ({**GOOD_POOL, "endpointPickerRef": {"name": 5, "port": {"number": 9002}}}, "endpointPickerRef.name"),
])
def test_misshapen_pool_is_a_condition_on_its_modelserver_and_its_epp(pool_spec, message):
    kube = _reconcile_all({"poolRef": {"name": "demo-pool"}, "model": {}}, pool_spec,
                          {EPP_ANNOTATION: "managed"})
    ready = _condition(kube.stored("ModelServer", "demo-llm"), "Ready")
    assert (ready["reason"], message in ready["message"]) == ("PoolInvalid", True), ready
    if isinstance(pool_spec["endpointPickerRef"]["name"], str):  # else the pool names no EPP Service to run
        accepted = _epp_accepted(kube.stored("InferencePool", "demo-pool"))
        assert (accepted["reason"], message in accepted["message"]) == ("InvalidSpec", True), accepted
    assert kube.stored("Deployment", "demo-llm") is None and kube.stored("Deployment", "demo-pool-epp") is None


def test_deeply_nested_peer_annotation_is_a_value_error():
    """Was a RecursionError out of yaml.safe_load: the pool's reconcile failed and was retried forever."""
    from kvgate.operator.network_policy import parse_peers

    with pytest.raises(ValueError, match="nested deeper than 64 levels"):
        parse_peers("[" * 5000 + "]" * 5000, METRICS_FROM_ANNOTATION)
