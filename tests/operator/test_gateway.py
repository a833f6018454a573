import copy
import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

import httpx
import pytest

from kvgate.common.envoy_config import PoolBackend, envoy_binary
from kvgate.common.epp_protocol import DESTINATION_HEADER
from kvgate.common.gateway_routes import RouteRule, ServiceBackend, WeightedBackend, render_gateway_files
from kvgate.common.processes import free_port, stop_group, wait_http_ok
from kvgate.operator import gateway as g
from kvgate.operator import pool as p
from kvgate.common.gateway_routes import BOOTSTRAP_FILE, CDS_FILE, listeners_of, rds_file, static_bootstrap
from tests.e2e.k8srig.podrunner import write_atomic_volume  # the kubelet's way of publishing a ConfigMap
from tests.operator.conftest import NOW, round_trips
from tests.test_envoy_config import assert_safe

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


def _validate(files, tmp_path):
    """The real Envoy accepts the file set: the bootstrap with the dynamic files beside it (as mounted), and,
    since validate mode does not read dynamic resources, the same config folded into one static bootstrap."""
    folder = tmp_path / "etc-envoy"
    write_atomic_volume(folder, {name: g._config_text(doc).encode() for name, doc in files.items()})
    static = tmp_path / "static.json"
    static.write_text(json.dumps(static_bootstrap(files)))
    for cmd in (["-c", BOOTSTRAP_FILE], ["-c", str(static)]):
        r = subprocess.run([envoy_binary(), "--mode", "validate", *cmd], cwd=folder, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def _routes_of(files, port=8080):
    (route_config,) = files[rds_file(port)]["resources"]
    return route_config


def test_gatewayclass_accepted(samples):
    assert g.is_our_class(samples["GatewayClass"])
    (c,) = g.gatewayclass_status(samples["GatewayClass"], now=NOW)["conditions"]
    assert (c["type"], c["status"], c["reason"]) == ("Accepted", "True", "Accepted")


@pytest.mark.processes
def test_samples_render_valid_envoy_and_objects(samples, tmp_path):
    docs = [samples[k] for k in ("Gateway", "HTTPRoute", "InferencePool")]
    docs += p.desired_epp_objects(samples["InferencePool"], IMAGE)
    routing = _route(docs, samples["Gateway"])
    (entry,) = routing.route_parents[("default", "demo-route")]
    assert _cond(entry, "Accepted") == ("True", "Accepted") and _cond(entry, "ResolvedRefs")[0] == "True"
    config = g.render_config(samples["Gateway"], routing)
    _validate(config, tmp_path)
    assert_safe(static_bootstrap(config))  # finite timeouts, explicit circuit breakers, no Lua
    objs = g.desired_envoy_objects(samples["Gateway"], config, IMAGE)
    assert [o["kind"] for o in objs] == ["ConfigMap", "Deployment", "Service"]
    for obj in objs:
        assert round_trips(obj), obj["kind"]
        assert obj["metadata"]["ownerReferences"][0]["name"] == "inference-gateway"
    assert {k: json.loads(v) for k, v in objs[0]["data"].items()} == config
    assert sorted(objs[0]["data"]) == [CDS_FILE, BOOTSTRAP_FILE, "rds-8080.yaml"]
    assert objs[2]["spec"]["ports"] == [{"name": "http-8080", "port": 8080, "targetPort": 8080, "protocol": "TCP"}]
    assert objs == g.desired_envoy_objects(copy.deepcopy(samples["Gateway"]), config, IMAGE)
    assert g.render_config(samples["Gateway"], _route(docs, samples["Gateway"])) == config


def test_clusters_linger_after_their_routes_go(samples, conformance):
    """A cluster the new config drops stays in cds.yaml for CLUSTER_LINGER_S (its routes go at once), so that
    streams in flight on it finish: Envoy resets the streams of a cluster it removes."""
    docs = [samples[k] for k in ("Gateway", "HTTPRoute", "InferencePool")]
    docs += p.desired_epp_objects(samples["InferencePool"], IMAGE)
    gateway = samples["Gateway"]
    with_pool = g.desired_envoy_objects(gateway, g.render_config(gateway, _route(docs, gateway)), IMAGE, now=1000.0)
    pool_clusters = {c["name"] for c in json.loads(with_pool[0]["data"][CDS_FILE])["resources"]}
    assert pool_clusters and "annotations" not in with_pool[0]["metadata"]

    without = g.render_config(gateway, _route([gateway], gateway))  # the pool and the route are gone
    assert not without[CDS_FILE]["resources"]
    first = g.desired_envoy_objects(gateway, without, IMAGE, previous_config_map=with_pool[0], now=1000.0)
    cm = first[0]
    kept = {c["name"]: c for c in json.loads(cm["data"][CDS_FILE])["resources"]}
    assert set(kept) == pool_clusters
    assert json.loads(cm["metadata"]["annotations"][g.RETIRED_ANNOTATION]) == {
        n: 1000.0 + g.CLUSTER_LINGER_S for n in pool_clusters}
    assert cm["data"]["rds-8080.yaml"] == g.desired_envoy_objects(gateway, without, IMAGE)[0]["data"]["rds-8080.yaml"]
    assert first[1] == with_pool[1]  # the Deployment (and its config digest) does not change

    # Later reconciles keep the first deadline, and drop the clusters once it has passed.
    again = g.desired_envoy_objects(gateway, without, IMAGE, previous_config_map=cm, now=1020.0)
    assert again[0] == cm
    gone = g.desired_envoy_objects(gateway, without, IMAGE, previous_config_map=cm, now=1000.0 + g.CLUSTER_LINGER_S)
    assert not json.loads(gone[0]["data"][CDS_FILE])["resources"] and "annotations" not in gone[0]["metadata"]
    # A cluster that comes back is simply wanted again; a previous ConfigMap that is not JSON is ignored.
    back = g.desired_envoy_objects(gateway, g.render_config(gateway, _route(docs, gateway)), IMAGE,
                                   previous_config_map=cm, now=1010.0)
    assert back[0] == with_pool[0]
    junk = {**cm, "data": {CDS_FILE: "not: [json"}}
    assert g.desired_envoy_objects(gateway, without, IMAGE, previous_config_map=junk, now=1.0)[0] == gone[0]


@pytest.mark.processes
def test_invalid_pool_ref_is_backend_not_found(conformance, tmp_path):
    docs = conformance("httproute_invalid_inferencepool_ref.yaml")
    routing = _route(docs, _gw(docs, "conformance-primary"))
    (entry,) = routing.route_parents[("inference-conformance-app-backend", "httproute-to-non-existent-pool")]
    assert _cond(entry, "Accepted") == ("True", "Accepted")
    assert _cond(entry, "ResolvedRefs") == ("False", "BackendNotFound")
    _validate(g.render_config(_gw(docs, "conformance-primary"), routing), tmp_path)


@pytest.mark.processes
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


@pytest.mark.processes
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


@pytest.mark.processes
def test_weighted_two_pools(conformance, tmp_path):
    docs = conformance("gateway_weighted_two_pools.yaml")
    gateway = _gw(docs, "conformance-primary")
    routing = _route(docs, gateway)
    assert len(routing.pools_used) == 2
    config = g.render_config(gateway, routing)
    _validate(config, tmp_path)
    (listener,) = listeners_of(config)
    assert listener["address"]["socket_address"]["port_value"] == 10080  # port 80, unprivileged in the pod
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    (vh,) = [v for v in hcm["route_config"]["virtual_hosts"] if v["domains"] == ["primary.example.com"]]
    routes = vh["routes"]
    # Per pool: the EPP's pick (ORIGINAL_DST), then FailOpen; the split is decided by the match itself, so the
    # re-match after the EPP answered (its pick now in the metadata) lands on the same pool's picked route.
    primary, secondary = ("pool-inference-conformance-app-backend-primary-inference-pool",
                          "pool-inference-conformance-app-backend-secondary-inference-pool")
    assert [r["route"]["cluster"] for r in routes] == [primary, primary + "-failopen", secondary,
                                                       secondary + "-failopen"]
    fractions = [r["match"].get("runtime_fraction", {}).get("default_value") for r in routes]
    assert fractions == [{"numerator": 700000, "denominator": "MILLION"}] * 2 + [None, None]
    # Each pool's routes switch on the one ext_proc filter, naming that pool's EPP.
    assert [r["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["config"]["overrides"]["grpc_service"]
            ["envoy_grpc"]["cluster_name"] for r in routes] == [
        "epp-inference-conformance-app-backend-primary-inference-pool"] * 2 + [
        "epp-inference-conformance-app-backend-secondary-inference-pool"] * 2


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


@pytest.mark.processes
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
    routes = _routes_of(config)["virtual_hosts"][0]["routes"]
    assert routes[0]["route"]["cluster"] == "svc-default-web-80" and routes[1]["direct_response"]["status"] == 500


def _pool_routes_and_cluster(samples, route, pool):
    routing = g.routes_for_gateway(samples["Gateway"], [route], [pool], [], [])
    config = g.render_config(samples["Gateway"], routing)
    routes = _routes_of(config)["virtual_hosts"][0]["routes"]
    (cluster,) = [c for c in config[CDS_FILE]["resources"] if c["name"].startswith("pool-")
                  and not c["name"].endswith("-failopen")]
    return config, routes, cluster


@pytest.mark.processes
def test_httproute_timeouts_and_pool_limits(samples, tmp_path):
    """HTTPRoute rules[].timeouts (request, backendRequest) set the route's timeout and per-try timeout; the
    pool's kvgate.dev annotations set its circuit breakers and stream-idle timeout; without them, the defaults."""
    route, pool = copy.deepcopy(samples["HTTPRoute"]), copy.deepcopy(samples["InferencePool"])
    config, (default_route, _), cluster = _pool_routes_and_cluster(samples, route, pool)
    assert default_route["route"]["timeout"] == "600s" and "idle_timeout" not in default_route["route"]
    assert cluster["circuit_breakers"]["thresholds"][0]["max_requests"] == 100000

    route["spec"]["rules"][0]["timeouts"] = {"request": "1h30m", "backendRequest": "90s"}
    pool["metadata"]["annotations"] = {"kvgate.dev/max-requests": "2048", "kvgate.dev/max-retries": "50",
                                       "kvgate.dev/max-connections": "-1",  # invalid: the default stays
                                       "kvgate.dev/stream-idle-timeout": "15m"}
    config, (tuned, _), cluster = _pool_routes_and_cluster(samples, route, pool)
    _validate(config, tmp_path)
    # One try per request (ORIGINAL_DST on the EPP's pick): backendRequest bounds it together with request.
    assert (tuned["route"]["timeout"], tuned["route"]["idle_timeout"]) == ("90s", "900s")
    (breakers,) = cluster["circuit_breakers"]["thresholds"]
    assert (breakers["max_requests"], breakers["max_retries"], breakers["max_connections"]) == (2048, 50, 100000)


def test_gateway_api_durations():
    assert [g.parse_gateway_duration(v) for v in ("10s", "1h30m", "500ms", "1h2m3s4ms", "0s")] == [
        10.0, 5400.0, 0.5, 3723.004, 0.0]
    assert [g.parse_gateway_duration(v) for v in (None, "", "10", "1d", "-1s", 5)] == [None] * 6


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


def _objects(gateway, routes, pools, services=()):
    routing = g.routes_for_gateway(gateway, routes, pools, list(services), [])
    return g.desired_envoy_objects(gateway, g.render_config(gateway, routing), IMAGE)


def test_route_and_pool_changes_do_not_roll_envoy(samples):
    """Routes and pools live in files Envoy reloads in place; only the bootstrap (listener ports) rolls pods."""
    gateway, pool = samples["Gateway"], samples["InferencePool"]
    base_cm, base_dep, _ = _objects(gateway, [samples["HTTPRoute"]], [pool])
    assert sorted(base_cm["data"]) == [CDS_FILE, BOOTSTRAP_FILE, "rds-8080.yaml"]
    bootstrap = json.loads(base_cm["data"][BOOTSTRAP_FILE])
    assert "clusters" not in bootstrap["static_resources"]
    watched = {"path_config_source": {"path": "./cds.yaml", "watched_directory": {"path": "."}},
               "resource_api_version": "V3"}
    assert bootstrap["dynamic_resources"] == {"cds_config": watched}
    (listener,) = bootstrap["static_resources"]["listeners"]
    assert listener["filter_chains"][0]["filters"][0]["typed_config"]["rds"] == {
        "route_config_name": "gateway-8080",
        "config_source": {**watched, "path_config_source": {**watched["path_config_source"],
                                                             "path": "./rds-8080.yaml"}}}
    assert bootstrap["node"] == {"id": "default/inference-gateway", "cluster": "inference-gateway-envoy"}
    (container,) = base_dep["spec"]["template"]["spec"]["containers"]
    assert container["workingDir"] == "/etc/envoy"
    assert container["command"][:3] == ["envoy", "-c", "/etc/envoy/envoy.yaml"]
    assert container["volumeMounts"][0]["mountPath"] == "/etc/envoy"
    assert [c["name"] for c in json.loads(base_cm["data"][CDS_FILE])["resources"]] == [
        "epp-default-demo-pool", "pool-default-demo-pool", "pool-default-demo-pool-failopen"]

    # A second pool and a Service rule added at once, and then no routes at all: new route tables and clusters,
    # the same bootstrap, so the same Deployment.
    route = copy.deepcopy(samples["HTTPRoute"])
    other = copy.deepcopy(pool)
    other["metadata"]["name"] = "other-pool"
    route["spec"]["rules"] += [
        {"matches": [{"path": {"type": "PathPrefix", "value": "/other"}}],
         "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "other-pool"}]},
        {"matches": [{"path": {"type": "Exact", "value": "/web"}}], "backendRefs": [{"name": "web", "port": 80}]}]
    svc = {"kind": "Service", "metadata": {"name": "web", "namespace": "default"}, "spec": {"ports": [{"port": 80}]}}
    more_cm, more_dep, _ = _objects(gateway, [route], [pool, other], [svc])
    none_cm, none_dep, _ = _objects(gateway, [], [])
    for cm, dep in ((more_cm, more_dep), (none_cm, none_dep)):
        assert cm["data"][BOOTSTRAP_FILE] == base_cm["data"][BOOTSTRAP_FILE] and dep == base_dep
        assert cm["data"]["rds-8080.yaml"] != base_cm["data"]["rds-8080.yaml"]
        assert cm["data"][CDS_FILE] != base_cm["data"][CDS_FILE]
    assert len(json.loads(more_cm["data"][CDS_FILE])["resources"]) == 7
    assert json.loads(none_cm["data"][CDS_FILE]) == {"resources": []}

    # A listener port change is a bootstrap change: the pods roll.
    moved = copy.deepcopy(gateway)
    moved["spec"]["listeners"][0]["port"] = 9090
    moved_cm, moved_dep, _ = _objects(moved, [samples["HTTPRoute"]], [pool])
    assert sorted(moved_cm["data"]) == [CDS_FILE, BOOTSTRAP_FILE, "rds-9090.yaml"]
    digest = lambda dep: dep["spec"]["template"]["metadata"]["annotations"]["kvgate.dev/config-digest"]  # noqa: E731
    assert digest(moved_dep) != digest(base_dep)
    assert digest(moved_dep) == g.envoy_bootstrap_digest(moved_cm["data"])


# --- live: the rendered files on a running Envoy, updated the way the kubelet updates a ConfigMap volume --------

_METRICS = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0.0\n"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive

    def log_message(self, *args) -> None:
        pass

    def _read_body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() != "chunked":
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b""
        while size := int(self.rfile.readline().split(b";")[0], 16):
            body += self.rfile.read(size)
            self.rfile.readline()
        while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
            pass
        return body

    def _answer(self) -> None:
        self._read_body()
        path, _, query = self.path.partition("?")
        if delay := parse_qs(query).get("delay"):
            time.sleep(float(delay[0]))
        body = _METRICS if path == "/metrics" else f"{self.server.name} {path}\n".encode()
        self.send_response(200)
        self.send_header("x-upstream", self.server.name)
        self.send_header("x-seen-destination", self.headers.get(DESTINATION_HEADER, ""))
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer


class _Upstream:
    """A plain HTTP/1.1 backend: answers `<name> <path>` with header x-upstream, the EPP-picked destination it
    was sent (x-seen-destination), and zeroed vLLM metrics at /metrics for an EPP in front of it."""

    def __init__(self, name: str) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.name = name
        self.port = self.server.server_address[1]
        self.address = f"127.0.0.1:{self.port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _stats(admin: int, pattern: str) -> dict[str, int]:
    text = httpx.get(f"http://127.0.0.1:{admin}/stats", params={"filter": pattern}, timeout=5).text
    return {k: int(v) for k, _, v in (line.partition(": ") for line in text.splitlines()) if v.isdigit()}


def _propagation_s(since: float, check, timeout_s: float = 10.0) -> float:
    """Seconds from `since` until check() holds, polled every 20 ms."""
    while not check():
        assert time.monotonic() - since < timeout_s, f"not applied after {timeout_s:g} s"
        time.sleep(0.02)
    return time.monotonic() - since


@pytest.mark.processes
def test_live_envoy_applies_route_and_pool_changes_in_place(tmp_path):
    """Envoy runs on the operator's files in a kubelet-style folder; route and pool changes swapped in with
    `..data` apply within seconds, on the same process, with no keep-alive or in-flight request failed and no
    update rejected: a route switched to another backend, two pools (one with a real EPP) added with their
    routes at once, routes removed."""
    from tests.gateway import EPP

    a, b = _Upstream("a"), _Upstream("b")
    port, admin = free_port(), free_port()
    folder = tmp_path / "etc-envoy"
    svc_a, svc_b = (ServiceBackend(f"svc-{u.server.name}", "127.0.0.1", u.port) for u in (a, b))

    def publish(backends: dict[str, object]) -> float:
        """Render `backends` ({path prefix: backend}) and swap the files in; returns when the swap began."""
        rules = [RouteRule(f"test/{path.strip('/')}/0", port, [WeightedBackend(backend)], path_value=path)
                 for path, backend in backends.items()]
        files = render_gateway_files(rules, [port], admin, listen_host="127.0.0.1")
        texts = {name: g._config_text(doc).encode() for name, doc in files.items()}
        began = time.monotonic()
        write_atomic_volume(folder, texts)
        return began

    epp = envoy = None
    stop = threading.Event()
    outcomes: list = []
    try:
        epp = EPP(tmp_path, [a.address, b.address])
        publish({"/stable": svc_a, "/moving": svc_a})
        with open(tmp_path / "envoy.log", "wb") as log:
            envoy = subprocess.Popen([envoy_binary(), "-c", BOOTSTRAP_FILE, "--disable-hot-restart",
                                      "--log-level", "info"], cwd=folder, stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        wait_http_ok(f"http://127.0.0.1:{admin}/ready", 30, lambda: None if envoy.poll() is None else "envoy died")
        url = f"http://127.0.0.1:{port}"

        def load() -> None:  # one keep-alive connection, requests back to back on a route that never changes
            with httpx.Client(base_url=url, timeout=10) as http:
                while not stop.is_set():
                    try:
                        r = http.get("/stable")
                        outcomes.append((r.status_code, r.headers.get("x-upstream")))
                    except httpx.HTTPError as exc:
                        outcomes.append((type(exc).__name__, str(exc)))

        slow: list = []
        threading.Thread(target=load, daemon=True).start()
        in_flight = threading.Thread(target=lambda: slow.append(httpx.get(f"{url}/moving?delay=1.5", timeout=10)),
                                     daemon=True)
        in_flight.start()
        probe = httpx.Client(base_url=url, timeout=10)
        assert probe.get("/moving").headers["x-upstream"] == "a"
        time.sleep(0.3)  # the slow request is in flight on the route about to move

        times = {}
        dead_epp = free_port()
        began = publish({"/stable": svc_a, "/moving": svc_b})
        times["route switched to another Service"] = _propagation_s(
            began, lambda: probe.get("/moving").headers.get("x-upstream") == "b")

        pools = {"/v1": PoolBackend("picked", "127.0.0.1", epp.grpc_port, [a.address, b.address],
                                    epp_health_port=epp.health_port),
                 "/open": PoolBackend("open", "127.0.0.1", dead_epp, [b.address], failure_mode_allow=True),
                 "/closed": PoolBackend("closed", "127.0.0.1", dead_epp, [b.address])}
        assert probe.post("/v1/completions", json={"model": "m", "prompt": "hi"}).status_code == 404
        began = publish({"/stable": svc_a, "/moving": svc_b, **pools})

        names = {a.address: "a", b.address: "b"}

        def picked_by_epp() -> bool:  # the EPP's primary choice (first of its list) is the upstream that served
            r = probe.post("/v1/completions", json={"model": "m", "prompt": "hello there", "max_tokens": 2})
            primary = r.headers.get("x-seen-destination", "").split(",")[0]
            return r.status_code == 200 and names.get(primary) == r.headers["x-upstream"]
        times["pools and their routes added at once"] = _propagation_s(began, picked_by_epp)
        # The EPP's choice reached the pool's cluster, which served it. The shared ext_proc filter honours
        # each pool's failure mode: with its EPP down, FailOpen falls back to the pool's endpoints, FailClose fails.
        _propagation_s(time.monotonic(), lambda: probe.get("/open/x").headers.get("x-upstream") == "b", 5)
        assert probe.get("/open/x").headers["x-seen-destination"] == ""
        assert probe.get("/closed/x").status_code >= 500

        began = publish({"/stable": svc_a})
        times["routes and pools removed"] = _propagation_s(began, lambda: probe.get("/moving").status_code == 404)
        in_flight.join(timeout=10)
        stop.set()
        time.sleep(0.2)
        probe.close()

        assert envoy.poll() is None, "Envoy exited"
        assert slow and slow[0].status_code == 200 and slow[0].headers["x-upstream"] == "a"
        failed = [o for o in outcomes if o != (200, "a")]
        assert len(outcomes) > 20 and not failed, failed[:5]
        rejected = _stats(admin, r"update_rejected|update_failure")
        assert rejected and not any(rejected.values()), rejected
        assert _stats(admin, r"cluster_manager\.cds\.update_success")["cluster_manager.cds.update_success"] >= 4
        # Every connection lived through the updates: Envoy closed none, no listener drained or was re-created.
        conns = _stats(admin, rf"^http\.gateway_{port}\.downstream_cx_destroy|^listener_manager\.listener_"
                              r"(added|modified|removed)$|^listener_manager\.total_listeners_draining$")
        assert {k: v for k, v in conns.items() if "local" in k or "listener" in k} == {
            f"http.gateway_{port}.downstream_cx_destroy_local": 0,
            f"http.gateway_{port}.downstream_cx_destroy_local_active_rq": 0, "listener_manager.listener_added": 1,
            "listener_manager.listener_modified": 0, "listener_manager.listener_removed": 0,
            "listener_manager.total_listeners_draining": 0}, conns
        print(f"\n[envoy-propagation] same Envoy pid {envoy.pid}, {len(outcomes)} keep-alive requests, none failed; "
              + "; ".join(f"{what}: {s * 1000:.0f} ms" for what, s in times.items()))
        assert all(s < 5.0 for s in times.values()), times
    except BaseException:
        for name in ("envoy.log", "epp.log"):
            if (tmp_path / name).exists():
                print(f"--- {name}:\n" + (tmp_path / name).read_text(errors="replace")[-4000:])
        raise
    finally:
        stop.set()
        for proc in (envoy,):
            if proc is not None:
                stop_group(proc)
        if epp is not None:
            epp.stop()
        a.stop()
        b.stop()


@pytest.mark.processes
def test_a_pool_whose_epp_returns_lists_gets_retries_over_the_list(samples, tmp_path):
    """pool.returns_lists → the Gateway routes that pool through override_host (hosts: its ready pods) with
    retries; the other pools keep ORIGINAL_DST on the EPP's pick."""
    route, pool = samples["HTTPRoute"], samples["InferencePool"]
    key = (pool["metadata"]["namespace"], pool["metadata"]["name"])
    routing = g.routes_for_gateway(samples["Gateway"], [route], [pool], [], [],
                                   pool_endpoints={key: ["10.0.0.1:8000", "10.0.0.2:8000"]},
                                   fallback_pools=frozenset({key}))
    config = g.render_config(samples["Gateway"], routing)
    _validate(config, tmp_path)
    (listed,) = _routes_of(config)["virtual_hosts"][0]["routes"]
    assert listed["route"]["retry_policy"]["retry_on"] == "connect-failure,refused-stream,reset,retriable-status-codes"
    (cluster,) = [c for c in config[CDS_FILE]["resources"] if c["name"].startswith("pool-")]
    assert "override_host" in json.dumps(cluster["load_balancing_policy"])
    assert len(cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2
    plain = g.render_config(samples["Gateway"], g.routes_for_gateway(samples["Gateway"], [route], [pool], [], []))
    assert [r["name"].rsplit("-", 1)[-1] for r in _routes_of(plain)["virtual_hosts"][0]["routes"]] == [
        "picked", "failopen"]


@pytest.mark.processes
def test_a_pool_gets_routes_that_send_its_epp_what_it_reads_of_responses(samples, tmp_path):
    """pool.response_needs "headers" → that pool's routes send its EPP the response headers only, "none" → nothing
    of the response (the real Envoy accepts both overrides); other pools keep streaming bodies through their EPP."""
    from kvgate.common.envoy_config import REQUEST_ONLY, RESPONSE_HEADERS_ONLY, SHARED_EXT_PROC

    route, pool = samples["HTTPRoute"], samples["InferencePool"]
    key = (pool["metadata"]["namespace"], pool["metadata"]["name"])

    def modes(**kw):
        config = g.render_config(samples["Gateway"], g.routes_for_gateway(samples["Gateway"], [route], [pool], [],
                                                                          [], **kw))
        _validate(config, tmp_path)
        return [r["typed_per_filter_config"][SHARED_EXT_PROC]["config"]["overrides"].get("processing_mode")
                for r in _routes_of(config)["virtual_hosts"][0]["routes"] if "typed_per_filter_config" in r]

    for needs, mode in (("headers", RESPONSE_HEADERS_ONLY), ("none", REQUEST_ONLY)):
        assert modes(response_needs={key: needs}) and all(m == mode for m in modes(response_needs={key: needs}))
    assert modes(response_needs={key: "body"}) and all(m is None for m in modes(response_needs={key: "body"}))
    assert modes() and all(m is None for m in modes())


@pytest.mark.processes
def test_epp_pods_by_ip_are_eds_hosts_so_an_epp_rollout_never_changes_the_cluster(samples, tmp_path):
    """--epp-address-mode pod-ip: the EPP's pods are the hosts of an EDS cluster fed by its own file. An EPP
    rollout (new pod joins, old pod leaves) changes only that file; cds.yaml stays byte-identical, so Envoy
    keeps the cluster (a changed cluster would reset the ext-proc streams in flight on it and start unhealthy)."""
    import dataclasses

    docs = [samples[k] for k in ("Gateway", "HTTPRoute", "InferencePool")]
    docs += p.desired_epp_objects(samples["InferencePool"], IMAGE)
    gateway = samples["Gateway"]
    routing = _route(docs, gateway)

    def with_epp_pods(*hosts):
        rules = [dataclasses.replace(r, backends=[g.WeightedBackend(dataclasses.replace(w.backend, epp_pods=hosts),
                                                                    w.weight) for w in r.backends])
                 for r in routing.rules]
        return g.render_config(gateway, routing._replace(rules=rules))

    old, both, new = (with_epp_pods(("10.0.0.5", 9002, 9003)),
                      with_epp_pods(("10.0.0.5", 9002, 9003), ("10.0.0.6", 9002, 9003)),
                      with_epp_pods(("10.0.0.6", 9002, 9003)))
    eds = "eds-epp-default-demo-pool.yaml"
    assert set(old) == {BOOTSTRAP_FILE, CDS_FILE, rds_file(8080), eds}
    assert old[CDS_FILE] == both[CDS_FILE] == new[CDS_FILE] == with_epp_pods()[CDS_FILE]
    assert old[rds_file(8080)] == new[rds_file(8080)]
    (epp,) = [c for c in old[CDS_FILE]["resources"] if c["name"].startswith("epp-")]
    assert epp["type"] == "EDS" and "load_assignment" not in epp
    # Through the kubelet's `..data`: a pool added later brings its EDS file in the same ConfigMap update, and
    # the top-level link to a new key appears only after the swap that makes Envoy read the new cds.yaml.
    assert epp["eds_cluster_config"]["eds_config"]["path_config_source"]["path"] == f"./..data/{eds}"
    (assignment,) = both[eds]["resources"]
    assert [(e["endpoint"]["address"]["socket_address"]["address"], e["endpoint"]["health_check_config"])
            for e in assignment["endpoints"][0]["lb_endpoints"]] == [("10.0.0.5", {"port_value": 9003}),
                                                                      ("10.0.0.6", {"port_value": 9003})]
    _validate(both, tmp_path / "both")
    _validate(with_epp_pods(), tmp_path / "none")  # no EPP pod ready: no host, still a valid config

    # The cluster lingers after its pool goes (as every cluster does), its EDS file with it.
    before = g.desired_envoy_objects(gateway, both, IMAGE, now=1000.0)[0]
    gone = g.desired_envoy_objects(gateway, g.render_config(gateway, _route([gateway], gateway)), IMAGE,
                                   previous_config_map=before, now=1001.0)[0]
    assert "epp-default-demo-pool" in {c["name"] for c in json.loads(gone["data"][CDS_FILE])["resources"]}
    assert gone["data"][eds] == before["data"][eds]
