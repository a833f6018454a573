"""Hostile prompts against the EPP's tokenization: a long prompt is tokenized only up to
the prefix the precise index can use, off the event loop, within `tokenizeTimeout` (past it that request alone is
scored by the approximate scorer), and no other decision waits for it; token ids that are not ints in
[0, 2^31) are a 400 where the request enters, never a 500."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import grpc
import numpy as np
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from kvgate.epp.request_parsing import BadRequest, parse_request
from kvgate.epp.scheduling.config import KVGATE_PROFILE_YAML
from kvgate.epp.scheduling.framework import CycleState
from kvgate.epp.scheduling.plugins import create_plugin
from kvgate.epp.prefix.budgeted_tokenizer import DEGRADED
from kvgate.epp.scheduling.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState, LLMRequest
from tests.epp.test_extproc_grpc import body_msgs, destination, headers_msg, immediate
from tests.gateway import EPP
from tests.procs import KvgateServe

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


pytestmark = pytest.mark.usefixtures("module_cache_dir")


def state(address: str) -> EndpointState:
    return EndpointState(Endpoint(address), EndpointMetrics(kv_block_size=16), stale=False)


def long_request(text: str, rid: str = "big") -> LLMRequest:
    return LLMRequest(rid, "m", "m", text, body={"prompt": text})


@pytest.mark.parametrize("prompt", [[2**63], [2**64, 1], [-1], [2**31], [True, 1], [[1, 2], [2**63]], [[]]])
def test_bad_token_ids_are_a_400_where_the_request_enters(prompt):
    with pytest.raises(BadRequest, match=r"'prompt' token ids must be integers in \[0, 2147483648\)"):
        parse_request("r", json.dumps({"prompt": prompt}).encode(), {})
    request, _ = parse_request("r", json.dumps({"prompt": [0, 2**31 - 1]}).encode(), {})
    assert request.prompt == f"0 {2**31 - 1}"


def test_the_precise_scorer_never_fails_on_ids_that_slipped_past():
    """Defense in depth: a caller that skipped request_parsing gets a miss (0), not an exception."""
    scorer = PrecisePrefixCacheScorer(speculative_ttl_s=1)
    r = LLMRequest("r", "m", "m", "", body={"prompt": [2**63] * 40})
    assert scorer.score(r, [state(A)], CycleState()).tolist() == [0]
    scorer.pre_request(r, state(A), CycleState())


def test_a_long_prompt_is_tokenized_off_the_loop_within_its_budget():
    """4 MiB of prompt: prepare() tokenizes only what the index can use (max_prefix_blocks × block size: 131072
    tokens) in a worker thread, while the loop keeps ticking (the tokenizer lets go of the GIL); the decision is
    then precise, and exact for that prefix."""
    scorer = PrecisePrefixCacheScorer(speculative_ttl_s=1, tokenize_timeout_s=30)
    scorer.load_tokenizer()
    limit = scorer.max_prefix_blocks * scorer.block_size
    text = "lorem ipsum dolor sit amet " * (4 * 2**20 // 27)
    r = long_request(text)

    async def main():
        ticks, stop = [], False

        async def tick():
            while not stop:
                t0 = time.perf_counter()
                await asyncio.sleep(0.001)
                ticks.append(time.perf_counter() - t0)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.01)
        ticks.clear()
        assert scorer.needs_prepare(r)
        t0 = time.perf_counter()
        await scorer.prepare(r)
        took = time.perf_counter() - t0
        stop = True
        await ticker
        return ticks, took

    ticks, took = asyncio.run(main())
    prepared = r.prepared[scorer]
    assert not prepared.complete and len(prepared.ids) == limit
    assert prepared.ids == scorer.tokenizer.encode(text[:limit + 10000])[:limit]
    assert abs(prepared.count - len(text)) < 0.01 * len(text)  # byte tokenizer: a token a byte
    # Holding the GIL (tokenizers' encode does), the loop ticked once or twice in the whole tokenization.
    assert len(ticks) >= 5 and max(ticks) < 0.5, f"{len(ticks)} ticks in {took:.3f} s, longest {max(ticks):.3f} s"
    cycle = CycleState()
    assert scorer.score(r, [state(A), state(B)], cycle).tolist() == [0, 0]
    scorer.pre_request(r, state(B), cycle)
    again = long_request(text, "again")
    scores = scorer.score(again, [state(A), state(B)], CycleState())  # tokenized inline: no prepare step
    np.testing.assert_allclose(scores, [0, limit / len(text)], rtol=0.02)


def test_past_the_budget_the_decision_degrades_to_the_approximate_scorer():
    scorer = PrecisePrefixCacheScorer(speculative_ttl_s=1, tokenize_timeout_s=0.001)
    scorer.load_tokenizer()
    text = "shared document " * (2**20 // 16)
    endpoints = [state(A), state(B)]
    first, second = long_request(text, "1"), long_request(text + " another question", "2")
    for r in (first, second):
        asyncio.run(scorer.prepare(r))
        assert r.prepared[scorer] is DEGRADED
    cycle = CycleState()
    assert scorer.score(first, endpoints, cycle).tolist() == [0, 0]
    assert scorer.prompt_tokens(first, cycle) == len(text) // 4  # the approximate scorer's estimate
    scorer.pre_request(first, endpoints[0], cycle)
    cycle = CycleState()
    scores = scorer.score(second, endpoints, cycle)  # the first one's pick, remembered by characters
    assert scores[0] == 1.0 and scores[1] == 0
    assert scorer.cached_tokens(second, endpoints, cycle)[0] > 0
    assert scorer.stats()["tokenize_timeouts"] == 2
    assert scorer.index.speculative_size() == 0  # nothing precise was claimed for a prompt not tokenized


def test_tokenize_timeout_parameter():
    assert create_plugin("precise-prefix-cache-scorer", {"tokenizeTimeout": 0.25}).tokens.timeout_s == 0.25
    for bad in (0, -1, 61, "1s", True):
        with pytest.raises(ValueError, match=r"tokenizeTimeout must be (a number|in \(0, 60\])"):
            create_plugin("precise-prefix-cache-scorer", {"tokenizeTimeout": bad})


@pytest.fixture(scope="module")
def epp(tmp_path_factory):
    """kvgate's profile (precise scoring) with a budget no long prompt meets (1 ms), over two sim engines."""
    tmp = tmp_path_factory.mktemp("tokenize-budget")
    plugin = "- type: precise-prefix-cache-scorer\n"
    config = KVGATE_PROFILE_YAML.replace(plugin, plugin + "  parameters: {tokenizeTimeout: 0.001}\n")
    assert "tokenizeTimeout" in config
    engines = [KvgateServe("sim-model", "--backend", "sim", cache_dir=tmp) for _ in range(2)]
    server = None
    try:
        for e in engines:
            e.wait_ready()
        addresses = [f"127.0.0.1:{e.port}" for e in engines]
        server = EPP(tmp, addresses, extra=["--config-text", config])
        # the decision streams the 12 MiB body back in one message: past gRPC's default 4 MiB
        channel = grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}",
                                        options=[("grpc.max_receive_message_length", 64 * 2**20)])
        yield addresses, pb_grpc.ExternalProcessorStub(channel), server
        channel.close()
    finally:
        if server:
            server.stop()
        for e in engines:
            e.stop()


def _decide(stub, body: bytes, chunks: int = 1):
    return list(stub.Process(iter([headers_msg({}), *body_msgs(body, chunks)]), timeout=120))


@pytest.mark.processes
def test_token_ids_past_int64_are_a_400_not_a_500(epp):
    addresses, stub, server = epp
    for prompt in ([2**63] * 40, [[5, 6], [2**64]], [-3]):
        status, error = immediate(_decide(stub, json.dumps({"model": "sim-model", "prompt": prompt}).encode())[0])
        assert status == 400 and error["type"] == "invalid_request_error" and "token ids" in error["message"]
    ok = _decide(stub, json.dumps({"model": "sim-model", "prompt": [1, 2, 3] * 20}).encode())
    assert destination(ok[0]) in addresses
    assert 'kvgate_epp_requests_total{code="500"}' not in server.metrics()


@pytest.mark.processes
def test_a_multi_mib_prompt_delays_no_other_decision_and_is_still_routed(epp):
    """Before: the precise scorer tokenized the whole 12 MiB prompt on the event loop (~9 s here), and every
    decision meanwhile waited for it. Now the small decisions go on (each well under a second) and the big ones
    are routed, by the approximate scorer past the 1 ms budget."""
    addresses, stub, server = epp
    big = json.dumps({"model": "sim-model", "prompt": "lorem ipsum dolor sit amet " * (12 * 2**20 // 27),
                      "max_tokens": 1}).encode()
    small = json.dumps({"model": "sim-model", "prompt": "hello " * 100, "max_tokens": 1}).encode()
    big_routed, errors = [], []

    def send_big():
        try:
            for _ in range(2):
                big_routed.append(destination(_decide(stub, big, chunks=16)[0]))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    sender = threading.Thread(target=send_big)
    sender.start()
    took = []
    deadline = time.monotonic() + 120
    while sender.is_alive() and time.monotonic() < deadline:
        t0 = time.monotonic()
        assert destination(_decide(stub, small)[0]) in addresses
        took.append(time.monotonic() - t0)
        time.sleep(0.01)
    sender.join(timeout=5)
    assert not errors and len(big_routed) == 2 and set(big_routed) <= set(addresses), (errors, big_routed)
    took.sort()
    # Tokenized on the loop, a small decision waited seconds for each big one; off it, each takes milliseconds
    # (the big bodies' JSON parsing still runs on the loop: ~0.1-0.3 s, more on a loaded machine).
    assert took and took[-1] < 1.5 and took[len(took) // 2] < 0.5, took
    deadline = time.monotonic() + 5  # the exporter publishes once per scrape round
    while 'kvgate_epp_kv_events_total{event="tokenize_timeouts"} 2.0' not in server.metrics():
        assert time.monotonic() < deadline, server.metrics()
        time.sleep(0.1)


@pytest.mark.processes
def test_a_long_prompt_ending_in_trailers_keeps_the_responses_in_order(epp):
    """The decision waits for the prepare step; the trailers' answer must still come after the body's."""
    addresses, stub, _ = epp
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    body = json.dumps({"model": "sim-model", "prompt": "long " * 4000, "max_tokens": 1}).encode()
    msgs = [headers_msg({}), pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=False)),
            pb.ProcessingRequest(request_trailers=pb.HttpTrailers())]
    out = list(stub.Process(iter(msgs), timeout=60))
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body", "request_trailers"]
    assert destination(out[0]) in addresses
