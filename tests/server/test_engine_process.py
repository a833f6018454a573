"""`--engine-loop process`: the same server with the engine loop in its own process."""

import time

import httpx
import openai
import pytest

from tests.procs import KvgateServe, scrape

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def process_server(kvgate_cache):
    with KvgateServe("demo", "--engine-loop", "process", "--max-model-len", "1024",
                     cache_dir=kvgate_cache) as server:
        yield server


def test_generation_matches_the_thread_loop(process_server, demo_server):
    kw = dict(model="demo", prompt="same seed, same text", max_tokens=20, temperature=0.8, seed=5)
    a = openai.OpenAI(base_url=process_server.url + "/v1", api_key="x").completions.create(**kw)
    b = openai.OpenAI(base_url=demo_server.url + "/v1", api_key="x").completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text and a.usage.completion_tokens == 20


def test_errors_cross_the_process_boundary(process_server):
    r = httpx.post(process_server.url + "/v1/completions", json={"prompt": "x", "top_k": -5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_k"


def test_disconnect_aborts_in_the_engine_process(process_server):
    url = process_server.url
    with httpx.stream("POST", url + "/v1/completions", json={"prompt": "x", "max_tokens": 1000,
                                                             "ignore_eos": True, "stream": True}, timeout=30) as r:
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        assert scrape(url)["vllm:num_requests_running"] == 1
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline and scrape(url)["vllm:kv_cache_usage_perc"] > 0:
        time.sleep(0.05)
    m = scrape(url)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0


def test_engine_process_is_stopped_with_the_server(kvgate_cache):
    server = KvgateServe("sim", "--backend", "sim", "--engine-loop", "process", cache_dir=kvgate_cache)
    server.wait_ready()
    children = [int(p) for p in open(f"/proc/{server.proc.pid}/task/{server.proc.pid}/children").read().split()]
    assert children, "the engine process should be a child of the server"
    server.stop()

    def gone(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split()[2] == "Z"
        except FileNotFoundError:
            return True
    # The server has exited; its engine child may still be finishing its own shutdown for a moment.
    deadline = time.monotonic() + 5.0
    while not all(gone(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(gone(pid) for pid in children), [pid for pid in children if not gone(pid)]
