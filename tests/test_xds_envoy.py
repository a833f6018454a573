"""The operator's ADS server against the real Envoy binary: Envoy boots from the minimal xDS bootstrap, ACKs,
a weight change 100/0 -> 0/100 across two backends applies under traffic with no failed request, an invalid
cluster is NACKed with Envoy's error text while the last good config keeps serving, and a restarted server
changes nothing in the serving Envoy."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from kvgate.common.envoy_config import envoy_binary
from kvgate.common.gateway_routes import CDS_FILE, RouteRule, ServiceBackend, WeightedBackend, render_gateway_files
from kvgate.operator.gateway import retain_retired_clusters
from kvgate.operator.xds.ads_server import AdsServer
from kvgate.operator.xds.snapshot import CLUSTER, Snapshot
from kvgate.operator.xds.snapshot_cache import SnapshotCache
from kvgate.operator.xds.xds_files import XdsAddress, xds_files
from tests.procs import free_port, stop_group

pytestmark = pytest.mark.processes
NODE = "ns/gw"


def _backend(text: bytes) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":  # b's cluster warms this long (its first health check) once added
                time.sleep(0.5)
            self.send_response(200)
            self.send_header("content-length", str(len(text)))
            self.end_headers()
            self.wfile.write(text)

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class Reports:
    def __init__(self) -> None:
        self.items: list[tuple[str, str, str, str]] = []
        self.cond = threading.Condition()

    def __call__(self, node, envoy, version, error) -> None:
        with self.cond:
            self.items.append((node, envoy, version, error))
            self.cond.notify_all()

    def wait(self, version: str, error: bool = False, timeout: float = 60.0) -> tuple:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for item in self.items:
                    if item[2] == version and bool(item[3]) == error:
                        return item
                left = deadline - time.monotonic()
                assert left > 0, f"no {'NACK' if error else 'ACK'} of {version}: {self.items}"
                self.cond.wait(left)


def _files(a: ServiceBackend, b: ServiceBackend, weights: tuple[int, int], port: int, xds_port: int,
           previous: dict | None = None) -> dict:
    rule = RouteRule("ns/r/0", port, [WeightedBackend(a, weights[0]), WeightedBackend(b, weights[1])])
    files = xds_files(render_gateway_files([rule], [port], free_port(), "127.0.0.1", node_id=NODE),
                      XdsAddress("127.0.0.1", xds_port))
    # What the operator does when routes leave a cluster: it lingers in the config (the ConfigMap's cds.yaml)
    previous_map = {"data": {CDS_FILE: json.dumps(previous[CDS_FILE])}} if previous else None
    out = retain_retired_clusters(files, previous_map, time.time())[0]
    for cluster in out[CDS_FILE]["resources"]:  # a cluster that warms, as a pool's EPP cluster does
        if cluster["name"] == "svc-b":
            cluster["health_checks"] = [{"timeout": "2s", "interval": "1s", "unhealthy_threshold": 3,
                                         "healthy_threshold": 1, "http_health_check": {"path": "/health"}}]
    return out


def test_envoy_over_ads(tmp_path):
    servers = [_backend(b"a"), _backend(b"b")]
    a, b = (ServiceBackend(n, "127.0.0.1", s.server_address[1]) for n, s in zip("ab", servers))
    cache, reports = SnapshotCache(), Reports()
    xds = AdsServer(cache, "127.0.0.1", 0, on_status=reports)
    xds_port = xds.start()
    listen = free_port()
    first = _files(a, b, (100, 0), listen, xds_port)
    cache.set(NODE, Snapshot.from_files(first))
    (tmp_path / "envoy.yaml").write_text(json.dumps(first["envoy.yaml"]))
    log = open(tmp_path / "envoy.log", "wb")
    envoy = subprocess.Popen([envoy_binary(), "-c", "envoy.yaml", "--disable-hot-restart", "--log-level", "warn",
                              "--config-yaml", json.dumps({"node": {"metadata": {"pod": "envoy-0"}}})],
                             cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    results: list[tuple[float, int, str]] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=10) as client:
            while not stop.is_set():
                started = time.monotonic()
                try:
                    r = client.get(f"http://127.0.0.1:{listen}/x")
                    results.append((started, r.status_code, r.text))
                except httpx.HTTPError as exc:
                    results.append((started, 0, str(exc)))
                time.sleep(0.005)

    loader = threading.Thread(target=load)
    try:
        node, who, _, _ = reports.wait(cache.get(NODE).version)
        assert (node, who) == (NODE, "envoy-0")
        deadline = time.monotonic() + 30
        while not httpx.get(f"http://127.0.0.1:{listen}/x").text == "a":  # ACKed: the listener serves
            assert time.monotonic() < deadline and envoy.poll() is None, (tmp_path / "envoy.log").read_text()
            time.sleep(0.1)
        loader.start()
        time.sleep(1.0)

        # 100/0 -> 0/100: b's cluster arrives (and is ACKed) before the routes that use it, and warms for its first
        # health check; a's lingers.
        second = _files(a, b, (0, 100), listen, xds_port, previous=first)
        snapshot = Snapshot.from_files(second)
        assert set(snapshot.resources[CLUSTER]) == {"svc-a", "svc-b"}
        applied = time.monotonic()
        cache.set(NODE, snapshot)
        reports.wait(snapshot.version)
        time.sleep(1.5)

        # An invalid cluster: NACKed with Envoy's words; the last good config serves on.
        bad = json.loads(json.dumps(second))
        bad[CDS_FILE]["resources"][0]["connect_timeout"] = "0s"
        bad_snapshot = Snapshot.from_files(bad)
        cache.set(NODE, bad_snapshot)
        _, _, _, error = reports.wait(bad_snapshot.version, error=True)
        assert "connect_timeout" in error and len(error) <= 1100, error

        # A restarted server (same port, same snapshot): Envoy reconnects and is sent nothing it lacks.
        cache.set(NODE, snapshot)
        xds.stop()
        xds = AdsServer(cache, "127.0.0.1", xds_port, on_status=reports)
        reports.items.clear()
        xds.start()
        reports.wait(snapshot.version, timeout=90)
        time.sleep(1.0)
    finally:
        stop.set()
        if loader.is_alive():
            loader.join(15)
        stop_group(envoy)
        log.close()
        xds.stop()
        for server in servers:
            server.shutdown()

    failed = [r for r in results if r[1] != 200]
    assert not failed, failed[:5]
    late = [r for r in results if r[0] > applied + 1.0 and r[2] != "b"]
    assert not late, f"{len(late)} requests after the change went to a: {late[:3]}"
    assert any(r[2] == "a" for r in results) and any(r[0] > applied + 1.0 for r in results)
