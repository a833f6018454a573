"""The CRDs under crds/: compatibility with upstream, the samples, ModelServer validation, CRD structure.

The API server validates a custom resource against the structural OpenAPI v3 schema of its CRD. These tests
run the same checks with the `jsonschema` library, after a translation that mirrors the server:

* defaults are applied first (as the server does, before validation);
* unknown fields are rejected (kubectl's default strict field validation);
* `x-kubernetes-int-or-string` becomes integer-or-string, `nullable` admits null;
* `x-kubernetes-list-type: set|map` reject duplicate items / keys;
* each CEL rule (`x-kubernetes-validations`) runs as its Python equivalent from CEL_RULES. Our CRDs may only
  use rules listed there (a test checks it); CEL in the Gateway API CRDs, used only for valid samples, is skipped.

Formats (date-time, int32, ...) are not checked.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from pathlib import Path

import jsonschema
import pytest
import yaml

from kvgate.epp.datastore import RewriteRule, parse_objectives, parse_rewrites
from tests.upstream import CONFORMANCE, UPSTREAM_POOL_CRD, gateway_api_crds

ROOT = Path(__file__).resolve().parents[1]
CRDS = ROOT / "crds"
SAMPLES = CRDS / "samples"

OUR_CRD_FILES = sorted(CRDS.glob("*.yaml"))
PROTECTED_GROUP_ANNOTATION = "api-approved.kubernetes.io"


def _has(obj: dict, key: str) -> bool:
    return key in obj


def _unique_port_numbers(ports: list) -> bool:
    numbers = [p["number"] for p in ports]
    return all(numbers.count(n) == 1 for n in numbers)


# CEL rule (verbatim) -> the same predicate in Python, on the defaulted value at the rule's node.
CEL_RULES: dict[str, Callable[[object], bool]] = {
    # InferencePool (ours and upstream's)
    "self.kind != 'Service' || has(self.port)":
        lambda s: s["kind"] != "Service" or _has(s, "port"),
    "self.all(p1, self.exists_one(p2, p1.number==p2.number))": _unique_port_numbers,
    # ModelServer .spec.model
    "[has(self.pvc), has(self.hostPath), has(self.image)].filter(x, x).size() <= 1":
        lambda s: sum(_has(s, k) for k in ("pvc", "hostPath", "image")) <= 1,
    "!(has(self.pvc) || has(self.hostPath) || has(self.image)) || self.path.startsWith('/')":
        lambda s: not any(_has(s, k) for k in ("pvc", "hostPath", "image")) or s["path"].startswith("/"),
    # ModelServer .spec (autoscaling bounds)
    "!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas":
        lambda s: not (_has(s, "minReplicas") and _has(s, "maxReplicas")) or s["minReplicas"] <= s["maxReplicas"],
    # ModelServer .spec.engine.lora.source
    "[has(self.pvc), has(self.image)].filter(x, x).size() == 1":
        lambda s: sum(_has(s, k) for k in ("pvc", "image")) == 1,
}


# ---------------------------------------------------------------------------------------------------------
# Loading


def load_docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@functools.cache
def load_crd(path: Path) -> dict:
    (doc,) = load_docs(path)
    return doc


def crd_version(crd: dict, name: str | None = None) -> dict:
    versions = crd["spec"]["versions"]
    if name is None:
        (version,) = [v for v in versions if v["storage"]]
        return version
    (version,) = [v for v in versions if v["name"] == name]
    return version


def open_api(crd: dict, version: str | None = None) -> dict:
    return crd_version(crd, version)["schema"]["openAPIV3Schema"]


# ---------------------------------------------------------------------------------------------------------
# Structural schema -> JSON Schema, defaulting, validation

SCHEMA_MAPS = ("properties",)
SCHEMA_LISTS = ("allOf", "anyOf", "oneOf")
SCHEMA_ONE = ("items", "not", "additionalProperties")


def to_jsonschema(node: dict, skeleton: bool = True) -> dict:
    """A Kubernetes structural schema as JSON Schema. `skeleton` is False inside allOf/anyOf/oneOf/not,
    which only add value validations, so they must not close objects to unknown fields."""
    out = {}
    for key, value in node.items():
        if key in SCHEMA_MAPS:
            out[key] = {k: to_jsonschema(v, skeleton) for k, v in value.items()}
        elif key in SCHEMA_LISTS:
            out[key] = [to_jsonschema(v, False) for v in value]
        elif key == "not":
            out[key] = to_jsonschema(value, False)
        elif key in SCHEMA_ONE and isinstance(value, dict):
            out[key] = to_jsonschema(value, skeleton)
        else:
            out[key] = value
    if out.pop("x-kubernetes-int-or-string", False):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    # Kubernetes' exclusiveMinimum/Maximum are OpenAPI 3.0's booleans on minimum/maximum; JSON Schema's are numbers.
    for bound, exclusive in (("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
        if isinstance(out.get(exclusive), bool):
            if out.pop(exclusive) and bound in out:
                out[exclusive] = out.pop(bound)
    if out.pop("nullable", False) and "type" in out:
        out["type"] = [out["type"], "null"]
    preserve = out.pop("x-kubernetes-preserve-unknown-fields", False)
    if skeleton and "properties" in out and "additionalProperties" not in out and not preserve:
        out["additionalProperties"] = False  # strict field validation: unknown fields are errors
    return out


def apply_defaults(schema: dict, value: object) -> None:
    """Fill in `default`s in place, top-down, as the API server does before validating."""
    if isinstance(value, dict):
        for name, sub in (schema.get("properties") or {}).items():
            if name not in value and "default" in sub:
                value[name] = copy.deepcopy(sub["default"])
            if name in value:
                apply_defaults(sub, value[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for item in value.values():
                apply_defaults(extra, item)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            apply_defaults(schema["items"], item)


def _cel(strict: bool):
    def check(validator, rules, instance, schema):
        for rule in rules:
            text = rule["rule"]
            if "oldSelf" in text:
                continue  # transition rules do not apply on create
            predicate = CEL_RULES.get(text)
            if predicate is None:
                if strict:
                    raise LookupError(f"CEL rule without a Python equivalent in CEL_RULES: {text!r}")
                continue
            try:
                ok = predicate(instance)
            except (KeyError, TypeError):
                ok = False  # CEL: a missing field is an evaluation error, which rejects the object
            if not ok:
                yield jsonschema.ValidationError(rule.get("message") or f"failed rule: {text}")
    return check


def _list_type(validator, list_type, instance, schema):
    if not isinstance(instance, list) or list_type not in ("set", "map"):
        return
    if list_type == "set":
        keys = [yaml.safe_dump(item, sort_keys=True) for item in instance]
    else:
        names = schema.get("x-kubernetes-list-map-keys") or []
        keys = [tuple(item.get(k) for k in names) for item in instance if isinstance(item, dict)]
    if len(keys) != len(set(keys)):
        yield jsonschema.ValidationError(f"duplicate entries in a list of type {list_type}")


@functools.cache
def _validator_class(strict_cel: bool):
    return jsonschema.validators.extend(jsonschema.Draft202012Validator, {
        "x-kubernetes-validations": _cel(strict_cel),
        "x-kubernetes-list-type": _list_type,
    })


class Schema:
    """One served version of a CRD, able to say what the API server would say about an object."""

    def __init__(self, crd: dict, version: str | None = None, strict_cel: bool = True):
        self.raw = open_api(crd, version)
        self.validator = _validator_class(strict_cel)(to_jsonschema(self.raw))

    def errors(self, obj: dict) -> list[str]:
        obj = copy.deepcopy(obj)
        apply_defaults(self.raw, obj)
        return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
                for e in self.validator.iter_errors(obj)]

    def accepts(self, obj: dict) -> bool:
        return not self.errors(obj)

    def defaulted(self, obj: dict) -> dict:
        obj = copy.deepcopy(obj)
        apply_defaults(self.raw, obj)
        return obj


@functools.cache
def our_schema(kind: str) -> Schema:
    for path in OUR_CRD_FILES:
        crd = load_crd(path)
        if crd["spec"]["names"]["kind"] == kind:
            return Schema(crd)
    raise LookupError(f"no CRD for {kind} under {CRDS}")


@functools.cache
def upstream_pool_schema() -> Schema:
    return Schema(load_crd(UPSTREAM_POOL_CRD))


@functools.cache
def schemas_by_type() -> dict[tuple[str, str], Schema]:
    """(apiVersion, kind) -> schema, for our CRDs and the vendored Gateway API CRDs."""
    out = {}
    files = [(p, True) for p in OUR_CRD_FILES] + [(p, False) for p in gateway_api_crds()]
    for path, ours in files:
        crd = load_crd(path)
        for version in crd["spec"]["versions"]:
            if version["served"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                out[key] = Schema(crd, version["name"], strict_cel=ours)
    return out


# ---------------------------------------------------------------------------------------------------------
# 1. InferencePool: the same verdicts as upstream, the same schema


def pool(spec: dict | None = None, **fields) -> dict:
    """An InferencePool manifest: a valid base spec, with `spec` replacing it or `fields` overriding it."""
    base = {
        "selector": {"matchLabels": {"app": "llm"}},
        "targetPorts": [{"number": 8000}],
        "endpointPickerRef": {"name": "llm-epp", "port": {"number": 9002}},
    }
    body = spec if spec is not None else {**base, **fields}
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": "p", "namespace": "default"}, "spec": body}


def ports(*numbers: int) -> list[dict]:
    return [{"number": n} for n in numbers]


def epp(**fields) -> dict:
    return {"name": "llm-epp", "port": {"number": 9002}, **fields}


CONDITION = {"type": "Accepted", "status": "True", "reason": "Accepted", "message": "",
             "lastTransitionTime": "2025-01-01T00:00:00Z"}
PARENT_REF = {"name": "gw", "namespace": "infra"}

POOL_CASES = [
    # (id, manifest, valid)
    ("base", pool(), True),
    ("no-epp-ref", pool(spec={"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": ports(8000)}), True),
    ("eight-ports", pool(targetPorts=ports(*range(8000, 8008))), True),
    ("port-bounds", pool(targetPorts=ports(1, 65535)), True),
    ("h2c", pool(appProtocol="kubernetes.io/h2c"), True),
    ("fail-open", pool(endpointPickerRef=epp(failureMode="FailOpen")), True),
    ("explicit-core-service", pool(endpointPickerRef=epp(group="", kind="Service")), True),
    ("non-service-without-port", pool(endpointPickerRef={"name": "x", "group": "example.com", "kind": "Picker"}),
     True),
    ("empty-label-value", pool(selector={"matchLabels": {"app": ""}}), True),
    ("prefixed-label-key", pool(selector={"matchLabels": {"example.com/role": "decode"}}), True),
    ("status", {**pool(), "status": {"parents": [{"parentRef": PARENT_REF, "conditions": [CONDITION],
                                                  "controllerName": "kvgate.dev/gateway-controller"}]}}, True),
    ("port-zero", pool(targetPorts=ports(0)), False),
    ("port-too-big", pool(targetPorts=ports(65536)), False),
    ("port-not-a-number", pool(targetPorts=[{"number": "8000"}]), False),
    ("no-ports", pool(targetPorts=[]), False),
    ("nine-ports", pool(targetPorts=ports(*range(8000, 8009))), False),
    ("duplicate-ports", pool(targetPorts=ports(8000, 8001, 8000)), False),
    ("port-without-number", pool(targetPorts=[{}]), False),
    ("missing-selector", pool(spec={"targetPorts": ports(8000)}), False),
    ("missing-target-ports", pool(spec={"selector": {"matchLabels": {"app": "llm"}}}), False),
    ("missing-spec", {k: v for k, v in pool().items() if k != "spec"}, False),
    ("empty-match-labels", pool(selector={"matchLabels": {}}), False),
    ("no-match-labels", pool(selector={}), False),
    ("match-expressions", pool(selector={"matchLabels": {"app": "llm"},
                                         "matchExpressions": [{"key": "a", "operator": "Exists"}]}), False),
    ("too-many-labels", pool(selector={"matchLabels": {f"k{i}": "v" for i in range(65)}}), False),
    ("label-value-too-long", pool(selector={"matchLabels": {"app": "x" * 64}}), False),
    ("label-value-bad-char", pool(selector={"matchLabels": {"app": "a b"}}), False),
    ("bad-app-protocol", pool(appProtocol="grpc"), False),
    ("bad-failure-mode", pool(endpointPickerRef=epp(failureMode="Ignore")), False),
    ("epp-without-name", pool(endpointPickerRef={"port": {"number": 9002}}), False),
    ("epp-service-without-port", pool(endpointPickerRef={"name": "x", "kind": "Service"}), False),
    ("epp-default-kind-without-port", pool(endpointPickerRef={"name": "x"}), False),
    ("epp-port-zero", pool(endpointPickerRef=epp(port={"number": 0})), False),
    ("epp-bad-kind", pool(endpointPickerRef=epp(kind="1Service")), False),
    ("epp-bad-group", pool(endpointPickerRef=epp(group="Example.com")), False),
    ("unknown-spec-field", pool(replicas=3), False),
    ("v1alpha2-field-name", pool(targetPortNumber=8000), False),
    ("status-parent-without-ref", {**pool(), "status": {"parents": [{"conditions": [CONDITION]}]}}, False),
    ("status-bad-condition", {**pool(), "status": {"parents": [
        {"parentRef": PARENT_REF, "conditions": [{**CONDITION, "status": "Yes"}]}]}}, False),
    ("status-duplicate-condition", {**pool(), "status": {"parents": [
        {"parentRef": PARENT_REF, "conditions": [CONDITION, CONDITION]}]}}, False),
    ("status-33-parents", {**pool(), "status": {"parents": [
        {"parentRef": {"name": f"gw{i}"}} for i in range(33)]}}, False),
]


def conformance_pools() -> Iterator[tuple[str, dict]]:
    for path in sorted(CONFORMANCE.glob("*.yaml")):
        for doc in load_docs(path):
            if doc.get("kind") == "InferencePool":
                yield f"{path.stem}/{doc['metadata']['name']}", doc


def test_upstream_conformance_pools_are_valid_for_both():
    found = list(conformance_pools())
    assert len(found) >= 5, f"expected the upstream conformance InferencePools under {CONFORMANCE}"
    for name, doc in found:
        assert our_schema("InferencePool").errors(doc) == [], name
        assert upstream_pool_schema().errors(doc) == [], name


@pytest.mark.parametrize("manifest, valid", [c[1:] for c in POOL_CASES], ids=[c[0] for c in POOL_CASES])
def test_pool_manifest_gets_the_same_verdict_as_upstream(manifest, valid):
    ours, upstream = our_schema("InferencePool").errors(manifest), upstream_pool_schema().errors(manifest)
    assert (not upstream) == valid, f"upstream verdict differs from the case's expectation: {upstream}"
    assert (not ours) == valid, f"our verdict differs from upstream's: {ours}"


def _without_descriptions(node: object) -> object:
    if isinstance(node, dict):
        return {k: _without_descriptions(v) for k, v in node.items()
                if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [_without_descriptions(x) for x in node]
    return node


def test_pool_crd_equals_upstream_modulo_descriptions():
    ours, upstream = load_crd(CRDS / "inference.networking.k8s.io_inferencepools.yaml"), load_crd(UPSTREAM_POOL_CRD)
    assert ours["metadata"]["name"] == upstream["metadata"]["name"]
    assert ours["spec"]["group"] == upstream["spec"]["group"]
    assert ours["spec"]["names"] == upstream["spec"]["names"]
    assert ours["spec"]["scope"] == upstream["spec"]["scope"]
    assert ours["metadata"]["annotations"][PROTECTED_GROUP_ANNOTATION] == \
        upstream["metadata"]["annotations"][PROTECTED_GROUP_ANNOTATION]
    assert len(ours["spec"]["versions"]) == len(upstream["spec"]["versions"]) == 1
    (mine,), (theirs,) = ours["spec"]["versions"], upstream["spec"]["versions"]
    assert {k: v for k, v in mine.items() if k != "schema"} == {k: v for k, v in theirs.items() if k != "schema"}
    assert _without_descriptions(mine["schema"]) == _without_descriptions(theirs["schema"])


# ---------------------------------------------------------------------------------------------------------
# 2. Samples


def sample_docs() -> list[tuple[str, dict]]:
    return [(f"{p.name}#{i}", d) for p in sorted(SAMPLES.glob("*.yaml")) for i, d in enumerate(load_docs(p))]


def test_every_sample_is_valid():
    docs = sample_docs()
    assert docs, f"no samples under {SAMPLES}"
    schemas = schemas_by_type()
    for name, doc in docs:
        schema = schemas.get((doc["apiVersion"], doc["kind"]))
        assert schema is not None, f"{name}: no CRD for {doc['apiVersion']} {doc['kind']}"
        assert schema.errors(doc) == [], name


def test_the_lora_sample_is_valid_for_ours_and_upstreams_crds():
    """crds/samples/lora/ (kept out of the main samples: it needs volumes a test cluster does not have)."""
    docs = load_docs(SAMPLES / "lora" / "lora.yaml")
    assert [d["kind"] for d in docs] == ["InferencePool", "ModelServer", "InferenceModelRewrite"]
    schemas = schemas_by_type()
    for doc in docs:
        schema = schemas.get((doc["apiVersion"], doc["kind"]))
        assert schema is not None and schema.errors(doc) == [], doc["kind"]
    bad = copy.deepcopy(docs[1])
    bad["spec"]["engine"]["lora"]["adapters"][0]["path"] = "/etc"
    assert schemas[(bad["apiVersion"], "ModelServer")].errors(bad)


def test_the_engine_type_samples_are_valid():
    """crds/samples/engines/ (kept out of the main samples: GPUs, a model PVC and the engines' images)."""
    docs = load_docs(SAMPLES / "engines" / "engines.yaml")
    assert [(d["kind"], (d["spec"].get("engine") or {}).get("type")) for d in docs] == [
        ("InferencePool", None), ("ModelServer", "vllm"), ("InferencePool", None), ("ModelServer", "sglang")]
    schemas = schemas_by_type()
    for doc in docs:
        schema = schemas.get((doc["apiVersion"], doc["kind"]))
        assert schema is not None and schema.errors(doc) == [], doc["metadata"]["name"]


def test_the_autoscaling_sample_is_valid():
    """crds/samples/autoscaling/ (kept out of the main samples: it replaces the pool's EPP config)."""
    from kvgate.epp.scheduling.config import parse_config

    docs = load_docs(SAMPLES / "autoscaling" / "autoscaling.yaml")
    assert [d["kind"] for d in docs] == ["ConfigMap", "InferencePool", "ModelServer"]
    schemas = schemas_by_type()
    for doc in docs[1:]:
        assert schemas[(doc["apiVersion"], doc["kind"])].errors(doc) == [], doc["kind"]
    config = parse_config(docs[0]["data"]["epp.yaml"])
    assert config.flow_control.enabled  # scale from zero: the first request waits in the EPP
    assert docs[1]["metadata"]["annotations"]["kvgate.dev/epp-config"] == docs[0]["metadata"]["name"]
    assert docs[2]["spec"]["minReplicas"] == 0


def test_samples_make_one_consistent_pool():
    by_kind: dict[str, list[dict]] = {}
    for _, doc in sample_docs():
        by_kind.setdefault(doc["kind"], []).append(doc)
        # Namespace-less: they land in the current namespace (default), and apply order does not matter.
        assert "namespace" not in doc["metadata"], doc["metadata"]["name"]
    assert "Namespace" not in by_kind
    assert set(by_kind) >= {"GatewayClass", "Gateway", "HTTPRoute", "InferencePool", "ModelServer",
                            "InferenceObjective"}

    (gc,), (gw,), (route,) = by_kind["GatewayClass"], by_kind["Gateway"], by_kind["HTTPRoute"]
    (pool_doc,), (server,) = by_kind["InferencePool"], by_kind["ModelServer"]
    assert gc["metadata"]["name"] == "kvgate"
    assert gc["spec"]["controllerName"] == "kvgate.dev/gateway-controller"
    assert gw["metadata"]["name"] == "inference-gateway" and gw["spec"]["gatewayClassName"] == "kvgate"
    assert [(l["protocol"], l["port"]) for l in gw["spec"]["listeners"]] == [("HTTP", 8080)]

    assert pool_doc["metadata"]["name"] == "demo-pool"
    assert pool_doc["spec"]["selector"]["matchLabels"] == {"app": "demo-llm"}
    assert pool_doc["spec"]["targetPorts"] == [{"number": 8000}]
    assert pool_doc["spec"]["endpointPickerRef"] == {"name": "demo-pool-epp", "port": {"number": 9002},
                                                     "failureMode": "FailClose"}

    assert [p["name"] for p in route["spec"]["parentRefs"]] == ["inference-gateway"]
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": "demo-pool"}]

    assert server["metadata"]["name"] == "demo-llm"
    assert server["spec"]["poolRef"] == {"name": "demo-pool"} and server["spec"]["replicas"] == 2
    assert server["spec"]["model"]["servedModelName"] == "demo" and server["spec"]["engine"]["backend"] == "sim"
    for kind in ("InferenceObjective", "InferenceModelRewrite"):
        for doc in by_kind.get(kind, []):
            assert doc["spec"]["poolRef"]["name"] == "demo-pool", kind


def test_samples_parse_in_the_epp():
    docs = [d for _, d in sample_docs()]
    assert parse_objectives(docs, "demo-pool") == {"interactive": 10}
    assert parse_rewrites(docs, "demo-pool") == [RewriteRule("demo-latest", [("demo", 1)])]


# ---------------------------------------------------------------------------------------------------------
# 3. ModelServer, InferenceObjective, InferenceModelRewrite validation


def model_server(**spec) -> dict:
    body = {"poolRef": {"name": "demo-pool"}, "model": {"servedModelName": "demo"}}
    body.update(spec)
    return {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelServer",
            "metadata": {"name": "m", "namespace": "default"}, "spec": body}


FULL_SPEC = dict(
    poolRef={"name": "qwen-pool"},
    replicas=3,
    model={"path": "/models/qwen3", "servedModelName": "qwen3", "pvc": {"claimName": "models", "readOnly": True}},
    engine={"backend": "torch", "blockSize": 16, "maxNumSeqs": 64, "maxNumBatchedTokens": 4096,
            "maxModelLen": 8192, "kvCacheMemory": "2Gi", "dtype": "bfloat16", "enablePrefixCaching": True,
            "device": "cuda:0"},
    image="ghcr.io/kvgate/kvgate:0.1.0",
    imagePullPolicy="IfNotPresent",
    resources={"limits": {"nvidia.com/gpu": 1, "memory": "32Gi"}, "requests": {"cpu": "500m", "memory": "16Gi"}},
    nodeSelector={"nvidia.com/gpu.present": "true"},
    tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
    podLabels={"team": "ml"},
    extraArgs=["--seed", "1"],
)

MODEL_SERVER_CASES = [
    ("minimal", model_server(), True),
    ("full", model_server(**FULL_SPEC), True),
    ("zero-replicas", model_server(replicas=0), True),
    ("no-model-fields", model_server(model={}), True),
    ("host-path", model_server(model={"path": "/models/m", "hostPath": {"path": "/data/m"}}), True),
    ("image-volume", model_server(model={"path": "/models/m", "image": {"reference": "r.io/m:1",
                                                                        "pullPolicy": "Always"}}), True),
    ("baked-in-model", model_server(model={"path": "/opt/model"}), True),
    ("kv-bytes", model_server(engine={"kvCacheMemory": 1073741824}), True),
    ("kv-fraction", model_server(engine={"kvCacheMemory": "1.5Gi"}), True),
    ("block-size-1024", model_server(engine={"blockSize": 1024}), True),
    ("device-cpu", model_server(engine={"device": "cpu"}), True),
    ("shutdown-grace-600", model_server(engine={"shutdownGracePeriodSeconds": 600}), True),
    ("api-key-secret-ref", model_server(engine={"apiKeySecretRef": {"name": "llm-keys", "key": "api-key"}}), True),
    ("api-key-secret-ref-dotted", model_server(engine={"apiKeySecretRef": {"name": "a.b", "key": ".key_1"}}), True),
    ("gpu-memory-utilization", model_server(engine={"gpuMemoryUtilization": 0.45}), True),
    ("gpu-memory-utilization-1", model_server(engine={"gpuMemoryUtilization": 1}), True),
    ("kv-cache-dtype-fp8", model_server(engine={"kvCacheDtype": "fp8"}), True),
    ("tensor-parallel-8", model_server(engine={"tensorParallelSize": 8}), True),
    ("quantization-compressed-tensors", model_server(engine={"quantization": "compressed-tensors"}), True),
    ("speculative-ngram", model_server(engine={"speculativeConfig": {"method": "ngram", "numSpeculativeTokens": 4,
                                                                     "promptLookupMin": 2, "promptLookupMax": 4}}),
     True),
    ("speculative-k-only", model_server(engine={"speculativeConfig": {"numSpeculativeTokens": 1}}), True),
    ("status", {**model_server(), "status": {"replicas": 2, "readyReplicas": 1, "selector": "app=demo-llm",
                                             "observedGeneration": 1, "conditions": [CONDITION]}}, True),
    ("negative-replicas", model_server(replicas=-1), False),
    ("replicas-string", model_server(replicas="2"), False),
    ("missing-pool-ref", {**model_server(), "spec": {"model": {}}}, False),
    ("missing-model", {**model_server(), "spec": {"poolRef": {"name": "p"}}}, False),
    ("pool-ref-without-name", model_server(poolRef={}), False),
    ("pool-ref-bad-name", model_server(poolRef={"name": "Demo_Pool"}), False),
    ("block-size-12", model_server(engine={"blockSize": 12}), False),
    ("block-size-0", model_server(engine={"blockSize": 0}), False),
    ("unknown-backend", model_server(engine={"backend": "vllm"}), False),
    ("bad-dtype", model_server(engine={"dtype": "int8"}), False),
    ("bad-device", model_server(engine={"device": "gpu"}), False),
    ("max-num-seqs-0", model_server(engine={"maxNumSeqs": 0}), False),
    ("max-batched-tokens-0", model_server(engine={"maxNumBatchedTokens": 0}), False),
    ("max-model-len-0", model_server(engine={"maxModelLen": 0}), False),
    ("kv-zero", model_server(engine={"kvCacheMemory": 0}), False),
    ("kv-decimal-unit", model_server(engine={"kvCacheMemory": "2G"}), False),
    ("kv-garbage", model_server(engine={"kvCacheMemory": "lots"}), False),
    ("prefix-caching-string", model_server(engine={"enablePrefixCaching": "yes"}), False),
    ("unknown-engine-field", model_server(engine={"pipelineParallelSize": 2}), False),
    ("gpu-memory-utilization-0", model_server(engine={"gpuMemoryUtilization": 0}), False),
    ("gpu-memory-utilization-over-1", model_server(engine={"gpuMemoryUtilization": 1.01}), False),
    ("gpu-memory-utilization-string", model_server(engine={"gpuMemoryUtilization": "0.9"}), False),
    ("kv-cache-dtype-bf16", model_server(engine={"kvCacheDtype": "bfloat16"}), False),
    ("tensor-parallel-0", model_server(engine={"tensorParallelSize": 0}), False),
    ("tensor-parallel-17", model_server(engine={"tensorParallelSize": 17}), False),
    ("tensor-parallel-string", model_server(engine={"tensorParallelSize": "2"}), False),
    ("quantization-unknown", model_server(engine={"quantization": "int3"}), False),
    ("speculative-without-k", model_server(engine={"speculativeConfig": {"promptLookupMax": 4}}), False),
    ("speculative-k-over-32", model_server(engine={"speculativeConfig": {"numSpeculativeTokens": 33}}), False),
    ("speculative-draft-model", model_server(engine={"speculativeConfig": {"method": "draft_model",
                                                                           "numSpeculativeTokens": 4}}), False),
    ("speculative-model-is-no-field", model_server(engine={"speculativeConfig": {"numSpeculativeTokens": 4,
                                                                                 "model": "/m"}}), False),
    ("two-volume-sources", model_server(model={"path": "/m", "pvc": {"claimName": "c"},
                                               "hostPath": {"path": "/m"}}), False),
    ("three-volume-sources", model_server(model={"path": "/m", "pvc": {"claimName": "c"}, "hostPath": {"path": "/m"},
                                                 "image": {"reference": "r.io/m:1"}}), False),
    ("volume-with-relative-path", model_server(model={"path": "models/m", "pvc": {"claimName": "c"}}), False),
    ("volume-with-demo-path", model_server(model={"pvc": {"claimName": "c"}}), False),
    ("pvc-without-claim", model_server(model={"path": "/m", "pvc": {}}), False),
    ("relative-host-path", model_server(model={"path": "/m", "hostPath": {"path": "data"}}), False),
    ("image-without-reference", model_server(model={"path": "/m", "image": {}}), False),
    ("bad-model-pull-policy",
     model_server(model={"path": "/m", "image": {"reference": "r", "pullPolicy": "Sometimes"}}), False),
    ("bad-image-pull-policy", model_server(imagePullPolicy="Sometimes"), False),
    ("empty-served-name", model_server(model={"servedModelName": ""}), False),
    ("bad-quantity", model_server(resources={"limits": {"memory": "lots"}}), False),
    ("unknown-resources-field", model_server(resources={"gpus": 1}), False),
    ("bad-toleration-effect", model_server(tolerations=[{"key": "k", "effect": "Evict"}]), False),
    ("pod-label-too-long", model_server(podLabels={"a": "x" * 64}), False),
    ("extra-args-not-strings", model_server(extraArgs=[1]), False),
    ("unknown-spec-field", model_server(port=8000), False),
    ("shutdown-grace-0", model_server(engine={"shutdownGracePeriodSeconds": 0}), False),
    ("shutdown-grace-over-an-hour", model_server(engine={"shutdownGracePeriodSeconds": 3601}), False),
    ("shutdown-grace-string", model_server(engine={"shutdownGracePeriodSeconds": "30s"}), False),
    ("api-key-ref-string", model_server(engine={"apiKeySecretRef": "llm-keys"}), False),
    ("api-key-ref-without-key", model_server(engine={"apiKeySecretRef": {"name": "llm-keys"}}), False),
    ("api-key-ref-bad-name", model_server(engine={"apiKeySecretRef": {"name": "LLM_Keys", "key": "k"}}), False),
    ("api-key-ref-bad-key", model_server(engine={"apiKeySecretRef": {"name": "llm-keys", "key": "a/b"}}), False),
    ("api-key-ref-dot-dot-key", model_server(engine={"apiKeySecretRef": {"name": "llm-keys", "key": "..k"}}), False),
    # A Secret of another namespace cannot even be named (and the kubelet resolves a pod's refs in its own).
    ("api-key-ref-namespace-is-no-field",
     model_server(engine={"apiKeySecretRef": {"name": "llm-keys", "key": "k", "namespace": "kube-system"}}), False),
    # No way to ask for node access or privilege: the schema has no such fields (the API server prunes them).
    ("host-network-is-no-field", model_server(hostNetwork=True), False),
    ("security-context-is-no-field", model_server(securityContext={"privileged": True}), False),
    ("volumes-is-no-field", model_server(volumes=[{"name": "root", "hostPath": {"path": "/"}}]), False),
    ("negative-status-replicas", {**model_server(), "status": {"replicas": -1}}, False),
    # spec.engine.type: the engine the pods run (what one engine lacks is the operator's condition, not the schema's)
    ("engine-type-kvgate", model_server(engine={"type": "kvgate", "backend": "sim"}), True),
    ("engine-type-vllm", model_server(engine={"type": "vllm", "tensorParallelSize": 2}, image="vllm/vllm-openai:v1"),
     True),
    ("engine-type-sglang", model_server(engine={"type": "sglang", "kvCacheDtype": "fp8"}), True),
    ("engine-type-unknown", model_server(engine={"type": "tgi"}), False),
    ("engine-type-capitalized", model_server(engine={"type": "vLLM"}), False),
    ("engine-type-not-a-string", model_server(engine={"type": 1}), False),
    # autoscaling: zero allowed for min, min <= max, bounded
    ("autoscaled-from-zero", model_server(replicas=0, minReplicas=0, maxReplicas=8,
                                          autoscaling={"provider": "operator", "targetWaitingPerReplica": 2.5,
                                                       "scaleDownStabilizationSeconds": 60}), True),
    ("autoscaled-keda", model_server(maxReplicas=4, autoscaling={"provider": "keda"}), True),
    ("min-above-max", model_server(minReplicas=5, maxReplicas=4), False),
    ("max-zero", model_server(maxReplicas=0), False),
    ("max-over-1000", model_server(maxReplicas=1001), False),
    ("unknown-provider", model_server(maxReplicas=4, autoscaling={"provider": "hpa"}), False),
    ("kv-target-above-1", model_server(maxReplicas=4, autoscaling={"targetKVUtilization": 1.5}), False),
    ("negative-window", model_server(maxReplicas=4, autoscaling={"scaleDownStabilizationSeconds": -1}), False),
    ("unknown-autoscaling-field", model_server(maxReplicas=4, autoscaling={"metric": "cpu"}), False),
]


@pytest.mark.parametrize("manifest, valid", [c[1:] for c in MODEL_SERVER_CASES],
                         ids=[c[0] for c in MODEL_SERVER_CASES])
def test_model_server_validation(manifest, valid):
    errors = our_schema("ModelServer").errors(manifest)
    assert (not errors) == valid, errors


def test_model_server_defaults():
    spec = our_schema("ModelServer").defaulted(model_server(model={"pvc": {"claimName": "c"}}))["spec"]
    assert spec["replicas"] == 1
    assert spec["model"] == {"path": "demo", "pvc": {"claimName": "c", "readOnly": True}}
    assert "engine" not in spec  # unset engine flags keep the engine's own defaults
    # no schema default for engine.type: unset is kvgate (the operator's reading), and specs written before the
    # field existed render the same Deployment
    engine = our_schema("ModelServer").defaulted(model_server(engine={"maxNumSeqs": 8}))["spec"]["engine"]
    assert "type" not in engine


def objective(**spec) -> dict:
    return {"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceObjective",
            "metadata": {"name": "o"}, "spec": spec}


def rewrite(*rules, **spec) -> dict:
    return {"apiVersion": "inference.networking.x-k8s.io/v1alpha2", "kind": "InferenceModelRewrite",
            "metadata": {"name": "r"}, "spec": {"poolRef": {"name": "p"}, "rules": list(rules), **spec}}


def match(value: str, **fields) -> dict:
    return {"model": {"value": value, **fields}}


POLICY_CASES = [
    ("objective", objective(poolRef={"name": "p"}, priority=10), True),
    ("objective-negative", objective(poolRef={"name": "p"}, priority=-5), True),
    ("objective-no-priority", objective(poolRef={"name": "p"}), True),
    ("objective-full-ref", objective(poolRef={"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                              "name": "p"}), True),
    ("objective-no-pool", objective(priority=1), False),
    ("objective-ref-without-name", objective(poolRef={}), False),
    ("objective-priority-string", objective(poolRef={"name": "p"}, priority="high"), False),
    ("objective-v1alpha1-criticality", objective(poolRef={"name": "p"}, criticality="Critical"), False),
    ("rewrite", rewrite({"matches": [match("a")], "targets": [{"modelRewrite": "b"}]}), True),
    ("rewrite-split", rewrite({"matches": [match("a", type="Exact")],
                               "targets": [{"modelRewrite": "b", "weight": 90}, {"modelRewrite": "c", "weight": 10}]}),
     True),
    ("rewrite-fallback", rewrite({"targets": [{"modelRewrite": "b"}]}), True),
    ("rewrite-no-rules", rewrite(), True),
    ("rewrite-missing-rules", {**rewrite(), "spec": {"poolRef": {"name": "p"}}}, False),
    ("rewrite-no-pool", {**rewrite(), "spec": {"rules": []}}, False),
    ("rewrite-prefix-match", rewrite({"matches": [match("a", type="Prefix")], "targets": [{"modelRewrite": "b"}]}),
     False),
    ("rewrite-empty-value", rewrite({"matches": [match("")], "targets": [{"modelRewrite": "b"}]}), False),
    ("rewrite-match-without-model", rewrite({"matches": [{}], "targets": [{"modelRewrite": "b"}]}), False),
    ("rewrite-model-as-string", rewrite({"matches": [{"model": "a"}], "targets": [{"modelRewrite": "b"}]}), False),
    ("rewrite-no-targets", rewrite({"matches": [match("a")], "targets": []}), False),
    ("rewrite-target-model-field", rewrite({"matches": [match("a")], "targets": [{"model": "b"}]}), False),
    ("rewrite-weight-zero", rewrite({"matches": [match("a")], "targets": [{"modelRewrite": "b", "weight": 0}]}),
     False),
    ("rewrite-weight-too-big", rewrite({"matches": [match("a")],
                                        "targets": [{"modelRewrite": "b", "weight": 1000001}]}), False),
]


@pytest.mark.parametrize("manifest, valid", [c[1:] for c in POLICY_CASES], ids=[c[0] for c in POLICY_CASES])
def test_objective_and_rewrite_validation(manifest, valid):
    errors = our_schema(manifest["kind"]).errors(manifest)
    assert (not errors) == valid, errors


# ---------------------------------------------------------------------------------------------------------
# 4. Every CRD is sound


def schema_nodes(node: dict, path: str = "") -> Iterator[tuple[str, dict]]:
    """(path, node) for every node of the structural skeleton (not inside allOf/anyOf/oneOf/not)."""
    yield path, node
    for name, sub in (node.get("properties") or {}).items():
        yield from schema_nodes(sub, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from schema_nodes(node["additionalProperties"], f"{path}.*")
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], f"{path}[]")


def resolve(schema: dict, json_path: str) -> dict | None:
    node = schema
    for part in json_path.lstrip(".").split("."):
        node = (node.get("properties") or {}).get(part)
        if node is None:
            return None
    return node


@pytest.fixture(params=OUR_CRD_FILES, ids=[p.name for p in OUR_CRD_FILES])
def crd_file(request) -> Path:
    return request.param


def test_crd_identity(crd_file):
    crd = load_crd(crd_file)
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1" and crd["kind"] == "CustomResourceDefinition"
    spec, names = crd["spec"], crd["spec"]["names"]
    assert crd["metadata"]["name"] == f"{names['plural']}.{spec['group']}"
    assert crd_file.name == f"{spec['group']}_{names['plural']}.yaml"
    assert names["singular"] == names["kind"].lower() and names["plural"] == names["singular"] + "s"
    assert names["listKind"] == names["kind"] + "List"
    assert spec["scope"] == "Namespaced"
    if spec["group"] == "k8s.io" or spec["group"].endswith(".k8s.io"):
        assert crd["metadata"]["annotations"][PROTECTED_GROUP_ANNOTATION], "protected groups need API approval"


def test_crd_versions_and_subresources(crd_file):
    versions = load_crd(crd_file)["spec"]["versions"]
    assert sum(v["storage"] for v in versions) == 1, "exactly one storage version"
    assert all(v["served"] for v in versions)
    for version in versions:
        assert version["subresources"]["status"] == {}
        schema = version["schema"]["openAPIV3Schema"]
        for column in version.get("additionalPrinterColumns") or []:
            if not column["jsonPath"].startswith(".metadata."):
                assert resolve(schema, column["jsonPath"]), f"printer column {column['name']}: no such field"
        scale = version["subresources"].get("scale")
        if scale:
            assert resolve(schema, scale["specReplicasPath"])["type"] == "integer"
            assert resolve(schema, scale["statusReplicasPath"])["type"] == "integer"
            assert resolve(schema, scale["labelSelectorPath"])["type"] == "string"


def test_model_server_api_surface():
    version = crd_version(load_crd(CRDS / "kvgate.dev_modelservers.yaml"))
    assert version["name"] == "v1alpha1"
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    columns = [(c["name"], c["jsonPath"]) for c in version["additionalPrinterColumns"]]
    assert columns == [("Pool", ".spec.poolRef.name"), ("Model", ".spec.model.servedModelName"),
                       ("Replicas", ".spec.replicas"), ("Ready", ".status.readyReplicas"),
                       ("Age", ".metadata.creationTimestamp")]


def test_crd_schemas_are_structural(crd_file):
    for version in load_crd(crd_file)["spec"]["versions"]:
        root = version["schema"]["openAPIV3Schema"]
        assert root["type"] == "object" and root["properties"]["metadata"] == {"type": "object"}
        for path, node in schema_nodes(root):
            where = f"{crd_file.name} {version['name']} {path or '<root>'}"
            int_or_string = node.get("x-kubernetes-int-or-string")
            assert node.get("type") or int_or_string or node.get("x-kubernetes-preserve-unknown-fields"), \
                f"{where}: no type"
            assert not (int_or_string and "type" in node), f"{where}: int-or-string takes no type"
            assert "$ref" not in node and not node.get("uniqueItems"), f"{where}: not allowed in a CRD"
            assert not ("properties" in node and "additionalProperties" in node), f"{where}: both kinds of fields"
            if "properties" in node:
                assert node["type"] == "object", where
            if "items" in node:
                assert node["type"] == "array", where
            if node.get("x-kubernetes-list-type") == "map":
                item = node["items"]
                for key in node["x-kubernetes-list-map-keys"]:
                    assert key in item.get("required", []) or "default" in item["properties"][key], \
                        f"{where}: list-map key {key} must be required or defaulted"
            if "default" in node:  # a default must pass its own schema (the server checks it)
                assert _validator_class(True)(to_jsonschema(node)).is_valid(node["default"]), \
                    f"{where}: default does not validate"


def test_crd_fields_are_described(crd_file):
    for version in load_crd(crd_file)["spec"]["versions"]:
        for path, node in schema_nodes(version["schema"]["openAPIV3Schema"]):
            if path != ".metadata":
                assert (node.get("description") or "").strip(), f"{crd_file.name} {path or '<root>'}: no description"


def test_crd_cel_rules_are_known(crd_file):
    for version in load_crd(crd_file)["spec"]["versions"]:
        for path, node in schema_nodes(version["schema"]["openAPIV3Schema"]):
            for rule in node.get("x-kubernetes-validations") or []:
                assert rule["rule"] in CEL_RULES, f"{crd_file.name} {path}: add a Python equivalent of {rule['rule']!r}"
                assert rule.get("message"), f"{crd_file.name} {path}: CEL rule without a message"
