"""SIGTERM on the EPP (a rollout, `kubectl delete pod`) behind the real Envoy: the response bodies of running
generations pass through the EPP, so it drains — the streams it carries finish whole — within a bounded time
(`--shutdown-timeout`), after which what still runs is cut and the EPP exits."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import httpx
import pytest

from kvgate.bench.chaos.load import StreamLoad
from tests.gateway import Gateway

pytestmark = pytest.mark.processes

SLOW_SIM = ["--backend", "sim", "--sim-step-overhead-ms", "20"]  # ~50 tokens/s a stream


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kvgate-cache")


def _streams_with_sigterm(gw: Gateway, count: int, max_tokens: int):
    """`count` streams through the gateway; once every one has its first token, SIGTERM the EPP. Returns the
    outcomes, when the signal went and when the EPP exited."""
    load = StreamLoad(gw.url, "sim-model", concurrency=count, max_tokens=max_tokens)
    marks = {}

    def terminate_when_streaming():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if len(load.outcomes) == count and all(o.headers_at for o in load.outcomes):
                break
            time.sleep(0.02)
        time.sleep(0.3)  # tokens are flowing through the EPP
        marks["signal"] = time.monotonic()
        os.kill(gw.epp.proc.pid, signal.SIGTERM)
        gw.epp.proc.wait(timeout=90)
        marks["exit"] = time.monotonic()

    killer = threading.Thread(target=terminate_when_streaming)
    killer.start()
    outcomes = asyncio.run(load.run(total=count))
    killer.join(100)
    return outcomes, marks


def test_sigterm_lets_the_streams_it_carries_finish_whole(tmp_path, cache):
    with Gateway(tmp_path, cache, [SLOW_SIM] * 2) as gw:
        outcomes, marks = _streams_with_sigterm(gw, count=6, max_tokens=120)
        assert all(o.ok(120) for o in outcomes), [(o.status, o.tokens, o.error) for o in outcomes]
        assert all(o.ended_at > marks["signal"] for o in outcomes)  # they were running when it came
        assert gw.epp.proc.returncode == 0
        assert marks["exit"] >= max(o.ended_at for o in outcomes) - 0.5  # it waited for them
        assert "cut" not in gw.epp.log()


def test_the_drain_is_bounded_by_the_shutdown_timeout(tmp_path, cache):
    with Gateway(tmp_path, cache, [SLOW_SIM] * 2, epp_args=["--shutdown-timeout", "1"]) as gw:
        outcomes, marks = _streams_with_sigterm(gw, count=3, max_tokens=2000)  # ~40 s each
        # 1 s, plus the process's own exit (seconds on a loaded machine), far from the ~40 s the streams would take
        assert marks["exit"] - marks["signal"] < 10.0
        assert not any(o.ok(2000) for o in outcomes)  # cut, each with a clean error rather than a hang
        assert all(o.ended_at - marks["signal"] < 15 for o in outcomes)  # not the ~40 s to finish
        assert "cut 3 streams still running after 1 s" in gw.epp.log()
        with pytest.raises(httpx.HTTPError):  # and it is gone
            httpx.get(f"http://127.0.0.1:{gw.epp.metrics_port}/metrics", timeout=1)


@pytest.mark.parametrize("drain_health", ["not-serving", "serving"])
def test_what_a_draining_epp_tells_health_checks(tmp_path, cache, drain_health):
    """A gateway that addresses the EPP itself is told NOT_SERVING at once; behind a Service (`serving`), whose
    one address must stay healthy while a new pod serves, the draining EPP still says SERVING — both serve
    every stream meanwhile."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvgate.epp.readiness import EXT_PROC_SERVICE

    with Gateway(tmp_path, cache, [SLOW_SIM], epp_args=["--drain-health", drain_health]) as gw:
        load = StreamLoad(gw.url, "sim-model", concurrency=1, max_tokens=40)
        streaming = threading.Thread(target=lambda: asyncio.run(load.run(total=1)))
        streaming.start()
        deadline = time.monotonic() + 20
        while not (load.outcomes and load.outcomes[0].headers_at) and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(gw.epp.proc.pid, signal.SIGTERM)
        time.sleep(0.3)  # inside the lame duck: the stream keeps it busy
        with grpc.insecure_channel(f"127.0.0.1:{gw.epp.health_port}") as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=EXT_PROC_SERVICE), timeout=2).status
        streaming.join(30)
        expected = (health_pb2.HealthCheckResponse.NOT_SERVING if drain_health == "not-serving"
                    else health_pb2.HealthCheckResponse.SERVING)
        assert status == expected
        assert load.outcomes[0].ok(40), load.outcomes[0]


def test_the_gateways_only_epp_serves_new_streams_while_they_keep_coming(tmp_path, cache):
    """Envoy knows no other EPP (a rollout whose new pod has not reached its endpoint list): though the health check
    fails, it keeps sending new streams here (its panic threshold under FailClose), and the EPP keeps serving them
    past the old 5 s lame-duck cap — until they stop; then it drains and exits. Every request succeeds."""
    with Gateway(tmp_path, cache, [["--backend", "sim"]] * 2) as gw:
        load = StreamLoad(gw.url, "sim-model", concurrency=4, max_tokens=8)
        streaming = threading.Thread(target=lambda: asyncio.run(load.run()))
        streaming.start()
        try:
            deadline = time.monotonic() + 20
            while sum(o.ok(8) for o in load.outcomes) < 10 and time.monotonic() < deadline:
                time.sleep(0.05)
            signalled = time.monotonic()
            os.kill(gw.epp.proc.pid, signal.SIGTERM)
            time.sleep(8.0)
            serving = gw.epp.proc.poll() is None  # streams kept coming
        finally:
            load.stop()
            streaming.join(60)
        stopped = time.monotonic()
        gw.epp.proc.wait(timeout=30)
        failed = [(round(o.sent_at - signalled, 2), o.status, o.error) for o in load.outcomes if not o.ok(8)]
        assert serving and not failed, (failed[:8], gw.epp.log()[-3000:])
        assert len([o for o in load.outcomes if o.sent_at > signalled + 5.5]) > 10  # past the old cap
        assert time.monotonic() - stopped < 20 and gw.epp.proc.returncode == 0
