"""A structured-output constraint is the client's program: its cost is bounded before admission (a 400 naming the
field), its per-token cost cannot stall the batch, and the compile cache is bounded in bytes
(engine/structured_output.py). Real `kvgate serve demo --backend sim` processes and a real engine."""

import json
import threading
import time

import httpx
import pytest

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.sampling_params import StructuredOutputsParams
from tests.procs import KvgateServe

GOOD = {"prompt": "hello", "max_tokens": 8}


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.processes
def test_large_repeat_regex_times_n_is_refused_while_others_are_served(kvgate_cache):
    """`a{200000}` x n=16 built its matcher 16 times inside the engine loop, then spent ~30 ms per token per
    sample: good requests beside it waited 11 s, and with a 5 s step watchdog the loop could be declared hung
    (the server exits). Now: a 400 naming the field (or served), every good request beside it succeeds without
    a stall and the server stays up."""
    with KvgateServe("demo", "--backend", "sim", "--engine-step-timeout", "5", cache_dir=kvgate_cache) as server:
        client = httpx.Client(base_url=server.url, timeout=60)
        assert client.post("/v1/completions", json=GOOD).status_code == 200  # warm
        stop = threading.Event()
        good: list[tuple[int, float]] = []

        def good_stream():
            with httpx.Client(base_url=server.url, timeout=60) as c:
                while not stop.is_set() and len(good) < 400:  # bounded either way
                    t0 = time.monotonic()
                    good.append((c.post("/v1/completions", json=GOOD).status_code, time.monotonic() - t0))

        workers = [threading.Thread(target=good_stream) for _ in range(2)]
        for w in workers:
            w.start()
        try:
            time.sleep(0.5)
            t0 = time.monotonic()
            r = client.post("/v1/completions", json={"prompt": "x", "n": 16, "max_tokens": 16,
                                                     "structured_outputs": {"regex": "a{200000}"}})
            bad_s = time.monotonic() - t0
            time.sleep(1.0)
        finally:
            stop.set()
            for w in workers:
                w.join(60)
        print(f"\nbad request: {r.status_code} in {bad_s:.2f} s; good: {len(good)} requests, "
              f"max latency {max(s for _, s in good):.2f} s")
        assert r.status_code in (200, 400), r.text
        if r.status_code == 400:
            err = r.json()["error"]
            assert err["param"] == "structured_outputs.regex" and "too complex" in err["message"], err
        assert good and all(status == 200 for status, _ in good), good
        # 8 tokens of the sim take ~0.1 s; the stalled loop made them wait 11 s (generous: 2 loaded cores)
        assert max(s for _, s in good) < 3.0, sorted(s for _, s in good)[-5:]
        assert client.get("/health").status_code == 200 and server.proc.poll() is None
        assert client.post("/v1/completions", json=GOOD).status_code == 200


def _big_schema(i: int, description_bytes: int) -> dict:
    return {"type": "object", "description": f"{i}:" + "d" * description_bytes,
            "properties": {f"field_{i}": {"type": "string", "maxLength": 8}}, "required": [f"field_{i}"]}


@pytest.mark.processes
def test_distinct_large_schemas_do_not_grow_rss_without_bound(kvgate_cache):
    """Each distinct schema was kept (text and grammar) in a 256-entry cache: 12 schemas of 7 MiB raised the
    server's RSS by 200 MiB for good. Now a schema over 1/16 of the cache's byte bound is compiled, not kept."""
    with KvgateServe("demo", "--backend", "sim", "--engine-loop", "thread", cache_dir=kvgate_cache) as server:
        client = httpx.Client(base_url=server.url, timeout=120)

        def render(i: int) -> None:
            body = json.dumps({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
                "name": "s", "schema": _big_schema(i, 3 << 20)}}})
            r = client.post("/v1/completions/render", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 200, r.text[:300]

        for i in range(3):  # the allocator's arenas reach their working size
            render(i)
        base = _rss_mib(server.proc.pid)
        for i in range(3, 23):
            render(i)
        grown = _rss_mib(server.proc.pid) - base
        print(f"\nRSS {base:.0f} MiB after 3 schemas of 3 MiB, +{grown:.0f} MiB after 20 more")
        assert grown < 100, f"RSS grew by {grown:.0f} MiB over 20 distinct 3 MiB schemas"


def test_grammar_cache_is_bounded_in_bytes():
    from kvgate.engine.structured_output import GrammarCache

    cache = GrammarCache(max_bytes=1 << 20)
    schemas = [json.dumps(_big_schema(i, 20_000)) for i in range(100)]
    for s in schemas:
        cache.get("json", s)
        assert cache.bytes <= cache.max_bytes
    assert 0 < len(cache) < 100 and cache.bytes > cache.max_bytes // 2
    assert cache.bytes == sum(size for _, size in cache._entries.values())
    # least recently used out first: the newest is kept, the oldest is gone
    assert ("json", schemas[-1]) in cache._entries and ("json", schemas[0]) not in cache._entries
    before = cache.bytes
    cache.get("json", json.dumps(_big_schema(1000, 200_000)))  # over 1/16 of the bound: compiled, not kept
    assert cache.bytes == before and ("json", schemas[-1]) in cache._entries


def test_a_constraint_slow_per_token_is_ended_and_others_finish(kvgate_cache, monkeypatch):
    """A matcher whose masks cost more than the per-token budget is ended with a clear stop_reason after a few
    tokens; an unconstrained request in the same batch gets every token it asked for. (The budget is
    lowered so that a regex admitted under the default limits, `a{20000}` at ~2-10 ms a token, goes over.)"""
    from kvgate.engine import structured_output

    monkeypatch.setenv("KVGATE_CACHE_DIR", str(kvgate_cache))
    monkeypatch.setattr(structured_output, "MASK_BUDGET_PER_TOKEN_S", 0.0002, raising=False)
    monkeypatch.setattr(structured_output, "MASK_BUDGET_SLACK_S", 0.01, raising=False)
    llm = LLM("demo", backend="sim", max_model_len=1024)
    slow = SamplingParams(max_tokens=200, structured_outputs=StructuredOutputsParams(regex="a{20000}"))
    free = SamplingParams(max_tokens=200, ignore_eos=True)
    outs = llm.generate(["x", "y"], [slow, free])
    slow_out, free_out = outs[0].outputs[0], outs[1].outputs[0]
    assert len(free_out.token_ids) == 200
    assert len(slow_out.token_ids) < 200 and "per token to match, over the budget" in (slow_out.stop_reason or ""), \
        (len(slow_out.token_ids), slow_out.stop_reason)
