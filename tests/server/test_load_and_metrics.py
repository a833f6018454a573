"""Concurrency, client disconnects, /metrics and error handling of `kvgate serve`, over real HTTP."""

import asyncio
import json
import time

import httpx
import pytest

from tests.procs import scrape

pytestmark = pytest.mark.processes

METRIC_NAMES = [
    "vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info", "vllm:lora_requests_info", "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count", "kvgate:num_prefill_tokens_pending",
]


async def stream_completion(client, body):
    tokens, text = 0, []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True,
                                                               "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                for c in chunk["choices"]:
                    text.append(c["text"])
    return tokens, "".join(text)


def wait_until(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def test_64_concurrent_streams(demo_server):
    async def main():
        async with httpx.AsyncClient(base_url=demo_server.url, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(
                stream_completion(client, {"prompt": f"request {i} " * (1 + i % 7), "max_tokens": 10 + i % 13,
                                           "ignore_eos": True, "temperature": 0.7, "seed": i})
                for i in range(64)))

    results = asyncio.run(main())
    assert [t for t, _ in results] == [10 + i % 13 for i in range(64)]
    assert all(len(text) > 0 for _, text in results)


def test_disconnect_mid_stream_aborts_and_frees_blocks(demo_server):
    url = demo_server.url
    assert wait_until(lambda: scrape(url)["vllm:num_requests_running"] == 0, 5)
    with httpx.Client(base_url=url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json={
                "prompt": "x" * 100, "max_tokens": 900, "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(5):
                next(lines)
            m = scrape(url)
            assert m["vllm:num_requests_running"] == 1 and m["vllm:kv_cache_usage_perc"] > 0
        # leaving the block closed the connection mid-stream
    t0 = time.monotonic()
    assert wait_until(lambda: scrape(url)["vllm:num_requests_running"] == 0, 1.0)
    assert wait_until(lambda: scrape(url)["vllm:kv_cache_usage_perc"] == 0, 1.0)
    assert time.monotonic() - t0 <= 1.0 + 0.2
    assert wait_until(lambda: scrape(url).get('vllm:request_success_total{finished_reason=abort}', 0) >= 1, 1.0)


def test_disconnect_of_a_non_streaming_request_aborts(demo_server):
    url = demo_server.url

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            task = asyncio.create_task(client.post("/v1/completions", json={
                "prompt": "y" * 100, "max_tokens": 900, "ignore_eos": True}))
            for _ in range(100):
                await asyncio.sleep(0.05)
                if scrape(url)["vllm:num_requests_running"] == 1:
                    break
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    asyncio.run(main())
    assert wait_until(lambda: scrape(url)["vllm:num_requests_running"] == 0, 1.0)
    assert wait_until(lambda: scrape(url)["vllm:kv_cache_usage_perc"] == 0, 1.0)


def test_metrics_names_values_and_movement(demo_server):
    url = demo_server.url
    before = scrape(url)
    for name in METRIC_NAMES:
        assert any(k.split("{")[0] == name for k in before), f"missing {name}"
    cache_info = [k for k in before if k.startswith("vllm:cache_config_info")]
    assert "block_size=16" in cache_info[0] and "num_gpu_blocks=" in cache_info[0]
    assert 0.0 <= before["vllm:kv_cache_usage_perc"] <= 1.0

    peak = {"usage": 0.0, "running": 0.0, "pending": 0.0}

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def watch():
                while True:
                    m = await asyncio.to_thread(scrape, url)
                    peak["usage"] = max(peak["usage"], m["vllm:kv_cache_usage_perc"])
                    peak["running"] = max(peak["running"], m["vllm:num_requests_running"])
                    peak["pending"] = max(peak["pending"], m["kvgate:num_prefill_tokens_pending"])
                    await asyncio.sleep(0.005)

            watcher = asyncio.create_task(watch())
            # A shared prefix (> 2 blocks of the byte tokenizer: prefix-cache hits), then a tail of its own per
            # request, so that every prompt has ~660 tokens to prefill whatever the cache holds: the backlog then
            # lasts several steps. With only the prefix shared and a short tail, the followers found the first
            # prompt's blocks on arrival and the backlog lasted one ~10 ms step, which a watcher under `make test`'s
            # load missed twice.
            prefix = "shared system prompt " * 10
            await asyncio.gather(*(stream_completion(client, {"prompt": prefix + f"request {i:02d} " * 60,
                                                              "max_tokens": 40, "ignore_eos": True})
                                   for i in range(16)))
            watcher.cancel()

    asyncio.run(main())
    assert peak["usage"] > 0 and peak["running"] >= 2
    after = wait_until(lambda: (m := scrape(url))["vllm:kv_cache_usage_perc"] == 0 and m, 2.0)
    assert after and after["vllm:num_requests_running"] == 0 and after["vllm:num_requests_waiting"] == 0
    # the torch backend's prefill backlog: 16 prompts of ~870 tokens queued at once, then none
    assert 0 < peak["pending"] <= 16 * 900 and after["kvgate:num_prefill_tokens_pending"] == 0
    assert after["vllm:prefix_cache_hits_total"] > before["vllm:prefix_cache_hits_total"]
    assert after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"] >= 16 * 860
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 16 * 40
    assert after["vllm:e2e_request_latency_seconds_count"] - before["vllm:e2e_request_latency_seconds_count"] == 16


ERROR_CASES = [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": ', 400, None),  # malformed JSON
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x" * 1000, "max_tokens": 100}, 400, "max_tokens"),  # context is 1024
    ("/v1/completions", {"prompt": "x" * 1030}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/detokenize", {"tokens": [1, 99999]}, 400, "tokens"),
]


def test_errors_have_openai_shape_while_good_requests_succeed(demo_server):
    async def main():
        async with httpx.AsyncClient(base_url=demo_server.url, timeout=60) as client:
            good = [asyncio.create_task(stream_completion(client, {"prompt": f"ok {i}", "max_tokens": 20,
                                                                  "ignore_eos": True})) for i in range(8)]
            bad = []
            for path, body, _, _ in ERROR_CASES:
                if isinstance(body, bytes):
                    bad.append(client.post(path, content=body, headers={"content-type": "application/json"}))
                else:
                    bad.append(client.post(path, json=body))
            responses = await asyncio.gather(*bad)
            return await asyncio.gather(*good), responses

    good, responses = asyncio.run(main())
    assert [t for t, _ in good] == [20] * 8
    for (path, body, status, param), r in zip(ERROR_CASES, responses):
        assert r.status_code == status, (path, body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
        assert err["message"] and "Traceback" not in err["message"]
        if param:
            assert err["param"] == param, (body, err)


def test_overload_returns_503(kvgate_cache):
    from tests.procs import KvgateServe

    with KvgateServe("sim", "--backend", "sim", "--max-queued-requests", "2", "--max-num-seqs", "1",
                     cache_dir=kvgate_cache) as server:
        async def main():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                return await asyncio.gather(*(client.post("/v1/completions", json={
                    "prompt": "z", "max_tokens": 50, "ignore_eos": True}) for _ in range(8)))

        responses = asyncio.run(main())
        codes = sorted(r.status_code for r in responses)
        # a burst of 8 against a queue limit of 2: two are admitted, the rest are shed with 503
        assert codes.count(200) >= 2 and 503 in codes and set(codes) <= {200, 503}
        shed = [r for r in responses if r.status_code == 503][0].json()["error"]
        assert shed["type"] == "overloaded_error" and shed["code"] == 503
        admitted = [r.json() for r in responses if r.status_code == 200]
        assert all(r["usage"]["completion_tokens"] == 50 for r in admitted)
        # once the queue has drained the server admits again
        assert httpx.post(server.url + "/v1/completions", json={"prompt": "z", "max_tokens": 5}).status_code == 200


def test_tokenize_detokenize_roundtrip(demo_server):
    r = httpx.post(demo_server.url + "/tokenize", json={"prompt": "héllo"}).json()
    assert r["count"] == 6
    assert httpx.post(demo_server.url + "/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "héllo"
    chat = httpx.post(demo_server.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["count"] > 2
