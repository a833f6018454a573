"""A client that stops reading cannot pin a running generation (its KV blocks and queued outputs) forever:
once its socket buffers are full and nothing has been read for --client-stall-timeout, the response is cut
and the request aborted."""

import socket
import time

import httpx
import pytest

from tests.procs import KvgateServe, scrape

pytestmark = pytest.mark.processes

STALL_TIMEOUT = 1.0


def test_a_client_that_stops_reading_is_cut_and_its_request_aborted(kvgate_cache):
    # Fast steps and big chunks (n=32 samples with 20 logprobs each) fill the socket buffers in well under a
    # second; the whole generation (8000 tokens x 32 samples) would take over 15 s.
    with KvgateServe("sim", "--backend", "sim", "--sim-step-overhead-ms", "0.5", "--client-stall-timeout",
                     str(STALL_TIMEOUT), cache_dir=kvgate_cache) as server:
        body = (b'{"prompt": "stall", "max_tokens": 8000, "ignore_eos": true, "stream": true, "n": 32, '
                b'"logprobs": 20}')
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((server.host, server.port))
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            sock.recv(1024)  # the response has started; from now on the client reads nothing
            started = time.monotonic()
            deadline = started + 10
            while scrape(server.url)["vllm:num_requests_running"] < 32:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            while scrape(server.url)["vllm:num_requests_running"] > 0:
                assert time.monotonic() < deadline, "the stalled request was still generating after 10 s"
                time.sleep(0.05)
            freed = time.monotonic() - started
            m = scrape(server.url)
            assert m["vllm:kv_cache_usage_perc"] == 0
            assert m.get("vllm:request_success_total{finished_reason=length}", 0) == 0  # aborted, not finished
            assert m["vllm:request_success_total{finished_reason=abort}"] == 32
            assert freed < STALL_TIMEOUT + 4, freed
            print(f"\nstalled client: request aborted {freed:.2f} s after the client stopped reading")
            # the connection was closed by the server: draining what the buffers hold ends with EOF
            sock.settimeout(10)
            while sock.recv(1 << 20):
                pass
        finally:
            sock.close()
        assert "--client-stall-timeout" in server.log()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "next", "max_tokens": 3}, timeout=10)
        assert r.status_code == 200
