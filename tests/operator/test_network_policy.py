"""The EPP's NetworkPolicy (operator/network_policy.py): exact shape, its peers, and who counts as the pool's
gateway; checked against the labels the operator really puts on the EPP and Envoy pods."""

import copy

import pytest

from kvgate.operator import gateway as g
from kvgate.operator import naming
from kvgate.operator import network_policy as n
from kvgate.operator import pool as p
from tests.operator.conftest import round_trips

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
