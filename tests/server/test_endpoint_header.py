"""`x-kvgate-endpoint` names the address the client reached, also when the server listens on the any-address
(as in every pod the operator makes): the connection's local address, never 0.0.0.0 / ::."""

import socket

import httpx
import pytest

from tests.procs import KvgateServe

pytestmark = pytest.mark.processes

HEADER = "x-kvgate-endpoint"


def reached(address: str, port: int) -> str:
    host = f"[{address}]" if ":" in address else address
    r = httpx.post(f"http://{host}:{port}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    return r.headers[HEADER]


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_any_address_reports_the_address_reached(kvgate_cache):
    with KvgateServe("sim-model", "--backend", "sim", host="0.0.0.0", cache_dir=kvgate_cache) as server:
        assert reached("127.0.0.1", server.port) == f"127.0.0.1:{server.port}"
        # another loopback address reaches the same socket: the header follows the connection, not the server
        assert reached("127.0.0.2", server.port) == f"127.0.0.2:{server.port}"
        r = httpx.get(f"http://127.0.0.2:{server.port}/nope", timeout=10)  # errors carry it too
        assert r.status_code == 404 and r.headers[HEADER] == f"127.0.0.2:{server.port}"


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_any_address(kvgate_cache):
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        port = s.getsockname()[1]
    server = KvgateServe("sim-model", "--backend", "sim", host="::", port=port, cache_dir=kvgate_cache)
    server.url = f"http://[::1]:{port}"  # for its readiness check
    with server:
        assert reached("::1", server.port) == f"[::1]:{server.port}"
        # a dual-stack socket sees IPv4 clients as ::ffff:127.0.0.1; the header names the IPv4 address
        if _dual_stack(server.port):
            assert reached("127.0.0.1", server.port) == f"127.0.0.1:{server.port}"


def test_a_specific_address_is_reported_as_is(sim_server):
    assert reached("127.0.0.1", sim_server.port) == f"127.0.0.1:{sim_server.port}"


def _dual_stack(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False
