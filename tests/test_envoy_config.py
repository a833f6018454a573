"""Every Envoy config the project renders passes the real binary's `--mode validate`, has only finite timeouts
and explicit limits, and uses stock filters only."""

import json
import subprocess

import pytest

from kvgate.common.envoy_config import (CircuitBreakers, EnvoyTracing, ListenerTimeouts, PoolBackend, RouteTimeouts,
                                 envoy_binary, pool_clusters, render_direct, render_round_robin)
from kvgate.common.gateway_routes import RouteRule, WeightedBackend, render_pool_gateway, render_static_gateway
from kvgate.common.epp_protocol import DESTINATION_KEY, DESTINATION_NAMESPACE

CONFIGS = {
    "one-pool-failclose": render_pool_gateway(PoolBackend("p", "127.0.0.1", 9002, ["127.0.0.1:8000"],
                                                          epp_health_port=9003), "127.0.0.1", 8080, 9901),
    "failopen": render_pool_gateway(PoolBackend("p", "127.0.0.1", 9002, ["127.0.0.1:8000", "127.0.0.2:8000"],
                                                failure_mode_allow=True), "127.0.0.1", 8080),
    "two-pools-hosts-paths": render_static_gateway([
        RouteRule("ns/a/0", 8080, [WeightedBackend(PoolBackend("a", "epp-a.ns.svc", 9002, []))],
                  hostnames=["a.example.com"], path_value="/a"),
        RouteRule("ns/b/0", 8080, [WeightedBackend(PoolBackend("b", "127.0.0.1", 9012,
                                                               ["127.0.0.3:8000", "[::1]:8000"]))]),
    ], "0.0.0.0"),
    "fallbacks": render_pool_gateway(PoolBackend("p", "127.0.0.1", 9002, ["127.0.0.1:8000", "127.0.0.2:8000"],
                                                 failure_mode_allow=True, fallbacks=True), "127.0.0.1", 8080),
    "tuned": render_pool_gateway(PoolBackend("t", "127.0.0.1", 9002, ["127.0.0.1:8000"], stream_idle_s=900,
                                             circuit_breakers=CircuitBreakers(max_requests=5000), fallbacks=True),
                                 "127.0.0.1", 8080, route_timeouts=RouteTimeouts(request_s=3600, backend_request_s=120),
                                 listener_timeouts=ListenerTimeouts(request_headers_s=5, stream_idle_s=60)),
    "traced": render_pool_gateway(PoolBackend("p", "127.0.0.1", 9002, ["127.0.0.1:8000"], epp_health_port=9003),
                                  "127.0.0.1", 8080, 9901,
                                  tracing=EnvoyTracing.from_endpoint("http://otel-collector.monitoring:4317", 0.1)),
    "direct": render_direct("127.0.0.1", 8081, 9902),
    "round-robin": render_round_robin("127.0.0.1", 8082, ["127.0.0.2:8000", "127.0.0.3:8000"], 9903),
}


def _walk(doc, path=""):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _walk(v, f"{path}.{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _walk(v, f"{path}[{i}]")
    else:
        yield path, doc


def assert_safe(config: dict) -> None:
    """No disabled ("0s") timeout, no Lua, and every upstream cluster of endpoints has explicit circuit breakers."""
    zero = [p for p, v in _walk(config) if isinstance(v, str) and v in ("0s", "0.0s", "0.000s")]
    assert not zero, zero
    assert "lua" not in json.dumps(config).lower()
    for cluster in config["static_resources"]["clusters"]:
        if not cluster["name"].startswith("epp-"):
            assert cluster["circuit_breakers"]["thresholds"][0]["max_requests"] > 1024, cluster["name"]


@pytest.mark.processes
@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_validates_and_is_safe(tmp_path, name):
    assert_safe(CONFIGS[name])
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(CONFIGS[name]))
    r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def _hcm(config):
    return config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def test_defaults_are_finite_and_documented():
    hcm = _hcm(CONFIGS["one-pool-failclose"])
    assert (hcm["request_headers_timeout"], hcm["stream_idle_timeout"]) == ("10s", "300s")
    for route in hcm["route_config"]["virtual_hosts"][0]["routes"]:  # the EPP's pick, and FailOpen
        assert route["route"]["timeout"] == "600s" and "idle_timeout" not in route["route"]
        assert "retry_policy" not in route["route"]  # ORIGINAL_DST would retry the same address
    clusters = {c["name"]: c for c in CONFIGS["one-pool-failclose"]["static_resources"]["clusters"]}
    assert clusters["pool-p"]["circuit_breakers"]["thresholds"] == [{
        "priority": "DEFAULT", "max_connections": 100000, "max_pending_requests": 100000, "max_requests": 100000,
        "max_retries": 1000}]
    check = clusters["epp-p"]["health_checks"][0]
    assert (check["unhealthy_threshold"], check["timeout"], check["interval"]) == (3, "2s", "1s")
    # idle connections to the engines close on Envoy's side, before the engines' keep-alive (uvicorn's) closes one
    # under a request (tests/epp/test_gateway.py watches it happen)
    import uvicorn

    from kvgate.common.envoy_config import UPSTREAM_IDLE_S
    assert UPSTREAM_IDLE_S < uvicorn.Config(app=None).timeout_keep_alive
    for name in ("pool-p", "pool-p-failopen"):
        options = clusters[name]["typed_extension_protocol_options"][
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
        assert options["common_http_protocol_options"] == {"idle_timeout": "4s"}
        assert options["explicit_http_config"] == {"http_protocol_options": {}}
    h2c = render_pool_gateway(PoolBackend("h", "127.0.0.1", 9002, ["127.0.0.1:8000"], app_protocol="kubernetes.io/h2c",
                                          upstream_idle_s=2.5), "127.0.0.1", 8080)
    (pool,) = [c for c in h2c["static_resources"]["clusters"] if c["name"] == "pool-h"]
    options = pool["typed_extension_protocol_options"]["envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]
    assert options["explicit_http_config"] == {"http2_protocol_options": {}}
    assert options["common_http_protocol_options"] == {"idle_timeout": "2.5s"}


def test_the_example_gateway_is_a_current_rendering():
    """envoy/example-gateway.yaml (what the docs show) is what render_pool_gateway renders today."""
    from pathlib import Path

    import yaml

    example = Path(__file__).parent.parent / "envoy" / "example-gateway.yaml"
    pool = PoolBackend("default-demo-pool", "demo-pool-epp.default.svc.cluster.local", 9002,
                       ["10.0.0.11:8000", "10.0.0.12:8000"], epp_health_port=9003)
    assert yaml.safe_load(example.read_text()) == render_pool_gateway(pool, "0.0.0.0", 8080, 19000)


def test_tuned_limits_reach_the_config():
    hcm = _hcm(CONFIGS["tuned"])
    assert (hcm["request_headers_timeout"], hcm["stream_idle_timeout"]) == ("5s", "60s")
    (route,) = hcm["route_config"]["virtual_hosts"][0]["routes"]
    assert (route["route"]["timeout"], route["route"]["idle_timeout"]) == ("3600s", "900s")
    assert route["route"]["retry_policy"]["per_try_timeout"] == "120s"
    (pool,) = [c for c in CONFIGS["tuned"]["static_resources"]["clusters"] if c["name"] == "pool-t"]
    assert pool["circuit_breakers"]["thresholds"][0]["max_requests"] == 5000


def test_stock_filters_and_the_pool_clusters():
    """ext_proc (disabled, switched on per route), the served-endpoint rule after it, the router. A pool's
    "picked" route matches once the EPP's pick is in the metadata (never a client's header) and goes to an
    ORIGINAL_DST cluster reading that metadata; without it (FailOpen, the EPP down) least-request over the pool."""
    config = CONFIGS["failopen"]
    filters = _hcm(config)["http_filters"]
    assert [f["name"] for f in filters] == ["envoy.filters.http.ext_proc", "envoy.filters.http.header_to_metadata",
                                            "envoy.filters.http.router"]
    ext_proc = filters[0]["typed_config"]
    assert filters[0]["disabled"] is True
    assert ext_proc["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert ext_proc["processing_mode"]["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert ext_proc["metadata_options"]["forwarding_namespaces"] == {"untyped": [DESTINATION_NAMESPACE]}
    assert ext_proc["metadata_options"]["receiving_namespaces"] == {"untyped": [DESTINATION_NAMESPACE]}
    picked, failopen = _hcm(config)["route_config"]["virtual_hosts"][0]["routes"]
    for route in (picked, failopen):
        overrides = route["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["config"]["overrides"]
        assert overrides["failure_mode_allow"] is True
        assert overrides["grpc_service"]["envoy_grpc"]["cluster_name"] == "epp-p"
    assert picked["match"]["dynamic_metadata"] == [{"filter": DESTINATION_NAMESPACE, "path": [{"key": DESTINATION_KEY}],
                                                    "value": {"present_match": True}}]
    assert "headers" not in picked["match"] and "dynamic_metadata" not in failopen["match"]
    clusters = {c["name"]: c for c in config["static_resources"]["clusters"]}
    assert picked["route"]["cluster"] == "pool-p" and failopen["route"]["cluster"] == "pool-p-failopen"
    assert clusters["pool-p"]["type"] == "ORIGINAL_DST"
    assert clusters["pool-p"]["original_dst_lb_config"] == {"metadata_key": {"key": DESTINATION_NAMESPACE,
                                                                             "path": [{"key": DESTINATION_KEY}]}}
    assert clusters["pool-p-failopen"]["lb_policy"] == "LEAST_REQUEST"
    assert len(clusters["pool-p-failopen"]["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2


def test_fallbacks_route_through_override_host_with_retries():
    """An EPP that answers with a list: one route per pool whose retries walk the list (override_host)."""
    config = CONFIGS["fallbacks"]
    (route,) = _hcm(config)["route_config"]["virtual_hosts"][0]["routes"]
    assert route["route"]["retry_policy"]["retry_on"] == "connect-failure,refused-stream,reset,retriable-status-codes"
    assert route["route"]["retry_policy"]["retriable_status_codes"] == [503]
    (pool,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "pool-p"]
    (policy,) = pool["load_balancing_policy"]["policies"]
    override = policy["typed_extension_config"]["typed_config"]
    assert override["override_host_sources"] == [{"metadata": {"key": DESTINATION_NAMESPACE,
                                                               "path": [{"key": DESTINATION_KEY}]}}]
    assert "least_request" in json.dumps(override["fallback_policy"])
    assert len(pool["load_assignment"]["endpoints"][0]["lb_endpoints"]) == 2


def _gateway_files():
    from kvgate.common.gateway_routes import RouteRule, ServiceBackend, WeightedBackend, render_gateway_files

    fail_open = PoolBackend("open", "epp-open.ns.svc", 9002, ["127.0.0.3:8000"], failure_mode_allow=True,
                            epp_health_port=9003)
    fail_close = PoolBackend("closed", "127.0.0.1", 9012, [], app_protocol="kubernetes.io/h2c")
    web = ServiceBackend("ns-web-80", "web.ns.svc.cluster.local", 80)
    rules = [RouteRule("ns/r/0", 8080, [WeightedBackend(fail_open, 3), WeightedBackend(fail_close, 1)]),
             RouteRule("ns/r/1", 8080, [WeightedBackend(web)], ["a.example.com"], "Exact", "/web"),
             RouteRule("ns/other/0", 9090, [WeightedBackend(None)])]
    return render_gateway_files(rules, [8080, 9090], 9901)


@pytest.mark.processes
def test_gateway_files_validate(tmp_path):
    """The dynamic file set: the bootstrap loads with the files beside it, and every route table and cluster
    passes validation folded into a static bootstrap (validate mode does not read dynamic resources)."""
    from kvgate.common.gateway_routes import static_bootstrap

    files = _gateway_files()
    assert sorted(files) == ["cds.yaml", "envoy.yaml", "rds-8080.yaml", "rds-9090.yaml"]
    for name, doc in files.items():
        (tmp_path / name).write_text(json.dumps(doc))
    static = static_bootstrap(files)
    assert_safe(static)
    (tmp_path / "static.json").write_text(json.dumps(static))
    for config in ("envoy.yaml", "static.json"):
        r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", config], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def test_gateway_files_share_kvgate_up_s_data_plane():
    """The operator's listeners carry the same filters as `kvgate up`'s (one renderer); pools come and go without
    touching them: one disabled ext_proc filter, switched on per route with the pool's EPP and failure mode."""
    files = _gateway_files()
    listeners = files["envoy.yaml"]["static_resources"]["listeners"]
    assert [l["name"] for l in listeners] == ["gateway-8080", "gateway-9090"]
    for listener in listeners:
        hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
        assert hcm["http_filters"] == _hcm(CONFIGS["one-pool-failclose"])["http_filters"]
    (route_config,) = files["rds-8080.yaml"]["resources"]
    overrides = {r["name"]: r["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["config"]["overrides"]
                 for vh in route_config["virtual_hosts"] for r in vh["routes"] if "typed_per_filter_config" in r}
    assert {name: (o["grpc_service"]["envoy_grpc"]["cluster_name"], o["failure_mode_allow"])
            for name, o in overrides.items()} == {"ns/r/0/0-pool-picked": ("epp-open", True),
                                                  "ns/r/0/0-pool-failopen": ("epp-open", True),
                                                  "ns/r/0/1-pool-picked": ("epp-closed", False),
                                                  "ns/r/0/1-pool-failopen": ("epp-closed", False)}
    clusters = {c["name"]: c for c in files["cds.yaml"]["resources"]}
    assert sorted(clusters) == ["epp-closed", "epp-open", "pool-closed", "pool-closed-failopen", "pool-open",
                                "pool-open-failopen", "svc-ns-web-80"]
    assert clusters["pool-open"]["type"] == "ORIGINAL_DST"
    assert clusters["epp-open"]["health_checks"]


def test_kvgate_up_limit_flags():
    """`kvgate up`'s Envoy flags reach the config it renders; zero or negative values are refused."""
    import argparse

    from kvgate.stack.up import add_up_parser, envoy_limits

    parser = argparse.ArgumentParser()
    add_up_parser(parser.add_subparsers())
    route, listener, breakers = envoy_limits(parser.parse_args(["up"]))
    assert (route, listener, breakers) == (RouteTimeouts(), ListenerTimeouts(), CircuitBreakers())
    args = parser.parse_args(["up", "--request-timeout", "1800", "--stream-idle-timeout", "120",
                              "--request-headers-timeout", "5", "--max-requests", "4096", "--max-retries", "10"])
    route, listener, breakers = envoy_limits(args)
    config = render_pool_gateway(PoolBackend("local", "127.0.0.1", 1, ["127.0.0.1:2"], circuit_breakers=breakers),
                                 "127.0.0.1", 3, route_timeouts=route, listener_timeouts=listener)
    assert_safe(config)
    hcm = _hcm(config)
    assert (hcm["request_headers_timeout"], hcm["stream_idle_timeout"]) == ("5s", "120s")
    assert hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["timeout"] == "1800s"
    (pool,) = [c for c in config["static_resources"]["clusters"] if c["name"] == "pool-local"]
    assert pool["circuit_breakers"]["thresholds"][0]["max_requests"] == 4096
    with pytest.raises(SystemExit):
        parser.parse_args(["up", "--request-timeout", "0"])


@pytest.mark.parametrize("fail_open", [False, True])
def test_the_epp_cluster_leaves_a_dead_epp_and_panics_only_as_the_failure_mode_allows(fail_open):
    """Every EPP cluster ejects a host at its first connect failure or reset (another replica takes the next
    stream); FailOpen never sends to an unhealthy EPP (its route serves without one), FailClose sends to them all
    while none is healthy (a draining EPP Envoy's list still names alone serves; a dead one's 500 is the same)."""
    pool = PoolBackend("p", "127.0.0.1", 9002, ["127.0.0.1:8000"], failure_mode_allow=fail_open, epp_health_port=9003)
    (epp,) = [c for c in pool_clusters(pool) if c["name"] == "epp-p"]
    assert epp["outlier_detection"]["consecutive_local_origin_failure"] == 1
    assert epp["common_lb_config"]["healthy_panic_threshold"]["value"] == (0 if fail_open else 1)
