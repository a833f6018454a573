"""Every Envoy config the project renders passes the real binary's `--mode validate`."""

import json
import subprocess

import pytest

from kvgate.envoy_config import PoolBackend, Route, envoy_binary, render_direct, render_gateway

CONFIGS = {
    "one-pool-failclose": render_gateway([Route(PoolBackend("p", "127.0.0.1", 9002, ["127.0.0.1:8000"],
                                                            epp_health_port=9003))], "127.0.0.1", 8080, 9901),
    "failopen": render_gateway([Route(PoolBackend("p", "127.0.0.1", 9002, ["127.0.0.1:8000", "127.0.0.2:8000"],
                                                  failure_mode_allow=True))], "127.0.0.1", 8080),
    "two-pools-hosts-paths": render_gateway([
        Route(PoolBackend("a", "epp-a.ns.svc", 9002, []), path_prefix="/a", hostnames=["a.example.com"]),
        Route(PoolBackend("b", "127.0.0.1", 9012, ["127.0.0.3:8000"]), path_prefix="/"),
    ], "0.0.0.0", 8080),
    "direct": render_direct("127.0.0.1", 8081, 9902),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_validates(tmp_path, name):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(CONFIGS[name]))
    r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", str(path)], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


def test_ext_proc_settings():
    config = CONFIGS["failopen"]
    filters = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "http_filters"]
    (ext_proc,) = [f for f in filters if f["name"].startswith("envoy.filters.http.ext_proc")]
    cfg = ext_proc["typed_config"]
    assert cfg["failure_mode_allow"] is True
    assert cfg["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    assert cfg["processing_mode"]["response_body_mode"] == "FULL_DUPLEX_STREAMED"
    names = [f["name"] for f in filters]
    # client-supplied destination headers are stripped before the EPP runs; the router comes last
    assert names[0] == "kvgate.strip-destination" and names[-1] == "envoy.filters.http.router"


def _gateway_files():
    from kvgate.operator.envoy_routes import RouteRule, ServiceBackend, WeightedBackend, render_gateway_files

    fail_open = PoolBackend("open", "epp-open.ns.svc", 9002, ["127.0.0.3:8000"], failure_mode_allow=True,
                            epp_health_port=9003)
    fail_close = PoolBackend("closed", "127.0.0.1", 9012, [], app_protocol="kubernetes.io/h2c")
    web = ServiceBackend("ns-web-80", "web.ns.svc.cluster.local", 80)
    rules = [RouteRule("ns/r/0", 8080, [WeightedBackend(fail_open, 3), WeightedBackend(fail_close, 1)]),
             RouteRule("ns/r/1", 8080, [WeightedBackend(web)], ["a.example.com"], "Exact", "/web"),
             RouteRule("ns/other/0", 9090, [WeightedBackend(None)])]
    return render_gateway_files(rules, [8080, 9090], 9901)


def test_gateway_files_validate(tmp_path):
    """The dynamic file set: the bootstrap loads with the files beside it, and every route table and cluster
    passes validation folded into a static bootstrap (validate mode does not read dynamic resources)."""
    from kvgate.operator.envoy_routes import static_bootstrap

    files = _gateway_files()
    assert sorted(files) == ["cds.yaml", "envoy.yaml", "rds-8080.yaml", "rds-9090.yaml"]
    for name, doc in files.items():
        (tmp_path / name).write_text(json.dumps(doc))
    (tmp_path / "static.json").write_text(json.dumps(static_bootstrap(files)))
    for config in ("envoy.yaml", "static.json"):
        r = subprocess.run([envoy_binary(), "--mode", "validate", "-c", config], cwd=tmp_path, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr


def test_gateway_files_share_one_ext_proc_filter():
    """Pools come and go without touching the listeners: one disabled ext_proc filter, switched on per route
    with the pool's EPP cluster and failure mode."""
    files = _gateway_files()
    listeners = files["envoy.yaml"]["static_resources"]["listeners"]
    assert [l["name"] for l in listeners] == ["gateway-8080", "gateway-9090"]
    for listener in listeners:
        filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
        assert [f["name"] for f in filters] == ["kvgate.strip-destination", "envoy.filters.http.ext_proc",
                                                "kvgate.primary-destination", "envoy.filters.http.router"]
        assert filters[1]["disabled"] is True
        assert filters[1]["typed_config"]["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    (route_config,) = files["rds-8080.yaml"]["resources"]
    overrides = {r["name"]: r["typed_per_filter_config"]["envoy.filters.http.ext_proc"]["config"]["overrides"]
                 for vh in route_config["virtual_hosts"] for r in vh["routes"] if "typed_per_filter_config" in r}
    assert {name: (o["grpc_service"]["envoy_grpc"]["cluster_name"], o["failure_mode_allow"])
            for name, o in overrides.items()} == {
        "ns/r/0/0-picked": ("epp-open", True), "ns/r/0/0-fallback": ("epp-open", True),
        "ns/r/0/1-picked": ("epp-closed", False), "ns/r/0/1-fallback": ("epp-closed", False)}
    clusters = {c["name"]: c for c in files["cds.yaml"]["resources"]}
    assert sorted(clusters) == ["epp-closed", "epp-open", "pool-closed", "pool-closed-fallback", "pool-open",
                                "pool-open-fallback", "svc-ns-web-80"]
    assert clusters["pool-open"]["type"] == "ORIGINAL_DST" and clusters["epp-open"]["health_checks"]
