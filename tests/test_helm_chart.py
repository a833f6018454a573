"""The Helm chart charts/kvgate: lint, rendered kinds per values, object validity, least-privilege RBAC, CRDs.

Rendered and linted offline with the real Helm SDK (the `helm-python-sdk` package: Helm's Go library behind a
C ABI, no helm binary). Custom resources are validated against our CRDs, Gateway API objects against the
vendored CRDs under third_party/gateway-api (as tests/test_crds.py does), core/apps/rbac objects
structurally, and the operator's arguments with the real `kvgate` CLI parser.
"""

from __future__ import annotations

import functools
from collections import Counter
from pathlib import Path

import pytest
import yaml

from kvgate.cli import build_parser
from tests.test_crds import CRDS, our_schema, schemas_by_type

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed (pip install helm-python-sdk)")

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvgate"
RELEASE, NAMESPACE = "kvgate", "kvgate-system"

OUR_KINDS = {"InferencePool", "ModelServer", "InferenceObjective", "InferenceModelRewrite"}
GATEWAY_KINDS = {"GatewayClass", "Gateway", "HTTPRoute"}

# --- rendering ---------------------------------------------------------------------------------------------


@functools.cache
def _chart():
    return helm.Chart.load(CHART)


def render(values: dict | None = None) -> list[dict]:
    """The chart's objects for `values` (NOTES.txt left out), in template order."""
    manifests = _chart().render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects += [d for d in yaml.safe_load_all(text) if d]
    return objects


def kinds(objects: list[dict]) -> Counter:
    return Counter(o["kind"] for o in objects)


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    (obj,) = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)
              and not _leader_election(o)]
    return obj


def _leader_election(obj: dict) -> bool:
    """The operator's leader-election Role and RoleBinding (on its Leases only; tested on their own)."""
    return obj["kind"] in ("Role", "RoleBinding") and obj["metadata"]["name"].endswith("-leader-election")


# The default: the release namespace only (a Role there, a small ClusterRole for what is cluster-scoped).
# Two operator replicas electing a leader: a Role and RoleBinding on their Lease, a PodDisruptionBudget.
OPERATOR_HA = Counter({"Role": 1, "RoleBinding": 1, "PodDisruptionBudget": 1})
# The operator's xDS Service and its NetworkPolicy (operator.envoyConfigSource xds, the default): one per operator.
XDS = Counter({"Service": 1, "NetworkPolicy": 1})
BASE = Counter({"ServiceAccount": 1, "ClusterRole": 1, "ClusterRoleBinding": 1, "Role": 1, "RoleBinding": 1,
                "Deployment": 1}) + OPERATOR_HA + XDS
SAMPLE = Counter({"InferencePool": 1, "ModelServer": 1, "Gateway": 1, "HTTPRoute": 1})
VARIANTS = {
    "default": ({}, BASE + Counter({"GatewayClass": 1})),
    "all-namespaces": ({"allNamespaces": True},
                       Counter({"ServiceAccount": 1, "ClusterRole": 1, "ClusterRoleBinding": 1, "Deployment": 1,
                                "GatewayClass": 1}) + OPERATOR_HA + XDS),
    "tenant-allowances": ({"operator": {"allowHostPath": True,
                                        "allowedImagePrefixes": ["registry.example/kvgate", "mirror.example/ml/"]}},
                          BASE + Counter({"GatewayClass": 1})),
    "namespaced": ({"watchNamespaces": ["team-a", "team-b"]},
                   Counter({"ServiceAccount": 1, "ClusterRole": 1, "ClusterRoleBinding": 1, "Role": 2,
                            "RoleBinding": 2, "Deployment": 2, "GatewayClass": 1, "PodDisruptionBudget": 1})
                   + OPERATOR_HA + XDS + XDS),
    "sample-pool": ({"samplePool": {"enabled": True}}, BASE + Counter({"GatewayClass": 1}) + SAMPLE),
    "no-gatewayclass": ({"gatewayClass": {"create": False}}, BASE),
    "custom-images": ({"image": {"repository": "registry.example/kvgate", "tag": "1.2.3", "pullPolicy": "Always"},
                       "envoyImage": {"repository": "registry.example/envoy", "tag": "v9"},
                       "operator": {"eppImage": "registry.example/epp:7", "vllmImage": "vllm/vllm-openai:v0.32.0",
                                    "sglangImage": "lmsysorg/sglang:v0.5.0"}},
                      BASE + Counter({"GatewayClass": 1})),
    "tcp-probes-extra-args": ({"probes": {"type": "tcp"}, "logLevel": "debug",
                               "operator": {"extraArgs": ["--epp-address-mode", "pod-ip"],
                                            "envoyServiceType": "NodePort"},
                               "nodeSelector": {"kubernetes.io/os": "linux"},
                               "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}],
                               "podAnnotations": {"example.com/a": "b"}},
                              BASE + Counter({"GatewayClass": 1})),
    "metrics-from": ({"networkPolicy": {"metricsFrom": [
                         {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                          "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}]}},
                     BASE + Counter({"GatewayClass": 1})),
    "epp-high-availability": ({"eppHighAvailability": {"enabled": True}}, BASE + Counter({"GatewayClass": 1})),
    "files": ({"operator": {"envoyConfigSource": "files"}}, BASE - XDS + Counter({"GatewayClass": 1})),
    "no-network-policy": ({"networkPolicy": {"enabled": False}, "watchNamespaces": ["team-a"]},
                          Counter({"ServiceAccount": 1, "ClusterRole": 1, "ClusterRoleBinding": 1, "Role": 1,
                                   "RoleBinding": 1, "Deployment": 1, "GatewayClass": 1, "Service": 1}) + OPERATOR_HA),
    "single-operator": ({"operator": {"replicas": 1, "leaderElection": {"enabled": False}}},
                        BASE - OPERATOR_HA + Counter({"GatewayClass": 1})),
}


@pytest.fixture(params=sorted(VARIANTS), ids=sorted(VARIANTS))
def variant(request) -> tuple[str, dict, list[dict]]:
    values, _ = VARIANTS[request.param]
    return request.param, values, render(values)


# --- lint and kinds ----------------------------------------------------------------------------------------


def test_chart_metadata():
    meta = _chart().metadata
    assert (meta["apiVersion"], meta["name"], meta["version"], meta["appVersion"]) == ("v2", "kvgate", "0.1.0", "0.1.0")


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_lint_passes(name):
    values, _ = VARIANTS[name]
    report = helm.lint(CHART, values or None, namespace=NAMESPACE, kube_version="v1.20.0")
    assert report["errors"] == [], report
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors; info is fine
    assert problems == [], report


def test_rendered_kinds(variant):
    name, _, objects = variant
    assert kinds(objects) == VARIANTS[name][1]


def test_bad_probe_type_fails_render():
    with pytest.raises(helm.HelmRenderError, match="probes.type"):
        render({"probes": {"type": "grpc"}})


def test_sample_pool_outside_the_watched_namespaces_fails_render():
    """Namespaced mode: a sample pool in an unwatched release namespace would never be reconciled."""
    with pytest.raises(helm.HelmRenderError, match="watchNamespaces"):
        render({"samplePool": {"enabled": True}, "watchNamespaces": ["team-a"]})
    objects = render({"samplePool": {"enabled": True}, "watchNamespaces": ["team-a", NAMESPACE]})
    assert kinds(objects)["InferencePool"] == 1 and kinds(objects)["Deployment"] == 2


# --- validity of every object ------------------------------------------------------------------------------


def test_every_object_is_valid(variant):
    name, _, objects = variant
    for obj in objects:
        what = f"{name}: {obj.get('kind')} {obj.get('metadata', {}).get('name')}"
        assert obj.get("apiVersion") and obj.get("kind") and obj.get("metadata", {}).get("name"), what
        if obj["kind"] in OUR_KINDS:
            assert our_schema(obj["kind"]).errors(obj) == [], what
        elif obj["kind"] in GATEWAY_KINDS:
            schema = schemas_by_type().get((obj["apiVersion"], obj["kind"]))
            assert schema is not None, f"{what}: no Gateway API CRD serves {obj['apiVersion']}"
            assert schema.errors(obj) == [], what
        elif obj["kind"] == "PodDisruptionBudget":
            assert obj["apiVersion"] in ("policy/v1", "policy/v1beta1"), what
            (deployment,) = [d for d in objects if d["kind"] == "Deployment"
                             and d["spec"]["selector"] == obj["spec"]["selector"]]
            assert deployment["spec"]["replicas"] > obj["spec"]["minAvailable"], what
        else:
            assert obj["apiVersion"] in ("v1", "apps/v1", "rbac.authorization.k8s.io/v1", "networking.k8s.io/v1"), what
            if obj["kind"] == "Deployment":
                pod = obj["spec"]["template"]
                assert obj["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items(), what
                for c in pod["spec"]["containers"]:
                    assert c.get("image") and c.get("args"), what


def _operators(objects: list[dict]) -> list[dict]:
    """The pod specs of the operator Deployments."""
    return [o["spec"]["template"]["spec"] for o in objects if o["kind"] == "Deployment"]


def _operator_args(pod_spec: dict):
    (container,) = pod_spec["containers"]
    assert container["command"] == ["kvgate"]
    return build_parser().parse_args(container["args"])


def test_operator_args_parse_with_the_kvgate_cli(variant):
    name, values, objects = variant
    for pod in _operators(objects):
        args = _operator_args(pod)
        assert args.command == "operator"
        assert args.liveness_port == 8080
        assert args.log_level == values.get("logLevel", "info")


def test_default_operator_args():
    (pod,) = _operators(render())
    args = _operator_args(pod)
    image = "ghcr.io/kvgate/kvgate:0.1.0"
    assert pod["containers"][0]["image"] == image
    assert (args.namespace, args.engine_image, args.epp_image, args.envoy_image) == (
        NAMESPACE, image, image, "envoyproxy/envoy:v1.36-latest")  # the release namespace only
    assert (args.allow_host_path, args.allow_image_prefix) == (False, [])  # tenants get no node or foreign image
    assert (args.envoy_service_type, args.epp_address_mode, args.resync_seconds) == ("ClusterIP", "service", 15.0)
    assert (args.vllm_image, args.sglang_image) == (None, None)  # vllm / sglang ModelServers name their image
    # on, and only the operator's own pods (its autoscaler) may read the EPPs' metrics
    assert (args.epp_network_policy, args.epp_metrics_from) == ("enabled", (OPERATOR_PEER,))
    assert (args.autoscale_interval_seconds, args.keda_prometheus_address) == (15.0, None)
    assert args.envoy_config_source == "xds"  # the Envoys' config over xDS from the operator's Service


def test_xds_values_reach_the_operator():
    """xDS: the operator serves it on the port its Service targets, names that Service to its Envoys, and only the
    Gateways' Envoy pods of the served namespace may connect (the liveness port stays open to probes)."""
    assert _operator_args(_operators(render({"operator": {"envoyConfigSource": "files"}}))[0]).envoy_config_source \
        == "files"
    objects = render({"xds": {"port": 18500, "maxStreams": 50}})
    (pod,) = _operators(objects)
    args = _operator_args(pod)
    assert (args.envoy_config_source, args.xds_port, args.xds_max_streams) == ("xds", 18500, 50)
    service = one(objects, "Service")
    assert (args.xds_address.host, args.xds_address.port) == (
        f"{service['metadata']['name']}.{NAMESPACE}.svc.cluster.local", 18500)
    assert {"name": "xds", "containerPort": 18500, "protocol": "TCP"} in pod["containers"][0]["ports"]
    assert service["spec"]["ports"][0]["targetPort"] == "xds"
    policy = one(objects, "NetworkPolicy")
    assert policy["spec"]["podSelector"]["matchLabels"] == service["spec"]["selector"]
    envoys, probes = policy["spec"]["ingress"]
    assert envoys == {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/component": "gateway",
                                                                "app.kubernetes.io/managed-by": "kvgate-operator"}},
                                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}}}],
                      "ports": [{"port": 18500, "protocol": "TCP"}]}
    assert probes == {"ports": [{"port": 8080, "protocol": "TCP"}]}
    # the operator's own metrics port admits the scrapers networkPolicy.metricsFrom names, and nobody by default
    prometheus = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    policy = one(render({"networkPolicy": {"metricsFrom": prometheus}}), "NetworkPolicy")
    assert policy["spec"]["ingress"][2] == {"from": prometheus, "ports": [{"port": 9090, "protocol": "TCP"}]}


def test_tenant_allowances_reach_the_operator():
    (pod,) = _operators(render(VARIANTS["tenant-allowances"][0]))
    args = _operator_args(pod)
    assert args.allow_host_path is True
    assert args.allow_image_prefix == ["registry.example/kvgate", "mirror.example/ml/"]


def test_all_namespaces_and_watch_namespaces_exclude_each_other():
    with pytest.raises(helm.HelmRenderError, match="allNamespaces and watchNamespaces"):
        render({"allNamespaces": True, "watchNamespaces": ["team-a"]})
    (pod,) = _operators(render({"allNamespaces": True}))
    assert _operator_args(pod).namespace is None


def test_tracing_values_reach_the_operator():
    (pod,) = _operators(render())
    assert _operator_args(pod).otlp_traces_endpoint is None  # off by default
    (pod,) = _operators(render({"tracing": {"otlpEndpoint": "http://otel-collector.monitoring:4317",
                                            "samplingRatio": 0.05}}))
    args = _operator_args(pod)
    assert (args.otlp_traces_endpoint, args.trace_sampling_ratio) == ("http://otel-collector.monitoring:4317", 0.05)


def test_network_policy_values_reach_the_operator():
    values = VARIANTS["metrics-from"][0]
    (pod,) = _operators(render(values))
    args = _operator_args(pod)  # the real CLI parser validates the peers
    assert args.epp_network_policy == "enabled"
    assert list(args.epp_metrics_from) == values["networkPolicy"]["metricsFrom"] + [OPERATOR_PEER]
    (pod,) = _operators(render({"autoscaling": {"enabled": False}}))
    assert _operator_args(pod).epp_metrics_from == ()
    (pod,) = _operators(render(VARIANTS["no-network-policy"][0]))
    assert _operator_args(pod).epp_network_policy == "disabled"


def test_custom_images():
    (pod,) = _operators(render(VARIANTS["custom-images"][0]))
    args = _operator_args(pod)
    assert pod["containers"][0]["image"] == "registry.example/kvgate:1.2.3"
    assert pod["containers"][0]["imagePullPolicy"] == "Always"
    assert (args.engine_image, args.epp_image, args.envoy_image) == (
        "registry.example/kvgate:1.2.3", "registry.example/epp:7", "registry.example/envoy:v9")
    assert (args.vllm_image, args.sglang_image) == ("vllm/vllm-openai:v0.32.0", "lmsysorg/sglang:v0.5.0")


def test_extra_args_and_scheduling():
    values = VARIANTS["tcp-probes-extra-args"][0]
    (pod,) = _operators(render(values))
    args = _operator_args(pod)
    assert (args.epp_address_mode, args.envoy_service_type, args.log_level) == ("pod-ip", "NodePort", "debug")
    assert pod["nodeSelector"] == values["nodeSelector"]
    assert pod["tolerations"] == values["tolerations"]
    deployment = one(render(values), "Deployment")
    assert deployment["spec"]["template"]["metadata"]["annotations"] == values["podAnnotations"]


def test_namespaced_mode_runs_one_operator_per_namespace():
    objects = render(VARIANTS["namespaced"][0])
    watched = sorted(_operator_args(pod).namespace for pod in _operators(objects))
    assert watched == ["team-a", "team-b"]
    selectors = [yaml.safe_dump(d["spec"]["selector"]) for d in objects if d["kind"] == "Deployment"]
    assert len(set(selectors)) == 2, "the two operator Deployments must not select each other's pods"
    assert {o["metadata"]["namespace"] for o in objects
            if o["kind"] in ("Role", "RoleBinding") and not _leader_election(o)} == {"team-a", "team-b"}


def test_operator_pod_hardening_and_probes():
    for probes, handler in (("http", {"httpGet": {"path": "/healthz", "port": "healthz"}}),
                            ("tcp", {"tcpSocket": {"port": "healthz"}})):
        objects = render({"probes": {"type": probes}})
        deployment = one(objects, "Deployment")
        assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
        pod = deployment["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == one(objects, "ServiceAccount")["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        (c,) = pod["containers"]
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert c["resources"]["requests"] and c["resources"]["limits"]
        port = {p["name"]: p["containerPort"] for p in c["ports"]}["healthz"]
        assert port == _operator_args(pod).liveness_port  # kopf serves http://0.0.0.0:PORT/healthz
        for probe in (c["livenessProbe"], c["readinessProbe"]):
            assert "grpc" not in probe  # Kubernetes 1.20 (the e2e rig) has no gRPC probes
            assert {k: v for k, v in probe.items() if k in ("httpGet", "tcpSocket")} == handler


# --- RBAC --------------------------------------------------------------------------------------------------

READ = {"get", "list", "watch"}
APPLY = {"get", "create", "patch"}  # server-side apply: get first, PATCH authorized as create for new objects
NAMESPACED_RULES = {
    ("", "pods"): READ,
    ("", "services"): READ | APPLY,
    ("", "configmaps"): READ | APPLY,  # list/watch: the label-selected watch of pools' EndpointPickerConfigs
    ("", "serviceaccounts"): APPLY,
    ("", "events"): {"create"},
    ("apps", "deployments"): READ | APPLY | {"delete"},
    ("rbac.authorization.k8s.io", "roles"): APPLY,
    ("rbac.authorization.k8s.io", "rolebindings"): APPLY,
    ("networking.k8s.io", "networkpolicies"): READ | APPLY | {"delete"},  # the EPPs' (networkPolicy.enabled)
    ("kvgate.dev", "modelservers"): READ,
    ("kvgate.dev", "modelservers/status"): {"patch"},
    ("inference.networking.k8s.io", "inferencepools"): READ,
    ("inference.networking.k8s.io", "inferencepools/status"): {"patch"},
    ("inference.networking.x-k8s.io", "inferenceobjectives"): READ,
    ("inference.networking.x-k8s.io", "inferencemodelrewrites"): READ,
    ("gateway.networking.k8s.io", "gateways"): {"list", "watch"},
    ("gateway.networking.k8s.io", "httproutes"): {"list", "watch"},
    ("gateway.networking.k8s.io", "referencegrants"): {"list", "watch"},
    ("gateway.networking.k8s.io", "gateways/status"): {"patch"},
    ("gateway.networking.k8s.io", "httproutes/status"): {"patch"},
}
CLUSTER_RULES = {
    ("gateway.networking.k8s.io", "gatewayclasses"): {"list", "watch"},
    ("gateway.networking.k8s.io", "gatewayclasses/status"): {"patch"},
    ("", "namespaces"): {"list", "watch"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
}


def grants(role: dict) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs of a Role/ClusterRole; no wildcards, names or non-resource URLs."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule
        for field in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule[field], f"wildcard in {rule}"
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def _subject_ok(binding: dict, objects: list[dict], role_kind: str, role_name: str) -> None:
    sa = one(objects, "ServiceAccount")["metadata"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role_name}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["name"], "namespace": NAMESPACE}]
    assert sa["namespace"] == NAMESPACE


def test_default_rbac_is_namespaced():
    """By default the operator may write only in its release namespace; cluster-wide it holds reads, and the
    status of GatewayClasses (cluster-scoped: there is no namespaced way to hold it)."""
    objects = render()
    cluster_role = one(objects, "ClusterRole")
    assert grants(cluster_role) == CLUSTER_RULES
    writes = {k: v - READ for k, v in grants(cluster_role).items() if v - READ}
    assert writes == {("gateway.networking.k8s.io", "gatewayclasses/status"): {"patch"}}
    _subject_ok(one(objects, "ClusterRoleBinding"), objects, "ClusterRole", cluster_role["metadata"]["name"])
    role, binding = one(objects, "Role"), one(objects, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == NAMESPACE
    assert grants(role) == NAMESPACED_RULES
    _subject_ok(binding, objects, "Role", role["metadata"]["name"])


def test_cluster_rbac_is_exactly_what_the_operator_uses():
    objects = render({"allNamespaces": True})
    role = one(objects, "ClusterRole")
    assert grants(role) == {**NAMESPACED_RULES, **CLUSTER_RULES}
    _subject_ok(one(objects, "ClusterRoleBinding"), objects, "ClusterRole", role["metadata"]["name"])


def test_namespaced_rbac_is_exactly_what_the_operator_uses():
    objects = render(VARIANTS["namespaced"][0])
    cluster_role = one(objects, "ClusterRole")
    assert grants(cluster_role) == CLUSTER_RULES
    _subject_ok(one(objects, "ClusterRoleBinding"), objects, "ClusterRole", cluster_role["metadata"]["name"])
    for ns in ("team-a", "team-b"):
        (role,) = [o for o in objects if o["kind"] == "Role" and o["metadata"]["namespace"] == ns]
        (binding,) = [o for o in objects if o["kind"] == "RoleBinding" and o["metadata"]["namespace"] == ns]
        assert grants(role) == NAMESPACED_RULES
        _subject_ok(binding, objects, "Role", role["metadata"]["name"])


def test_no_network_policy_rbac_when_policies_are_off():
    for values in ({"networkPolicy": {"enabled": False}}, VARIANTS["no-network-policy"][0]):
        objects = render(values)
        held = {}
        for role in (o for o in objects if o["kind"] in ("Role", "ClusterRole") and not _leader_election(o)):
            held.update(grants(role))
        without = {k: v for k, v in NAMESPACED_RULES.items() if k != ("networking.k8s.io", "networkpolicies")}
        assert held == {**without, **CLUSTER_RULES}


HA_RULES = {("coordination.k8s.io", "leases"): {"get", "create", "update"},
            ("policy", "poddisruptionbudgets"): {"get", "create", "patch", "delete"},
            ("", "secrets"): {"create"}}  # active-active pools' peer-sync keys: created, never read


def test_lease_and_budget_rbac_only_with_epp_high_availability():
    objects = render(VARIANTS["epp-high-availability"][0])
    held = {}
    for role in (o for o in objects if o["kind"] in ("Role", "ClusterRole") and not _leader_election(o)):
        held.update(grants(role))
    assert held == {**NAMESPACED_RULES, **HA_RULES, **CLUSTER_RULES}
    (pod,) = _operators(objects)
    assert _operator_args(pod).epp_high_availability == "enabled"
    (pod,) = _operators(render({}))
    assert _operator_args(pod).epp_high_availability == "disabled"


def test_operator_holds_what_the_ha_epp_role_grants():
    """With HA on, the EPP Role of a pool with replicas also grants its Lease: the operator must hold that."""
    from kvgate.operator.pool import _role

    pool = {"metadata": {"name": "p", "namespace": "ns", "uid": "u"}}
    for rule in _role(pool, replicas=2)["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert set(rule["verbs"]) <= {**NAMESPACED_RULES, **HA_RULES}.get((group, resource), set()), rule


def test_operator_holds_what_the_epp_role_grants():
    """RBAC escalation prevention: the operator may only create the EPP Role if it holds its permissions."""
    from kvgate.operator.pool import EPP_RBAC_RULES

    held = NAMESPACED_RULES
    for rule in EPP_RBAC_RULES:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                assert set(rule["verbs"]) <= held.get((group, resource), set()), (group, resource)


# The operator's pods, as a NetworkPolicy peer of the EPPs' metrics port (autoscaling.enabled).
OPERATOR_PEER = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": NAMESPACE}},
                 "podSelector": {"matchLabels": {"app.kubernetes.io/component": "operator",
                                                 "app.kubernetes.io/instance": "kvgate",
                                                 "app.kubernetes.io/name": "kvgate"}}}
KEDA_RULES = {("keda.sh", "scaledobjects"): {"get", "list", "create", "patch", "delete"}}


def test_keda_values_reach_the_operator_with_their_rbac():
    objects = render({"autoscaling": {"keda": {"enabled": True, "prometheusAddress": "http://prometheus:9090"}}})
    held = {}
    for role in (o for o in objects if o["kind"] in ("Role", "ClusterRole") and not _leader_election(o)):
        held.update(grants(role))
    assert held == {**NAMESPACED_RULES, **KEDA_RULES, **CLUSTER_RULES}
    (pod,) = _operators(objects)
    assert _operator_args(pod).keda_prometheus_address == "http://prometheus:9090"
    with pytest.raises(Exception, match="prometheusAddress is required"):
        render({"autoscaling": {"keda": {"enabled": True}}})


def test_operator_holds_every_kind_it_applies():
    """Every kind of the operator's API table (operator/apply.py KINDS) is covered by the rules (PodDisruptionBudgets
    by eppHighAvailability's)."""
    from kvgate.operator.apply import KINDS

    rules = {**NAMESPACED_RULES, **CLUSTER_RULES, **HA_RULES, **KEDA_RULES}
    for kind in KINDS.values():
        group = kind.api_version.rpartition("/")[0]
        assert (group, kind.plural) in rules, kind


def test_rbac_disabled_renders_no_rbac():
    objects = render({"rbac": {"create": False}, "serviceAccount": {"create": False, "name": "existing"}})
    assert kinds(objects) == Counter({"Deployment": 1, "GatewayClass": 1, "PodDisruptionBudget": 1}) + XDS
    assert one(objects, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "existing"


# --- GatewayClass and sample pool --------------------------------------------------------------------------


def test_gatewayclass():
    gc = one(render(), "GatewayClass")
    assert gc["metadata"]["name"] == "kvgate"
    assert gc["spec"]["controllerName"] == "kvgate.dev/gateway-controller"
    assert "namespace" not in gc["metadata"]


def test_sample_pool_matches_the_samples():
    objects = render({"samplePool": {"enabled": True}})
    samples = {d["kind"]: d for p in sorted((CRDS / "samples").glob("*.yaml"))
               for d in yaml.safe_load_all(p.read_text()) if d}
    for kind in ("InferencePool", "ModelServer", "Gateway", "HTTPRoute"):
        obj = one(objects, kind)
        assert obj["metadata"]["namespace"] == NAMESPACE
        assert obj["metadata"]["name"] == samples[kind]["metadata"]["name"]
        assert obj["spec"] == samples[kind]["spec"], kind


# --- CRDs --------------------------------------------------------------------------------------------------


def test_chart_crds_are_byte_identical_to_crds_folder():
    ours = {p.name: p.read_bytes() for p in CRDS.glob("*.yaml")}
    chart = {p.name: p.read_bytes() for p in (CHART / "crds").iterdir()}
    assert sorted(chart) == sorted(ours), "charts/kvgate/crds/ must hold exactly crds/*.yaml"
    for name, data in ours.items():
        assert chart[name] == data, f"charts/kvgate/crds/{name} differs from crds/{name}: copy it again"


def test_helm_loads_the_crds():
    loaded = {Path(c["filename"]).name for c in _chart().crds}
    assert loaded == {p.name for p in CRDS.glob("*.yaml")}


# --- operator high availability ------------------------------------------------------------------------------


def _pdb_and_deployments(objects):
    return [o for o in objects if o["kind"] == "PodDisruptionBudget"], [o for o in objects if o["kind"] == "Deployment"]


def test_operator_replicas_elect_a_leader_roll_and_spread():
    for values in ({}, VARIANTS["namespaced"][0]):
        objects = render(values)
        budgets, deployments = _pdb_and_deployments(objects)
        assert len(budgets) == len(deployments)
        leases = set()
        for deployment in deployments:
            spec = deployment["spec"]
            assert spec["replicas"] == 2
            assert spec["strategy"] == {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
            pod = spec["template"]["spec"]
            args = _operator_args(pod)
            assert args.leader_election == "enabled"
            assert (args.leader_election_lease_duration, args.leader_election_renew_deadline,
                    args.leader_election_retry_period) == (15.0, 10.0, 2.0)
            assert args.leader_election_lease_name == deployment["metadata"]["name"]
            leases.add(args.leader_election_lease_name)
            env = {e["name"]: e for e in pod["containers"][0]["env"]}
            assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
            (term,) = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
            assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
            assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
            (budget,) = [b for b in budgets if b["spec"]["selector"] == spec["selector"]]
            assert budget["spec"]["minAvailable"] == 1 and budget["metadata"]["namespace"] == NAMESPACE
            ports = {p["name"]: p["containerPort"] for p in pod["containers"][0]["ports"]}
            assert ports["metrics"] == args.metrics_port == 9090
        assert len(leases) == len(deployments)  # one election per operator Deployment
        role = [o for o in objects if o["kind"] == "Role" and _leader_election(o)]
        binding = [o for o in objects if o["kind"] == "RoleBinding" and _leader_election(o)]
        assert len(role) == len(binding) == 1
        # least privilege: Leases only, in the release namespace only; reading and renewing only its own
        assert role[0]["metadata"]["namespace"] == binding[0]["metadata"]["namespace"] == NAMESPACE
        assert role[0]["rules"] == [
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": sorted(leases),
             "verbs": ["get", "update"]}]
        _subject_ok(binding[0], objects, "Role", role[0]["metadata"]["name"])


def test_a_single_operator_without_election_never_overlaps():
    objects = render(VARIANTS["single-operator"][0])
    (deployment,) = [o for o in objects if o["kind"] == "Deployment"]
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert _operator_args(deployment["spec"]["template"]["spec"]).leader_election == "disabled"
    assert "affinity" not in deployment["spec"]["template"]["spec"]
    assert not [o for o in objects if o["kind"] == "PodDisruptionBudget" or _leader_election(o)]


def test_replicas_without_an_election_fail_render():
    with pytest.raises(Exception, match="needs operator.leaderElection.enabled"):
        render({"operator": {"leaderElection": {"enabled": False}}})
