"""A real sim server fits its own latency model from the requests it serves and publishes it (kvgate/
engine_latency_protocol.py): after requests of different uncached lengths, the weights on its /metrics page,
read by the EPP's datalayer, predict the TTFTs a client then measures; the prefix cache's hits count as cached."""

import time

import httpx
import numpy as np
import pytest

from kvgate.common import engine_latency_protocol as published
from kvgate.epp.datalayer.dialects import DIALECTS
from kvgate.epp.datalayer.exposition import parse_metrics
from tests.procs import KvgateServe

pytestmark = pytest.mark.processes

MS_PER_TOKEN = 1.0  # the sim's prefill cost: a 500-token prompt's first token ~0.5 s after the request


def prompt(length: int, seed: int) -> list[int]:
    return [40 + seed % 50] + [65 + (seed * 7 + j) % 26 for j in range(length - 1)]


def first_token_s(client: httpx.Client, tokens: list[int]) -> float:
    """The request's TTFT as the client sees it; the stream is read to its end (the engine fits TPOT then)."""
    start, first = time.monotonic(), None
    with client.stream("POST", "/v1/completions", json={"prompt": tokens, "max_tokens": 4, "ignore_eos": True,
                                                        "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"text"' in line:
                first = time.monotonic() - start
    assert first is not None, "no token streamed"
    return first


def test_the_servers_published_model_predicts_its_ttft(kvgate_cache):
    with KvgateServe("sim-8b", "--backend", "sim", "--sim-prefill-ms-per-token", str(MS_PER_TOKEN),
                     cache_dir=kvgate_cache) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        lengths = [32 + (i * 97) % 480 for i in range(40)]  # one at a time, each its own prompt: nothing cached
        for i, n in enumerate(lengths):
            first_token_s(client, prompt(n, i))
        m = parse_metrics(client.get(DIALECTS["vllm"].metrics_path()).text, DIALECTS["vllm"])
        assert m.ttft_model_observations == len(lengths) and m.ttft_model_weights is not None
        weights = dict(zip(published.TTFT_FEATURES, m.ttft_model_weights))
        # an uncached token costs the sim's 1 ms (10 s per 10k tokens), give or take the steps' fixed cost
        assert 7.0 < weights["uncached_per_10k"] < 13.0, weights
        assert m.tpot_model_weights is not None and m.tpot_model_weights[0] > 0  # its decode steps take time

        def predict(uncached: int) -> float:
            x = published.ttft_features(m.prefill_backlog or 0, uncached, m.running_requests, m.waiting_queue_size)
            return float(np.maximum(x @ np.array(m.ttft_model_weights), 0.0)[0])

        # new prompts, measured from the client: within 25% of the published model's prediction
        for i, n in enumerate((100, 300, 450)):
            measured = first_token_s(client, prompt(n, 100 + i))
            assert abs(predict(n) / measured - 1) < 0.25, (n, predict(n), measured)
        # a prompt sent again is a prefix-cache hit (all but its last, partial block): fitted as nearly uncached
        again = prompt(450, 100 + 2)
        assert first_token_s(client, again) < 0.5 * predict(450)
        after = parse_metrics(client.get(DIALECTS["vllm"].metrics_path()).text, DIALECTS["vllm"])
        assert after.ttft_model_observations == len(lengths) + 4
