"""SIGTERM drains: /health and /metrics 503 at once, new requests 503, running streams finish within
--shutdown-timeout (or end with a clean error when it runs out), then the server exits."""

import json
import signal
import threading
import time

import httpx
import pytest

from tests.procs import KvgateServe

pytestmark = pytest.mark.processes


class Stream(threading.Thread):
    """A streaming completion read in a thread: its tokens, its error event, whether [DONE] came."""

    def __init__(self, url: str, max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.tokens, self.error, self.done, self.finish_reason = 0, None, False, None
        self.started = threading.Event()

    def run(self) -> None:
        with httpx.stream("POST", self.url + "/v1/completions", timeout=60, json={
                "prompt": "tell me everything", "max_tokens": self.max_tokens, "ignore_eos": True,
                "stream": True}) as r:
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    self.done = True
                    return
                event = json.loads(line[6:])
                if "error" in event:
                    self.error = event["error"]
                    continue
                self.tokens += 1
                self.finish_reason = event["choices"][0]["finish_reason"] or self.finish_reason
                self.started.set()


def _wait_exit(server: KvgateServe, timeout: float) -> float:
    start = time.monotonic()
    while server.proc.poll() is None and time.monotonic() - start < timeout:
        time.sleep(0.05)
    assert server.proc.poll() is not None, f"the server did not exit in {timeout} s:\n{server.log()}"
    return time.monotonic()


def test_sigterm_drains_running_streams_then_exits(kvgate_cache):
    # ~6 ms a token: this stream runs ~9 s, past the checks below on a loaded machine (at 400 tokens, ~2.5 s, it once
    # ended before them) and within the 20 s grace
    server = KvgateServe("sim", "--backend", "sim", "--shutdown-timeout", "20", cache_dir=kvgate_cache)
    try:
        server.wait_ready()
        stream = Stream(server.url, max_tokens=1500)
        stream.start()
        assert stream.started.wait(10)
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        deadline = sent + 0.5
        while httpx.get(server.url + "/health", timeout=1).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 0.5 s after SIGTERM"
            time.sleep(0.01)
        assert httpx.get(server.url + "/health").json()["error"]["message"] == "the server is shutting down"
        assert httpx.get(server.url + "/metrics").status_code == 503  # the EPP's scrape fails: it stops routing
        assert httpx.get(server.url + "/live").status_code == 200  # draining is alive: no liveness restart
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "new", "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert server.proc.poll() is None and stream.is_alive(), "the running stream must be let finish"
        stream.join(30)
        assert stream.done and stream.error is None and stream.tokens == 1500 and stream.finish_reason == "length"
        exited = _wait_exit(server, 10)
        assert exited - sent < 20, "exits once its streams are done, not at the end of the grace period"
        assert server.proc.returncode in (0, -signal.SIGTERM)
    finally:
        server.stop()


def test_streams_still_running_at_the_deadline_end_with_an_error(kvgate_cache):
    server = KvgateServe("sim", "--backend", "sim", "--shutdown-timeout", "1", cache_dir=kvgate_cache)
    try:
        server.wait_ready()
        stream = Stream(server.url, max_tokens=5000)  # ~30 s: cannot finish in the 1 s grace
        stream.start()
        assert stream.started.wait(10)
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        stream.join(10)
        ended = time.monotonic()
        assert not stream.is_alive() and stream.done
        assert stream.error is not None and stream.error["code"] == 503, stream.error
        assert "--shutdown-timeout" in stream.error["message"]
        assert 0.9 < ended - sent < 3.0, ended - sent
        _wait_exit(server, 10)
    finally:
        server.stop()
