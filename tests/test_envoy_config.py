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
