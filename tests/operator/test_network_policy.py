"""The EPP's and the engines' NetworkPolicies (operator/network_policy.py): exact shape, their peers, and who
counts as the pool's gateway; checked against the labels the operator really puts on the EPP, Envoy and engine
pods (the e2e rig runs pods as local processes, with no CNI: nothing there enforces a NetworkPolicy)."""

import copy

import pytest

from kvgate.operator import gateway as g
from kvgate.operator import modelserver as m
from kvgate.operator import naming
from kvgate.operator import network_policy as n
from kvgate.operator import pool as p
from kvgate.operator.config import OperatorConfig
from kvgate.operator.reconciler import Reconciler
from tests.operator.conftest import round_trips
from tests.operator.memory_kube import MemoryKube

TCP = lambda port: {"protocol": "TCP", "port": port}  # noqa: E731
EXT_PROC_PORTS = [TCP(9002), TCP(9003)]


def _pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"]["labels"]


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def _gateways(samples):
    return n.gateways_routing_to(samples["InferencePool"], [samples["HTTPRoute"]], [samples["Gateway"]], [])


def test_sample_pool_policy_exact_shape(samples):
    pool = samples["InferencePool"]
    policy, problems = n.desired_network_policy(pool, _gateways(samples))
    assert problems == []
    assert round_trips(policy)
    assert policy["metadata"]["name"] == "demo-pool-epp" and policy["metadata"]["namespace"] == "default"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-demo-pool"  # garbage-collected with the pool
    assert naming.is_managed(policy)
    assert policy["spec"] == {
        "podSelector": {"matchLabels": {"app.kubernetes.io/instance": "demo-pool",
                                        "app.kubernetes.io/name": "kvgate-epp"}},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "inference-gateway",
                                                                "app.kubernetes.io/name": "kvgate-gateway"}}}],
                     "ports": EXT_PROC_PORTS}],
    }


def test_policy_selects_the_real_epp_pods_and_admits_the_real_envoy_pods(samples):
    pool, gateway = samples["InferencePool"], samples["Gateway"]
    policy, _ = n.desired_network_policy(pool, [gateway])
    epp = next(o for o in p.desired_epp_objects(pool, "img") if o["kind"] == "Deployment")
    assert _selects(policy["spec"]["podSelector"], _pod_labels(epp))
    routing = g.routes_for_gateway(gateway, [], [], [], [])
    envoy = next(o for o in g.desired_envoy_objects(gateway, g.render_config(gateway, routing), "envoy")
                 if o["kind"] == "Deployment")
    (peer,) = policy["spec"]["ingress"][0]["from"]
    assert _selects(peer["podSelector"], _pod_labels(envoy))
    other = copy.deepcopy(gateway)
    other["metadata"]["name"] = "other-gateway"
    other_envoy = next(o for o in g.desired_envoy_objects(other, g.render_config(other, routing), "envoy")
                       if o["kind"] == "Deployment")
    assert not _selects(peer["podSelector"], _pod_labels(other_envoy))


def test_no_peers_means_no_ingress_at_all(samples):
    """A rule with an empty `from` would admit every source: none is written, the policy denies all."""
    policy, problems = n.desired_network_policy(samples["InferencePool"], [])
    assert policy["spec"]["ingress"] == [] and policy["spec"]["policyTypes"] == ["Ingress"] and not problems
    assert round_trips(policy)


def _route(name="r", ns="default", pool_ns=None, gateways=(("inference-gateway", None),)):
    ref = {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "demo-pool"}
    if pool_ns:
        ref["namespace"] = pool_ns
    parents = [{"name": gw, **({"namespace": gw_ns} if gw_ns else {})} for gw, gw_ns in gateways]
    return {"kind": "HTTPRoute", "metadata": {"name": name, "namespace": ns},
            "spec": {"parentRefs": parents, "rules": [{"backendRefs": [ref]}]}}


def _gw(name, ns="default"):
    return {"kind": "Gateway", "metadata": {"name": name, "namespace": ns}, "spec": {"gatewayClassName": "kvgate"}}


def test_which_gateways_count(samples):
    pool = samples["InferencePool"]
    ours = [_gw("a"), _gw("b"), _gw("c", "infra")]
    other_pool = _route("x", gateways=(("c", "infra"),))
    other_pool["spec"]["rules"][0]["backendRefs"][0]["name"] = "another-pool"
    service_ref = _route("svc", gateways=(("c", "infra"),))
    service_ref["spec"]["rules"][0]["backendRefs"] = [{"name": "demo-pool", "port": 80}]  # a Service, not the pool
    routes = [_route("r1", gateways=(("b", None), ("a", None))), _route("r2", gateways=(("not-ours", None),)),
              other_pool, service_ref]
    assert [naming.name_of(x) for x in n.gateways_routing_to(pool, routes, ours, [])] == ["a", "b"]
    # a route in another namespace: only with a ReferenceGrant in the pool's namespace (as for routing)
    cross = _route("r3", ns="team", pool_ns="default", gateways=(("c", "infra"),))
    assert [naming.name_of(x) for x in n.gateways_routing_to(pool, [cross], ours, [])] == []
    grant = {"kind": "ReferenceGrant", "metadata": {"name": "rg", "namespace": "default"},
             "spec": {"from": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "namespace": "team"}],
                      "to": [{"group": "inference.networking.k8s.io", "kind": "InferencePool"}]}}
    assert [naming.name_of(x) for x in n.gateways_routing_to(pool, [cross], ours, [grant])] == ["c"]


def test_gateway_in_another_namespace_is_matched_by_namespace_name(samples):
    policy, _ = n.desired_network_policy(samples["InferencePool"], [_gw("c", "infra"), _gw("a")])
    assert policy["spec"]["ingress"][0]["from"] == [
        {"podSelector": {"matchLabels": naming.selector_labels("gateway", "c")},
         "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "infra"}}},
        {"podSelector": {"matchLabels": naming.selector_labels("gateway", "a")}},
    ]
    assert round_trips(policy)


PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
              "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}


def test_metrics_and_foreign_gateway_peers(samples):
    pool = copy.deepcopy(samples["InferencePool"])
    pool["metadata"]["annotations"] = {
        n.INGRESS_FROM_ANNOTATION: "[{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: istio-system}}}]",
        n.METRICS_FROM_ANNOTATION: '{"podSelector": {"matchLabels": {"app": "scraper"}}}',
    }
    policy, problems = n.desired_network_policy(pool, [samples["Gateway"]], [PROMETHEUS])
    assert problems == [] and round_trips(policy)
    ext_proc, metrics = policy["spec"]["ingress"]
    assert ext_proc["ports"] == EXT_PROC_PORTS and metrics["ports"] == [TCP(9090)]
    assert ext_proc["from"][1] == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "istio-system"}}}
    assert metrics["from"] == [PROMETHEUS, {"podSelector": {"matchLabels": {"app": "scraper"}}}]
    # the Gateways reach ext-proc and health only, never metrics
    assert all(peer not in metrics["from"] for peer in ext_proc["from"])


def test_unreadable_annotation_is_a_problem_and_adds_no_peer(samples):
    pool = copy.deepcopy(samples["InferencePool"])
    pool["metadata"]["annotations"] = {n.METRICS_FROM_ANNOTATION: "[{anywhere: true}]"}
    policy, problems = n.desired_network_policy(pool, [], [PROMETHEUS])
    assert [x["reason"] for x in problems] == ["InvalidNetworkPolicyPeers"]
    assert "annotation kvgate.dev/epp-metrics-from[0]" in problems[0]["message"]
    assert policy["spec"]["ingress"] == [{"from": [PROMETHEUS], "ports": [TCP(9090)]}]
    untrusted, _ = n.desired_network_policy(pool, [], [PROMETHEUS], trust_annotations=False)
    assert untrusted == policy


@pytest.mark.parametrize("text,says", [
    ("[", "not valid YAML"), ("42", "expected a list"), ("[{}]", "a peer has"),
    ("[{podSelector: {matchLabels: {a: 1}}}]", "matchLabels"),
    ("[{podSelector: {matchExpressions: [{key: a, operator: Near}]}}]", "matchExpressions[0]"),
    ("[{ipBlock: {cidr: 10.0.0.0/8}, podSelector: {}}]", "ipBlock stands alone"),
    ("[{namespaceSelector: {labels: {a: b}}}]", "matchLabels and matchExpressions"),
])
def test_parse_peers_refuses_what_is_not_a_peer(text, says):
    with pytest.raises(ValueError, match="src") as err:
        n.parse_peers(text, "src")
    assert says in str(err.value)


def test_parse_peers_accepts_kubernetes_peers():
    assert n.parse_peers(None, "x") == [] and n.parse_peers("  ", "x") == []
    peers = n.parse_peers("- ipBlock: {cidr: 10.0.0.0/8, except: [10.1.0.0/16]}\n"
                          "- namespaceSelector: {}\n"
                          "- podSelector: {matchExpressions: [{key: app, operator: In, values: [a, b]}]}\n", "x")
    assert [sorted(peer) for peer in peers] == [["ipBlock"], ["namespaceSelector"], ["podSelector"]]


def test_opt_out_annotation(samples):
    pool = copy.deepcopy(samples["InferencePool"])
    assert n.policy_enabled(pool)
    pool["metadata"]["annotations"] = {n.POLICY_ANNOTATION: "disabled"}
    assert not n.policy_enabled(pool)
    pool["metadata"]["annotations"] = {n.POLICY_ANNOTATION: "enabled"}
    assert n.policy_enabled(pool)


def test_route_refs(samples):
    pools, gateways = n.route_refs(samples["HTTPRoute"])
    assert pools == {("default", "demo-pool")} and gateways == {("default", "inference-gateway")}
    cross = _route(ns="team", pool_ns="default", gateways=(("c", "infra"), ("d", None)))
    assert n.route_refs(cross) == ({("default", "demo-pool")}, {("infra", "c"), ("team", "d")})


# --- the engines' policy: KV events from the EPP only, HTTP from the gateways and the EPP ----------------------------

KV_PORTS = (5557, 5558)


def _with_kv_events(ms: dict, port=5557, replay=5558) -> dict:
    ms = copy.deepcopy(ms)
    ms["spec"]["engine"]["kvEvents"] = {"port": port, **({"replayPort": replay} if replay else {})}
    return ms


def _admits(policy: dict, namespace: str, target_labels: dict, source_labels: dict, source_namespace: str,
            port: int) -> bool:
    """Kubernetes' NetworkPolicy semantics for what these policies use: does `policy` (in `namespace`) let a pod
    labelled `source_labels` in `source_namespace` reach `port` of a pod labelled `target_labels`?"""
    spec = policy["spec"]
    if not _selects(spec["podSelector"], target_labels):
        return True  # not selected: this policy says nothing about the pod
    for rule in spec["ingress"]:
        if port not in [p["port"] for p in rule["ports"]]:
            continue
        for peer in rule["from"]:
            ns_ok = (_selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": source_namespace})
                     if "namespaceSelector" in peer else source_namespace == namespace)
            if ns_ok and _selects(peer.get("podSelector", {"matchLabels": {}}), source_labels):
                return True
    return False


def _real_pods(samples, ms):
    """The labels the operator really puts on the engine, EPP and Envoy pods (from their Deployments)."""
    pool, gateway = samples["InferencePool"], samples["Gateway"]
    engine = m.desired_engine_deployment(ms, pool, "img")
    epp = next(o for o in p.desired_epp_objects(pool, "img") if o["kind"] == "Deployment")
    routing = g.routes_for_gateway(gateway, [], [], [], [])
    envoy = next(o for o in g.desired_envoy_objects(gateway, g.render_config(gateway, routing), "envoy")
                 if o["kind"] == "Deployment")
    other = copy.deepcopy(gateway)
    other["metadata"]["name"] = "other-gateway"
    other_envoy = next(o for o in g.desired_envoy_objects(other, g.render_config(other, routing), "envoy")
                       if o["kind"] == "Deployment")
    other_pool = copy.deepcopy(pool)
    other_pool["metadata"]["name"] = "other-pool"
    other_epp = next(o for o in p.desired_epp_objects(other_pool, "img") if o["kind"] == "Deployment")
    return {"engine": _pod_labels(engine), "epp": _pod_labels(epp), "envoy": _pod_labels(envoy),
            "other-envoy": _pod_labels(other_envoy), "other-epp": _pod_labels(other_epp), "anyone": {"app": "x"}}


def test_engine_policy_admits_exactly_the_epp_to_kv_ports_and_the_gateway_and_epp_to_http(samples):
    ms = _with_kv_events(samples["ModelServer"])
    pool = samples["InferencePool"]
    policy, problems = n.desired_engine_network_policy(pool, _gateways(samples), [ms])
    assert problems == [] and round_trips(policy)
    assert policy["metadata"]["name"] == "demo-pool-engines" and naming.is_managed(policy)
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-demo-pool"
    pods = _real_pods(samples, ms)
    allowed = {(source, port) for source, labels in pods.items() for port in (8000, *KV_PORTS, 9999)
               if _admits(policy, "default", pods["engine"], labels, "default", port)}
    assert allowed == {("envoy", 8000), ("epp", 8000), ("epp", 5557), ("epp", 5558)}
    # a Gateway's Envoy in another namespace reaches HTTP only, and only with its namespace label
    far = n.desired_engine_network_policy(pool, [_gw("c", "infra")], [ms])[0]
    c_envoy = naming.selector_labels("gateway", "c")
    assert _admits(far, "default", pods["engine"], c_envoy, "infra", 8000)
    assert not _admits(far, "default", pods["engine"], c_envoy, "default", 8000)
    assert not any(_admits(far, "default", pods["engine"], c_envoy, "infra", port) for port in KV_PORTS)


def test_engine_policy_exact_shape(samples):
    ms = _with_kv_events(samples["ModelServer"])
    policy, _ = n.desired_engine_network_policy(samples["InferencePool"], _gateways(samples), [ms])
    epp = {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "demo-pool",
                                           "app.kubernetes.io/name": "kvgate-epp"}}}
    envoy = {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "inference-gateway",
                                             "app.kubernetes.io/name": "kvgate-gateway"}}}
    assert policy["spec"] == {
        "podSelector": {"matchLabels": {"app": "demo-llm", "app.kubernetes.io/name": "kvgate-engine"}},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [envoy, epp], "ports": [TCP(8000)]},
                    {"from": [epp], "ports": [TCP(5557), TCP(5558)]}],
    }


def test_engine_policy_kv_ports_come_from_the_pools_modelservers_only(samples):
    pool = samples["InferencePool"]
    mine = _with_kv_events(samples["ModelServer"], 6000, None)
    other_pool = _with_kv_events(samples["ModelServer"], 7000, 7001)
    other_pool["spec"]["poolRef"]["name"] = "another-pool"
    other_ns = _with_kv_events(samples["ModelServer"], 7100, None)
    other_ns["metadata"]["namespace"] = "team"
    policy, _ = n.desired_engine_network_policy(pool, [], [mine, other_pool, other_ns, samples["ModelServer"]])
    assert policy["spec"]["ingress"][1] == {"from": [n.epp_peer(pool)], "ports": [TCP(6000)]}
    # no KV events: no rule for them (and never a rule without ports, which would admit every port)
    plain, _ = n.desired_engine_network_policy(pool, [], [samples["ModelServer"]])
    assert [r["ports"] for r in plain["spec"]["ingress"]] == [[TCP(8000)]]


def test_engine_policy_peer_annotations_reach_http_never_kv_events(samples):
    pool = copy.deepcopy(samples["InferencePool"])
    pool["metadata"]["annotations"] = {
        n.INGRESS_FROM_ANNOTATION: "[{namespaceSelector: {matchLabels: {kubernetes.io/metadata.name: istio-system}}}]",
        n.ENGINE_INGRESS_FROM_ANNOTATION: "[{podSelector: {matchLabels: {app: prometheus}}}]",
        n.METRICS_FROM_ANNOTATION: "[{podSelector: {matchLabels: {app: scraper}}}]",  # the EPP's metrics only
    }
    ms = _with_kv_events(samples["ModelServer"])
    policy, problems = n.desired_engine_network_policy(pool, [], [ms])
    assert problems == [] and round_trips(policy)
    http, kv = policy["spec"]["ingress"]
    assert http["from"][1:] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "istio-system"}}},
        {"podSelector": {"matchLabels": {"app": "prometheus"}}}]
    assert kv["from"] == [n.epp_peer(pool)]
    pool["metadata"]["annotations"][n.ENGINE_INGRESS_FROM_ANNOTATION] = "[{everyone: true}]"
    policy, problems = n.desired_engine_network_policy(pool, [], [ms])
    assert [x["reason"] for x in problems] == ["InvalidNetworkPolicyPeers"]
    assert policy["spec"]["ingress"][1]["from"] == [n.epp_peer(pool)]


def test_engine_policy_selects_the_real_engine_pods_even_when_the_pool_uses_the_name_label(samples):
    pool = copy.deepcopy(samples["InferencePool"])
    pool["spec"]["selector"]["matchLabels"] = {"app.kubernetes.io/name": "my-model"}
    ms = samples["ModelServer"]
    policy, _ = n.desired_engine_network_policy(pool, [], [ms])
    assert _selects(policy["spec"]["podSelector"], _pod_labels(m.desired_engine_deployment(ms, pool, "img")))
    pool["spec"]["selector"]["matchLabels"] = {}  # selects nothing by labels: no policy (it would select all engines)
    assert n.desired_engine_network_policy(pool, [], [ms]) == (None, [])


def _reconcile(samples, kube):
    Reconciler(kube, OperatorConfig(engine_image="img", epp_image="img", envoy_image="envoy")).reconcile_pool(
        "default", "demo-pool")


def test_the_operator_writes_the_engine_policy_and_deletes_it_on_opt_out(samples):
    kube = MemoryKube()
    for kind in ("InferencePool", "GatewayClass", "Gateway", "HTTPRoute"):
        kube.put(samples[kind])
    kube.put(_with_kv_events(samples["ModelServer"]))
    _reconcile(samples, kube)
    written = kube.stored("NetworkPolicy", "demo-pool-engines")
    assert written["spec"]["ingress"] == n.desired_engine_network_policy(
        samples["InferencePool"], _gateways(samples), [_with_kv_events(samples["ModelServer"])])[0]["spec"]["ingress"]
    assert kube.stored("NetworkPolicy", "demo-pool-epp") is not None  # the EPP's, as before
    pool = kube.stored("InferencePool", "demo-pool")
    pool["metadata"]["annotations"] = {n.ENGINE_POLICY_ANNOTATION: "disabled"}
    kube.put(pool)
    _reconcile(samples, kube)
    assert kube.stored("NetworkPolicy", "demo-pool-engines") is None
    assert kube.stored("NetworkPolicy", "demo-pool-epp") is not None
