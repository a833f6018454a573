"""`kvgate epp --endpoints-file` as a real process behind the real Envoy: bad edits of the file are logged and
skipped, and the EPP keeps serving the last good set through them."""

import re
import subprocess
import time

import httpx
import pytest

from kvgate.common.envoy_config import PoolBackend
from kvgate.common.gateway_routes import render_pool_gateway
from tests.gateway import EPP, Envoy
from tests.procs import KVGATE, KvgateServe, free_port

pytestmark = pytest.mark.processes

SERVED_BY = "x-kvgate-endpoint"


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    cache = tmp_path_factory.mktemp("kvgate-cache")
    started = [KvgateServe("sim-model", "--backend", "sim", cache_dir=cache) for _ in range(2)]
    try:
        for e in started:
            e.wait_ready()
        yield [f"127.0.0.1:{e.port}" for e in started]
    finally:
        for e in started:
            e.stop()


def served_by(url: str, n: int = 8) -> set[str]:
    """n requests through the gateway: every one must succeed; which engines answered."""
    served = set()
    for i in range(n):
        r = httpx.post(url + "/v1/completions", json={"model": "sim-model", "prompt": f"p{i}", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200, r.text
        served.add(r.headers[SERVED_BY])
    return served


def wait_served_by(url: str, want: set[str], epp: EPP, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert epp.alive(), f"the EPP died:\n{epp.log()}"
        got = served_by(url)
        if got == want:
            return
        assert time.monotonic() < deadline, f"served by {got}, want {want}:\n{epp.log()}"
        time.sleep(0.2)


def epp_endpoints(epp: EPP) -> set[str]:
    """The endpoints the EPP holds, from its per-endpoint metrics."""
    return set(re.findall(r'kvgate_epp_endpoint_stale\{endpoint="([^"]+)"\}', epp.metrics()))


def hold(url: str, want: set[str], epp: EPP, seconds: float = 1.5) -> None:
    """For a few polls of the file (every 0.5 s): the EPP stays up, holds `want` and serves from it."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert epp.alive(), f"the EPP died:\n{epp.log()}"
        assert served_by(url, 4) <= want
        assert epp_endpoints(epp) == want


def test_the_epp_keeps_serving_through_bad_edits(tmp_path, engines):
    a, b = engines
    f = tmp_path / "endpoints.txt"
    f.write_text(f"{a}\n")
    epp = EPP(tmp_path, endpoints_file=f)
    envoy = None
    try:
        port, admin = free_port(), free_port()
        pool = PoolBackend("test", "127.0.0.1", epp.grpc_port, engines, epp_health_port=epp.health_port)
        envoy = Envoy(tmp_path, render_pool_gateway(pool, "127.0.0.1", port, admin), admin)
        url = f"http://127.0.0.1:{port}"
        wait_served_by(url, {a}, epp)

        # a trailing comment is fine; a malformed line is reported (file:line) and skipped
        f.write_text(f"{a}  # replica a\n{b}\nnot-an-endpoint\n")
        wait_served_by(url, {a, b}, epp)
        assert f"{f}:3: endpoint 'not-an-endpoint' is not ip:port; line skipped" in epp.log_path.read_text()

        # unreadable in several ways: the last good set keeps serving, each problem logged once
        f.write_bytes(f"{a}\n\xff\n".encode("latin-1"))
        hold(url, {a, b}, epp)
        f.unlink()
        hold(url, {a, b}, epp)
        f.mkdir()
        hold(url, {a, b}, epp)
        log = epp.log_path.read_text()
        assert log.count("not UTF-8 text") == 1 and log.count("No such file or directory") == 1
        assert log.count("not a regular file") == 1 and "keeping the last good set of 2 endpoints" in log

        # a good file again is used at once
        f.rmdir()
        f.write_text(f"{b}\n")
        wait_served_by(url, {b}, epp)
    finally:
        if envoy is not None:
            envoy.stop()
        epp.stop()


def test_endpoints_on_the_command_line_stay_strict():
    out = subprocess.run([KVGATE, "epp", "--endpoints", "127.0.0.1:1,localhost:2"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0 and "kvgate epp: endpoint 'localhost:2': 'localhost' is not an IP address" in out.stderr
