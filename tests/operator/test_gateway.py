import copy
import json
import subprocess

import pytest

from kvgate.envoy_config import envoy_binary
from kvgate.operator import gateway as g
from kvgate.operator import pool as p
from tests.operator.conftest import NOW, round_trips

IMAGE = "kvgate:test"


def _kinds(docs, kind):
    return [d for d in docs if d.get("kind") == kind]


def _gw(docs, name):
    return next(d for d in _kinds(docs, "Gateway") if d["metadata"]["name"] == name)


def _route(docs, gateway, grants=()):
    return g.routes_for_gateway(gateway, _kinds(docs, "HTTPRoute"), _kinds(docs, "InferencePool"),
                                _kinds(docs, "Service"), list(grants),
                                pool_endpoints={("inference-conformance-app-backend", "primary-inference-pool"):
                                                ["10.0.0.2:3000", "10.0.0.1:3000"]})


def _cond(entry, type_):
    c = next(c for c in entry["conditions"] if c["type"] == type_)
    return c["status"], c["reason"]


def _validate(config, tmp_path):
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(config))
    r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_gatewayclass_accepted(samples):
    assert g.is_our_class(samples["GatewayClass"])
    (c,) = g.gatewayclass_status(samples["GatewayClass"], now=NOW)["conditions"]
    assert (c["type"], c["status"], c["reason"]) == ("Accepted", "True", "Accepted")


def test_samples_render_valid_envoy_and_objects(samples, tmp_path):
    docs = [samples[k] for k in ("Gateway", "HTTPRoute", "InferencePool")]
    docs += p.desired_epp_objects(samples["InferencePool"], IMAGE)
    routing = _route(docs, samples["Gateway"])
    (entry,) = routing.route_parents[("default", "demo-route")]
    assert _cond(entry, "Accepted") == ("True", "Accepted") and _cond(entry, "ResolvedRefs")[0] == "True"
    config = g.render_config(samples["Gateway"], routing)
    _validate(config, tmp_path)
    objs = g.desired_envoy_objects(samples["Gateway"], config, IMAGE)
    assert [o["kind"] for o in objs] == ["ConfigMap", "Deployment", "Service"]
    for obj in objs:
        assert round_trips(obj), obj["kind"]
        assert obj["metadata"]["ownerReferences"][0]["name"] == "inference-gateway"
    assert json.loads(objs[0]["data"]["envoy.yaml"]) == config
    assert objs[2]["spec"]["ports"] == [{"name": "http-8080", "port": 8080, "targetPort": 8080, "protocol": "TCP"}]
    assert objs == g.desired_envoy_objects(copy.deepcopy(samples["Gateway"]), config, IMAGE)
    assert g.render_config(samples["Gateway"], _route(docs, samples["Gateway"])) == config


def test_invalid_pool_ref_is_backend_not_found(conformance, tmp_path):
    docs = conformance("httproute_invalid_inferencepool_ref.yaml")
    routing = _route(docs, _gw(docs, "conformance-primary"))
    (entry,) = routing.route_parents[("inference-conformance-app-backend", "httproute-to-non-existent-pool")]
    assert _cond(entry, "Accepted") == ("True", "Accepted")
    assert _cond(entry, "ResolvedRefs") == ("False", "BackendNotFound")
    _validate(g.render_config(_gw(docs, "conformance-primary"), routing), tmp_path)


def test_invalid_epp_service(conformance, tmp_path):
    docs = conformance("inferencepool_invalid_epp_service.yaml")
    gateway = _gw(docs, "conformance-primary")
    routing = _route(docs, gateway)
    (entry,) = routing.route_parents[("inference-conformance-app-backend", "httproute-for-invalid-epp-pool")]
    assert _cond(entry, "Accepted") == ("True", "Accepted")
    pool = next(d for d in _kinds(docs, "InferencePool") if d["metadata"]["name"] == "pool-with-invalid-epp")
    assert ("inference-conformance-app-backend", "pool-with-invalid-epp") in routing.pools_used
    # No ModelServer joins it: the operator must not create the missing Service.
    assert not p.manages_epp(pool, None, [])
    status = p.pool_status(pool, [gateway], None, now=NOW)
    assert _cond(status["parents"][0], "ResolvedRefs") == ("False", "InvalidExtensionRef")
    _validate(g.render_config(gateway, routing), tmp_path)


def test_resolvedrefs_condition_two_gateways(conformance, tmp_path):
    docs = conformance("inferencepool_resolvedrefs_condition.yaml")
    pool_key = ("inference-conformance-app-backend", "primary-inference-pool")
    users = []
    for name in ("conformance-primary", "conformance-secondary"):
        routing = _route(docs, _gw(docs, name))
        assert pool_key in routing.pools_used
        users.append(_gw(docs, name))
        for entries in routing.route_parents.values():
            assert [_cond(e, "Accepted") for e in entries] == [("True", "Accepted")]
        _validate(g.render_config(_gw(docs, name), routing), tmp_path)
    pool = next(d for d in _kinds(docs, "InferencePool") if d["metadata"]["name"] == "primary-inference-pool")
    svc = next(d for d in _kinds(docs, "Service") if d["metadata"]["name"] == "primary-endpoint-picker-svc")
    status = p.pool_status(pool, users, svc, now=NOW)
    assert [(e["parentRef"]["name"], _cond(e, "Accepted"), _cond(e, "ResolvedRefs")) for e in status["parents"]] == [
        ("conformance-primary", ("True", "Accepted"), ("True", "ResolvedRefs")),
        ("conformance-secondary", ("True", "Accepted"), ("True", "ResolvedRefs"))]
    # With the routes deleted, no parents remain.
    remaining = [d for d in docs if d["kind"] != "HTTPRoute"]
    assert _route(remaining, _gw(docs, "conformance-primary")).pools_used == []
    assert p.pool_status({**pool, "status": status}, [], svc, now=NOW) == {"parents": []}


def test_secondary_listener_hostname_limits_routes(conformance):
    docs = conformance("httproute_multiple_gateways_different_pools.yaml")
    secondary = _route(docs, _gw(docs, "conformance-secondary"))
    # route-for-primary-gateway names the primary Gateway only.
    assert list(secondary.route_parents) == [("inference-conformance-app-backend", "route-for-secondary-gateway")]
    assert {h for r in secondary.rules for h in r.hostnames} == {"secondary.example.com"}
    primary = _route(docs, _gw(docs, "conformance-primary"))
    assert primary.pools_used == [("inference-conformance-app-backend", "primary-inference-pool")]


def test_weighted_two_pools(conformance, tmp_path):
    docs = conformance("gateway_weighted_two_pools.yaml")
    gateway = _gw(docs, "conformance-primary")
    routing = _route(docs, gateway)
    assert len(routing.pools_used) == 2
    config = g.render_config(gateway, routing)
    _validate(config, tmp_path)
    (listener,) = config["static_resources"]["listeners"]
    assert listener["address"]["socket_address"]["port_value"] == 10080  # port 80, unprivileged in the pod
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (vh,) = [v for v in hcm["route_config"]["virtual_hosts"] if v["domains"] == ["primary.example.com"]]
    routes = vh["routes"]
    assert [r["route"]["cluster"] for r in routes] == [
        "pool-inference-conformance-app-backend-primary-inference-pool",
        "pool-inference-conformance-app-backend-primary-inference-pool-fallback",
        "pool-inference-conformance-app-backend-secondary-inference-pool",
        "pool-inference-conformance-app-backend-secondary-inference-pool-fallback"]
    fractions = [r["match"].get("runtime_fraction", {}).get("default_value") for r in routes]
    assert fractions[:2] == [{"numerator": 700000, "denominator": "MILLION"}] * 2
    assert fractions[2:] == [None, None]
    # Each pool's routes switch on that pool's ext_proc only.
    assert all(len(r["typed_per_filter_config"]) == 1 for r in routes)


def test_cross_namespace_needs_reference_grant_and_kinds(samples):
    gateway = samples["Gateway"]
    route = copy.deepcopy(samples["HTTPRoute"])
    pool = copy.deepcopy(samples["InferencePool"])
    pool["metadata"]["namespace"] = "models"
    route["spec"]["rules"][0]["backendRefs"][0]["namespace"] = "models"
    routing = g.routes_for_gateway(gateway, [route], [pool], [], [])
    (entry,) = routing.route_parents[("default", "demo-route")]
    assert _cond(entry, "ResolvedRefs") == ("False", "RefNotPermitted")
    grant = {"kind": "ReferenceGrant", "metadata": {"name": "g", "namespace": "models"},
             "spec": {"from": [{"group": "gateway.networking.k8s.io", "kind": "HTTPRoute", "namespace": "default"}],
                      "to": [{"group": "inference.networking.k8s.io", "kind": "InferencePool"}]}}
    routing = g.routes_for_gateway(gateway, [route], [pool], [], [grant])
    assert _cond(routing.route_parents[("default", "demo-route")][0], "ResolvedRefs") == ("True", "ResolvedRefs")
    route["spec"]["rules"][0]["backendRefs"][0].update(kind="Deployment", group="apps")
    routing = g.routes_for_gateway(gateway, [route], [pool], [], [grant])
    assert _cond(routing.route_parents[("default", "demo-route")][0], "ResolvedRefs") == ("False", "InvalidKind")


def test_service_backend_and_unresolved_share(samples, tmp_path):
    route = copy.deepcopy(samples["HTTPRoute"])
    route["spec"]["rules"] = [{"matches": [{"path": {"type": "Exact", "value": "/x"}}],
                               "backendRefs": [{"name": "web", "port": 80, "weight": 1},
                                               {"name": "gone", "port": 80, "weight": 1}]}]
    svc = {"kind": "Service", "metadata": {"name": "web", "namespace": "default"}, "spec": {"ports": [{"port": 80}]}}
    routing = g.routes_for_gateway(samples["Gateway"], [route], [], [svc], [])
    assert _cond(routing.route_parents[("default", "demo-route")][0], "ResolvedRefs") == ("False", "BackendNotFound")
    config = g.render_config(samples["Gateway"], routing)
    _validate(config, tmp_path)
    routes = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["routes"]
    assert routes[0]["route"]["cluster"] == "svc-default-web-80" and routes[1]["direct_response"]["status"] == 500


@pytest.mark.parametrize("parent_update,reason", [({"sectionName": "nope"}, "NoMatchingParent"),
                                                  ({"port": 9999}, "NoMatchingParent")])
def test_parent_ref_mismatch(samples, parent_update, reason):
    route = copy.deepcopy(samples["HTTPRoute"])
    route["spec"]["parentRefs"][0].update(parent_update)
    routing = g.routes_for_gateway(samples["Gateway"], [route], [samples["InferencePool"]], [], [])
    assert _cond(routing.route_parents[("default", "demo-route")][0], "Accepted") == ("False", reason)
    assert routing.rules == []


def test_namespace_and_hostname_rejections(samples):
    route = copy.deepcopy(samples["HTTPRoute"])
    route["metadata"]["namespace"] = "elsewhere"
    route["spec"]["parentRefs"][0]["namespace"] = "default"
    routing = g.routes_for_gateway(samples["Gateway"], [route], [], [], [])
    assert _cond(routing.route_parents[("elsewhere", "demo-route")][0], "Accepted") == ("False", "NotAllowedByListeners")
    gateway = copy.deepcopy(samples["Gateway"])
    gateway["spec"]["listeners"][0]["hostname"] = "a.example.com"
    route = copy.deepcopy(samples["HTTPRoute"])
    route["spec"]["hostnames"] = ["b.example.com"]
    routing = g.routes_for_gateway(gateway, [route], [], [], [])
    assert _cond(routing.route_parents[("default", "demo-route")][0], "Accepted") == (
        "False", "NoMatchingListenerHostname")


def test_gateway_status(samples):
    gateway = samples["Gateway"]
    routing = g.routes_for_gateway(gateway, [samples["HTTPRoute"]], [samples["InferencePool"]], [], [])
    pending = g.gateway_status(gateway, None, None, routing, now=NOW)
    assert [(c["type"], c["status"], c["reason"]) for c in pending["conditions"]] == [
        ("Accepted", "True", "Accepted"), ("Programmed", "False", "Pending")]
    svc = {"spec": {"clusterIP": "10.96.0.5"}, "status": {}}
    ready = g.gateway_status(gateway, {"status": {"readyReplicas": 1}}, svc, routing, now=NOW)
    assert ready["addresses"] == [{"type": "IPAddress", "value": "10.96.0.5"}]
    assert ready["conditions"][1]["status"] == "True"
    (listener,) = ready["listeners"]
    assert listener["attachedRoutes"] == 1 and listener["supportedKinds"] == [
        {"group": "gateway.networking.k8s.io", "kind": "HTTPRoute"}]
    route_status = g.httproute_status(samples["HTTPRoute"], routing.route_parents[("default", "demo-route")], NOW)
    assert all(c["lastTransitionTime"] == NOW for c in route_status["parents"][0]["conditions"])


def test_effective_hostnames():
    assert g.effective_hostnames(None, []) == ["*"]
    assert g.effective_hostnames("*.example.com", ["a.example.com", "b.other.com"]) == ["a.example.com"]
    assert g.effective_hostnames("a.example.com", ["*.example.com"]) == ["a.example.com"]
