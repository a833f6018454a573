"""An engine loop that dies — SIGKILL of the engine process, or an exception in the loop, thread or process
mode — fails every in-flight request with a clean error within 1 s, turns /health (and /live, /metrics) 503
within 1 s, refuses new requests with 503, and (by default) makes the server exit with status 1. A loop that
hangs in one step is the same death, --engine-step-timeout after its last step.

The exception and the hang are injected with the sim backend's documented fault knobs (`--sim-fail-after-steps`,
`--sim-hang-after-steps`), so the default configuration carries no test hook.
"""

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

from tests.procs import KvgateServe

pytestmark = pytest.mark.processes

DEATH_BUDGET = 1.0  # seconds: the bound for errors and for /health
# Requests are in flight well before this step (the sim runs a step every ~6 ms).
FAULT_STEP = "150"


def _engine_child(server: KvgateServe) -> int:
    pid = server.proc.pid
    children = open(f"/proc/{pid}/task/{pid}/children").read().split()
    # multiprocessing's resource tracker is a child too; the engine is the one `spawn_main` runs
    engines = [int(c) for c in children if b"spawn_main" in open(f"/proc/{c}/cmdline", "rb").read()]
    assert len(engines) == 1, children
    return engines[0]


async def _stream_until_error(client: httpx.AsyncClient, first_token: asyncio.Event) -> dict:
    """A long stream: returns the time of its last token, its error event and whether [DONE] followed."""
    out = {"last_token": None, "error": None, "error_at": None, "done": False}
    async with client.stream("POST", "/v1/completions", json={
            "prompt": "a long story", "max_tokens": 5000, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                out["done"] = True
                break
            event = json.loads(data)
            if "error" in event:
                out["error"], out["error_at"] = event["error"], time.monotonic()
            else:
                out["last_token"] = time.monotonic()
                first_token.set()
    return out


async def _non_streaming(client: httpx.AsyncClient) -> tuple[httpx.Response, float]:
    r = await client.post("/v1/completions", json={"prompt": "another", "max_tokens": 5000, "ignore_eos": True})
    return r, time.monotonic()


def _health(url: str) -> int | None:
    """/health's status, or None when nothing listens any more."""
    try:
        return httpx.get(url + "/health", timeout=1.0).status_code
    except httpx.TransportError:
        return None


def _run_death(server: KvgateServe, kill_child: bool) -> dict:
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(30.0)) as client:
            first_token = asyncio.Event()
            stream = asyncio.create_task(_stream_until_error(client, first_token))
            await asyncio.wait_for(first_token.wait(), 10)
            plain = asyncio.create_task(_non_streaming(client))
            await asyncio.sleep(0.2)  # both are in the engine now
            assert not stream.done() and not plain.done(), "the requests ended before the engine died"
            killed_at = None
            if kill_child:
                os.kill(_engine_child(server), signal.SIGKILL)
                killed_at = time.monotonic()
            streamed = await asyncio.wait_for(stream, 10)
            response, answered_at = await asyncio.wait_for(plain, 10)
            return {"killed_at": killed_at, "stream": streamed, "response": response, "answered_at": answered_at}

    return asyncio.run(main())


def _check_in_flight_failed_cleanly(result: dict, budget: float = DEATH_BUDGET) -> float:
    streamed, response = result["stream"], result["response"]
    # The death happened after the last token the stream received (or at the SIGKILL): a conservative origin.
    died_at = result["killed_at"] or streamed["last_token"]
    assert streamed["error"] is not None, streamed
    assert streamed["error"]["code"] == 503 and "engine stopped" in streamed["error"]["message"], streamed
    assert streamed["done"], "the stream must end after its error event"
    assert response.status_code == 503, response.text
    body = response.json()["error"]
    assert body["type"] == "server_error" and "engine stopped" in body["message"]
    latency = max(streamed["error_at"], result["answered_at"]) - died_at
    assert latency < budget, f"in-flight requests failed {latency:.3f} s after the engine died"
    print(f"\nin-flight requests failed {latency * 1000:.0f} ms after the engine died")
    return died_at


def _wait_exit(server: KvgateServe, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while server.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.proc.poll() is not None, f"the server did not exit:\n{server.log()}"
    return server.proc.returncode


@pytest.mark.parametrize("engine_loop, fault", [
    ("process", "sigkill"),
    ("process", "exception"),
    ("thread", "exception"),
])
def test_engine_death_fails_requests_and_the_server_exits(kvgate_cache, engine_loop, fault):
    args = ["--backend", "sim", "--engine-loop", engine_loop]
    if fault == "exception":
        args += ["--sim-fail-after-steps", FAULT_STEP]
    with KvgateServe("sim", *args, cache_dir=kvgate_cache) as server:
        result = _run_death(server, kill_child=fault == "sigkill")
        died_at = _check_in_flight_failed_cleanly(result)
        # /health is not 200 within the budget: 503 while the server finishes its open responses, then
        # nothing listens (the process is gone)
        status = _health(server.url)
        assert status in (503, None) and time.monotonic() - died_at < DEATH_BUDGET, status
        assert _wait_exit(server, 10) == 1
        print(f"server exited {time.monotonic() - died_at:.2f} s after the engine died")
        assert _health(server.url) is None
        log = server.log()
        assert "engine" in log and ("SIGKILL" in log if fault == "sigkill" else "simulated engine fault" in log), log


@pytest.mark.parametrize("engine_loop, fault", [("process", "sigkill"), ("process", "exception"),
                                                ("thread", "exception")])
def test_keep_alive_on_engine_death_answers_503_everywhere(kvgate_cache, engine_loop, fault):
    args = ["--backend", "sim", "--engine-loop", engine_loop, "--keep-alive-on-engine-death"]
    if fault == "exception":
        args += ["--sim-fail-after-steps", FAULT_STEP]
    with KvgateServe("sim", *args, cache_dir=kvgate_cache) as server:
        result = _run_death(server, kill_child=fault == "sigkill")
        died_at = _check_in_flight_failed_cleanly(result)
        while _health(server.url) != 503:
            assert time.monotonic() - died_at < DEATH_BUDGET, "/health still 200 a second after the engine died"
            time.sleep(0.02)
        health = httpx.get(server.url + "/health")
        assert "engine stopped" in health.json()["error"]["message"]
        assert httpx.get(server.url + "/live").status_code == 503  # a liveness probe restarts the container
        metrics = httpx.get(server.url + "/metrics")
        assert metrics.status_code == 503 and "vllm:num_requests_running" in metrics.text  # a failed scrape
        start = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=5)
        assert r.status_code == 503 and time.monotonic() - start < 0.5, r.text
        assert r.json()["error"]["type"] == "server_error"
        r = httpx.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                                  "stream": True}, timeout=5)
        assert r.status_code == 503
        assert server.proc.poll() is None, "with --keep-alive-on-engine-death the server stays up"


def test_healthy_server_is_live_and_ready(sim_server):
    assert httpx.get(sim_server.url + "/health").status_code == 200
    assert httpx.get(sim_server.url + "/live").status_code == 200
    assert httpx.get(sim_server.url + "/metrics").status_code == 200


STEP_TIMEOUT = 1.0  # --engine-step-timeout in these tests (default 60)


@pytest.mark.parametrize("engine_loop, keep_alive", [("thread", False), ("process", False),
                                                     ("thread", True), ("process", True)])
def test_a_hung_engine_step_is_an_engine_death(kvgate_cache, engine_loop, keep_alive):
    """The loop stuck in one step (a deadlocked kernel): --engine-step-timeout after its last step, in-flight
    requests get 503s and the server exits 1 (or, kept alive, answers 503 on /health and /live)."""
    args = ["--backend", "sim", "--engine-loop", engine_loop, "--sim-hang-after-steps", FAULT_STEP,
            "--engine-step-timeout", str(STEP_TIMEOUT)]
    if keep_alive:
        args.append("--keep-alive-on-engine-death")
    with KvgateServe("sim", *args, cache_dir=kvgate_cache) as server:
        engine_pid = _engine_child(server) if engine_loop == "process" else None
        result = _run_death(server, kill_child=False)
        # the hang began right after the stream's last token: not cut before the bound, and soon after it
        hung_at = _check_in_flight_failed_cleanly(result, budget=STEP_TIMEOUT + DEATH_BUDGET)
        detected = result["stream"]["error_at"] - hung_at
        assert detected >= STEP_TIMEOUT, f"declared hung {detected:.2f} s after the last step"
        print(f"hung engine ({engine_loop}): in-flight requests failed {detected:.2f} s after its last step "
              f"(--engine-step-timeout {STEP_TIMEOUT:g})")
        assert "no step completed" in result["stream"]["error"]["message"]
        if keep_alive:
            assert _health(server.url) == 503
            assert httpx.get(server.url + "/live").status_code == 503  # a liveness probe restarts the container
            assert server.proc.poll() is None
        else:
            assert _health(server.url) in (503, None)
            assert _wait_exit(server, 10) == 1
            print(f"server exited {time.monotonic() - hung_at:.2f} s after the engine hung")
        if engine_pid is not None:  # the hung engine process is killed, not left holding the accelerator
            deadline = time.monotonic() + 5
            while os.path.exists(f"/proc/{engine_pid}") and \
                    open(f"/proc/{engine_pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z":
                assert time.monotonic() < deadline, "the hung engine process is still running"
                time.sleep(0.05)
        assert "hung" in server.log()


def test_slow_steps_and_idle_time_are_not_a_hang(kvgate_cache):
    """The watchdog counts only time with requests waiting and no step: an engine idle for longer than the
    timeout, then serving steps that each take half of it, is healthy."""
    with KvgateServe("sim", "--backend", "sim", "--sim-step-overhead-ms", str(STEP_TIMEOUT * 500),
                     "--engine-step-timeout", str(STEP_TIMEOUT), cache_dir=kvgate_cache) as server:
        time.sleep(STEP_TIMEOUT * 1.5)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "slow", "max_tokens": 4, "ignore_eos": True},
                       timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(server.url + "/live").status_code == 200
