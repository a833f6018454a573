"""Timeouts through the whole stack (`kvgate up`: engine, EPP, Envoy), with short bounds set by its flags:

- a stalled engine (it accepts and reads the request, passes every scrape, never answers: the sim backend's
  `--sim-hang-after-steps 1` with the engine's own watchdog set far away) cannot hold a gateway connection
  past `--request-timeout` (no headers yet: 504; headers sent: the stream is cut) or, with nothing moving,
  `--stream-idle-timeout` (no headers: 504 "stream timeout"; headers sent: the stream is cut);
- a client that stops reading cannot pin the engine's memory: Envoy's flow control (1 MiB per connection)
  pushes back to the engine, whose `--client-stall-timeout` then cuts the response and aborts the generation.

A cut stream reaches the client as a response that ends before its last chunk; Envoy closes an HTTP/1.1
connection it resets after its delayed-close grace (`delayed_close_timeout`, 1 s by default), so the client
sees the end up to 1 s after the bound.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from tests.procs import KVGATE, free_port, scrape

pytestmark = pytest.mark.processes

CLOSE_GRACE = 1.0  # Envoy's default delayed_close_timeout
SLACK = 0.5  # scheduling on a shared 2-core machine


class KvgateUp:
    """`kvgate up` with one sim replica; `url` is the gateway, `engine_url` the replica, `admin` Envoy's admin."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.port = free_port()
        env = dict(os.environ, KVGATE_CACHE_DIR=str(tmp_path / "cache"), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([KVGATE, "up", "--replicas", "1", "--backend", "sim", "--port", str(self.port),
                                      *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        try:
            output = self._wait_up(60)
            self.logdir = Path(re.search(r"logs: (\S+)", output).group(1))
            config = json.loads((self.logdir / "envoy.json").read_text())
            self.admin = f"http://127.0.0.1:{config['admin']['address']['socket_address']['port_value']}"
            engines = next(c for c in config["static_resources"]["clusters"]  # the pool's endpoints' cluster
                           if c["name"].startswith("pool-") and "load_assignment" in c)
            address = engines["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
            self.engine_url = f"http://127.0.0.1:{address['socket_address']['port_value']}"
        except BaseException:
            self.stop()
            raise

    def _wait_up(self, timeout: float) -> str:
        lines, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                return "".join(lines)
        raise RuntimeError("kvgate up did not come up:\n" + "".join(lines))

    def pid(self, name: str) -> int:
        """The child of `kvgate up` whose command line has `name` ("envoy" or "epp")."""
        for child in open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read().split():
            argv = open(f"/proc/{child}/cmdline", "rb").read().split(b"\0")
            if name == "envoy" and argv[0].endswith(b"envoy") or name.encode() in argv[1:3]:
                return int(child)
        raise LookupError(name)

    def stat(self, name: str) -> int:
        text = httpx.get(f"{self.admin}/stats?filter=^{re.escape(name)}$", timeout=5).text
        return int(text.split(":")[1]) if ":" in text else 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)

    def __enter__(self) -> "KvgateUp":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


STALLED_ENGINE = ["--engine-arg=--sim-hang-after-steps=1", "--engine-arg=--engine-step-timeout=600"]
BODY = {"prompt": "hello", "max_tokens": 8}


def _timed_plain(url: str) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    r = httpx.post(url + "/v1/completions", json=BODY, timeout=30)
    return r, time.monotonic() - start


def _timed_stream(url: str) -> tuple[int, float, float]:
    """(status, seconds to the headers, seconds to the end); the end must be a cut, not a finished stream."""
    start = time.monotonic()
    with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=30) as r:
        headers_at = time.monotonic() - start
        with pytest.raises(httpx.RemoteProtocolError):  # the chunked body ends before its last chunk
            for _ in r.iter_bytes():
                pass
        return r.status_code, headers_at, time.monotonic() - start


def _check_upstream_released(up: KvgateUp) -> None:
    """Envoy holds no connection to the stalled engine once it cut the requests (each reset closes its own)."""
    deadline = time.monotonic() + 5
    while up.stat("cluster.pool-local.upstream_cx_active"):
        assert time.monotonic() < deadline, "Envoy still holds connections to the stalled engine"
        time.sleep(0.05)


def test_a_stalled_engine_is_cut_at_the_request_timeout(tmp_path):
    bound = 1.0
    with KvgateUp(tmp_path, *STALLED_ENGINE, "--request-timeout", str(bound), "--stream-idle-timeout", "30") as up:
        assert httpx.get(up.engine_url + "/health").status_code == 200  # the EPP keeps routing to it
        r, took = _timed_plain(up.url)
        assert r.status_code == 504 and r.text == "upstream request timeout", r.text
        assert bound <= took < bound + SLACK, took
        status, headers_at, ended = _timed_stream(up.url)  # headers sent, then nothing
        assert status == 200 and headers_at < bound
        assert bound <= ended < bound + CLOSE_GRACE + SLACK, ended
        assert up.stat("cluster.pool-local.upstream_rq_timeout") == 2
        _check_upstream_released(up)
        print(f"\n--request-timeout {bound:g}: 504 after {took:.2f} s; a stream with headers cut after {ended:.2f} s")


def test_a_stalled_engine_is_cut_at_the_stream_idle_timeout(tmp_path):
    bound = 1.0
    with KvgateUp(tmp_path, *STALLED_ENGINE, "--stream-idle-timeout", str(bound), "--request-timeout", "30") as up:
        status, headers_at, ended = _timed_stream(up.url)  # headers sent, then nothing
        assert status == 200 and headers_at < bound
        assert bound <= ended < bound + CLOSE_GRACE + SLACK, ended
        r, took = _timed_plain(up.url)  # nothing sent either way: the same bound, as a 504
        assert r.status_code == 504 and r.text == "stream timeout", r.text
        assert bound <= took < bound + SLACK, took
        assert up.stat(f"http.gateway_{up.port}.downstream_rq_idle_timeout") == 2  # listener gateway-<port>
        _check_upstream_released(up)
        print(f"\n--stream-idle-timeout {bound:g}: a stream with headers cut after {ended:.2f} s; 504 after "
              f"{took:.2f} s")


def _rss_bytes(pid: int) -> int:
    return int(open(f"/proc/{pid}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_client_that_stops_reading_is_cut_by_the_engine_through_the_gateway(tmp_path):
    """Envoy stops reading from the engine once 1 MiB waits for the client (flow control), the kernel buffers on
    the way fill, the engine's writes wait, and --client-stall-timeout later the engine cuts the response and
    aborts the generation: Envoy and the EPP hold no more memory meanwhile than before."""
    stall, samples = 1.0, 128
    with KvgateUp(tmp_path, "--engine-arg=--sim-step-overhead-ms=0.5",
                  f"--engine-arg=--client-stall-timeout={stall}") as up:
        # Big chunks (128 samples with 20 logprobs each, ~80 kB a step) fill Envoy's 1 MiB and the socket
        # buffers on both of its sides (several MiB, autotuned by the kernel) in seconds; the whole generation
        # (8000 tokens x 128 samples) would take minutes.
        body = (b'{"prompt": "stall", "max_tokens": 8000, "ignore_eos": true, "stream": true, "n": %d, '
                b'"logprobs": 20}' % samples)
        pids = {name: up.pid(name) for name in ("envoy", "epp")}
        baseline = {name: _rss_bytes(pid) for name, pid in pids.items()}
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", up.port))
        try:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            sock.recv(1024)  # the response has started; from now on the client reads nothing
            started = time.monotonic()
            # Filling the buffers (~16 000 chunks) takes seconds on an idle machine, 30 s on a busy 2-core one.
            # Not cut, the generation would run to its end (finished_reason=length below), minutes.
            deadline = started + 60
            while scrape(up.engine_url)["vllm:num_requests_running"] < samples:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            peak = dict(baseline)
            while scrape(up.engine_url)["vllm:num_requests_running"] > 0:
                assert time.monotonic() < deadline, "the stalled request was still generating after 60 s"
                peak = {name: max(peak[name], _rss_bytes(pid)) for name, pid in pids.items()}
                time.sleep(0.05)
            freed = time.monotonic() - started
            m = scrape(up.engine_url)
            assert m["vllm:kv_cache_usage_perc"] == 0
            assert m.get("vllm:request_success_total{finished_reason=length}", 0) == 0  # aborted, not finished
            assert m["vllm:request_success_total{finished_reason=abort}"] == samples
            assert up.stat("cluster.pool-local.upstream_flow_control_paused_reading_total") >= 1
            grew = {name: (peak[name] - baseline[name]) / 2**20 for name in pids}
            assert all(g < 16 for g in grew.values()), grew
            print(f"\nstalled client through the gateway: request aborted {freed:.2f} s after the client stopped "
                  f"reading ({m['vllm:generation_tokens_total'] / samples:.0f} tokens a sample); RSS growth "
                  f"meanwhile: " + ", ".join(f"{n} {g:.1f} MiB" for n, g in grew.items()))
        finally:
            sock.close()
        assert "--client-stall-timeout" in (up.logdir / "engine-0.log").read_text()
        r = httpx.post(up.url + "/v1/completions", json={"prompt": "next", "max_tokens": 3}, timeout=10)
        assert r.status_code == 200
