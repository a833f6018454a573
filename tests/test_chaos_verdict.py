"""The chaos rows' judging, without a stack: `epp-replica-streams` (bench/chaos/runner.py `verdict`) and how the
`epp-kill-active-active` fault counts the streams the killed EPP carried (Envoy's /clusters `rq_active` for its
host, bench/chaos/faults.py), against a stand-in admin page on loopback."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvgate.bench.chaos.faults import _envoy_streams_to
from kvgate.bench.chaos.runner import Row, verdict


def _row(failed: int, held: int | None, recover_s: float | None = 4.0) -> Row:
    return Row("epp-kill-active-active", "", 300, 300 - failed, failed, held, failed, 0.05, recover_s,
               "epp-replica-streams", False)


def test_epp_replica_streams_allows_what_it_carried_plus_one_a_worker():
    assert verdict("epp-replica-streams", _row(failed=9, held=9), epp_streams=100, concurrency=100)
    assert verdict("epp-replica-streams", _row(failed=109, held=9), epp_streams=100, concurrency=100)
    assert not verdict("epp-replica-streams", _row(failed=110, held=9), epp_streams=100, concurrency=100)
    assert not verdict("epp-replica-streams", _row(failed=0, held=None), epp_streams=100, concurrency=100)  # uncounted
    assert not verdict("epp-replica-streams", _row(failed=0, held=9, recover_s=None), epp_streams=100,
                       concurrency=100)  # never back in Envoy's rotation


CLUSTERS = """epp-local::default_priority::max_requests::1024
epp-local::127.0.0.1:40001::cx_active::2
epp-local::127.0.0.1:40001::rq_active::17
epp-local::127.0.0.1:40001::health_flags::healthy
epp-local::127.0.0.1:40002::cx_active::2
epp-local::127.0.0.1:40002::rq_active::5
pool-local::127.0.0.1:40002::rq_active::99
"""


@pytest.fixture
def admin():
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            body = CLUSTERS.encode()
            self.send_response(200 if self.path == "/clusters" else 404)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_envoy_streams_to_reads_the_epp_hosts_rq_active(admin):
    assert _envoy_streams_to(admin, "epp-local", 40001) == 17
    assert _envoy_streams_to(admin, "epp-local", 40002) == 5  # not the pool cluster's host on the same port
    assert _envoy_streams_to(admin, "epp-local", 40003) is None  # no such host


def test_envoy_streams_to_without_an_admin_answer_is_none():
    import socket

    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        assert _envoy_streams_to(s.getsockname()[1], "epp-local", 40001) is None
