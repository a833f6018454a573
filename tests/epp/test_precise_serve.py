"""The precise scorer against real processes: two `kvgate serve --backend sim` engines with a small KV cache (evictions,
preemptions) publishing events; the precise scorer routes a mixed workload of shared-prefix completions and
chats to them, and afterwards

  - its index for each endpoint equals that engine's cache as the engine's full event history (its replay
    buffer, read by the independent decoder of tests/engine/test_kv_events.py) says it is;
  - for probe prompts, the cached tokens the scorer predicts for an endpoint are the cached tokens that engine
    then reports for the request (usage.prompt_tokens_details.cached_tokens: the engine's own block pool);
  - the EPP's token ids equal the engine's render endpoints' (completions and chat).
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import zmq

from kvgate.epp.kv_events.sources import EventSource
from kvgate.epp.prefix.hashing import chain, root_hash
from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState, LLMRequest
from tests.engine.test_kv_events import Subscriber, free_port_v6
from tests.epp.kv_events_helpers import Harness
from tests.procs import KvgateServe, scrape

pytestmark = pytest.mark.processes

BLOCK = 16
NUM_BLOCKS = 48
KV_BYTES = NUM_BLOCKS * BLOCK * 131072  # the sim's default bytes per token


def start_engine(cache_dir, pub: int, replay: int) -> KvgateServe:
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://[::1]:{pub}", "replay_endpoint":
              f"tcp://[::1]:{replay}", "topic": "kv-events", "buffer_steps": 100_000}
    return KvgateServe("sim", "--backend", "sim", "--kv-cache-memory", str(KV_BYTES), "--sim-max-model-len",
                       "512", "--max-num-seqs", "8", "--sim-step-overhead-ms", "2", "--sim-prefill-ms-per-token",
                       "0.01", "--kv-events-config", json.dumps(config), cache_dir=cache_dir)


def index_from_history(sub: Subscriber) -> tuple[set[int], int]:
    """Replay the engine's whole history with the independent decoder; our hashes of what it holds, last seq."""
    history = sub.replay(0)
    assert history and history[0][0] == 0, "the replay buffer must hold the whole history"
    for seq, payload in history:
        sub._take(seq, payload)
    blocks = sub.index.blocks  # engine hash → (parent engine hash, tokens)
    ours: dict[int, int] = {}

    def our_hash(h: int) -> int:
        if h not in ours:
            parent, tokens = blocks[h]
            ours[h] = chain(list(tokens), BLOCK, root_hash(None, None) if parent is None else our_hash(parent))[0]
        return ours[h]

    return {our_hash(h) for h in blocks}, history[-1][0]


def test_index_matches_real_engines_and_their_reported_cache_hits(tmp_path):
    ports = [(free_port_v6(), free_port_v6()) for _ in range(2)]
    servers = [start_engine(tmp_path, *p) for p in ports]
    h = Harness()
    ctx = zmq.Context()
    subs = []
    try:
        for s in servers:
            s.wait_ready()
        addresses = [f"{s.host}:{s.port}" for s in servers]
        url = dict(zip(addresses, (s.url for s in servers)))
        h.scorer.set_sources([EventSource(a, f"tcp://[::1]:{p}", f"tcp://[::1]:{r}", "kv-events")
                              for a, (p, r) in zip(addresses, ports)])
        h.scorer.load_tokenizer()
        states = [EndpointState(Endpoint(a), EndpointMetrics(), stale=False) for a in addresses]
        rng = random.Random(5)
        systems = [f"You are assistant #{i}. " + " ".join(rng.choice(["alpha", "beta", "gamma", "delta"])
                                                           for _ in range(40)) for i in range(6)]

        def body_for(i: int) -> dict:
            system = rng.choice(systems)
            question = f"Question {i}: " + "x" * rng.randrange(5, 80)
            if i % 3 == 0:
                return {"model": "sim", "messages": [{"role": "system", "content": system},
                                                     {"role": "user", "content": question}],
                        "max_tokens": rng.randrange(4, 40)}
            return {"model": "sim", "prompt": system + question, "max_tokens": rng.randrange(4, 40)}

        def send(address: str, body: dict) -> dict:
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            r = httpx.post(url[address] + path, json=body, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()

        # the mixed workload: routed by the scorer (max score, ties at random), 8 at a time
        with ThreadPoolExecutor(8) as pool:
            futures = []
            for i in range(80):
                body = body_for(i)
                request = LLMRequest(f"r{i}", "sim", "sim", "", body=body)
                scores = h.scorer.score(request, states)
                target = states[int(scores.argmax())] if scores.max() > 0 else rng.choice(states)
                h.scorer.pre_request(request, target)
                futures.append(pool.submit(send, target.address, body))
                h.pump(lambda: True, timeout=1)  # apply what arrived meanwhile, as the EPP's loop does
            for f in futures:
                f.result()
            # and a burst that must preempt on each engine, whatever the timing above: 8 requests at once of
            # ~150 prompt + 300 output tokens (28 blocks each) against 48 blocks — any two running together outgrow it
            burst = [pool.submit(send, address, {"model": "sim", "prompt": f"burst {address} {j} " + "y" * 130,
                                                 "max_tokens": 300, "ignore_eos": True})
                     for address in addresses for j in range(8)]
            for f in burst:
                f.result()
        # the index (confirmed blocks) equals each engine's cache as its whole history says
        for (pub, replay), address in zip(ports, addresses):
            sub = Subscriber(ctx, f"tcp://[::1]:{pub}", f"tcp://[::1]:{replay}", b"kv-events", bind=False)
            subs.append(sub)
            expected, last = index_from_history(sub)
            h.pump(lambda: h.applied(address, last), timeout=10)
            assert h.index.blocks_of(address) == expected and expected
            assert sub.index.counts["BlockRemoved"] > 0  # evictions happened
        preemptions = [scrape(u).get("vllm:num_preemptions_total", 0) for u in url.values()]
        print("preemptions per engine:", preemptions)
        assert all(p > 0 for p in preemptions), preemptions
        # the scorer's cached tokens are what the engine then reports as cached, probe by probe (sequentially,
        # the engines idle: nothing is evicted in between); speculative entries would count blocks the engine
        # may not hold, so they are off here (Harness: speculative_ttl_s=0)
        render_s, local_s = [], []
        for i in range(12):
            body = body_for(1000 + i)
            body["max_tokens"] = 1
            request = LLMRequest(f"p{i}", "sim", "sim", "", body=body)
            cached = h.scorer.cached_tokens(request, states, None)
            address = addresses[i % 2]
            usage = send(address, body)["usage"]
            assert usage["prompt_tokens_details"]["cached_tokens"] == cached[i % 2], (i, usage, cached)
            assert usage["prompt_tokens"] == h.scorer.prompt_tokens(request, None)
            # the EPP's token ids are the engine's (its render endpoint)
            path = "/v1/chat/completions/render" if "messages" in body else "/v1/completions/render"
            t0 = time.perf_counter()
            rendered = httpx.post(url[address] + path, json=body, timeout=10).json()
            render_s.append(time.perf_counter() - t0)
            rendered = rendered if isinstance(rendered, dict) else rendered[0]
            t0 = time.perf_counter()
            tokens = h.scorer.tokenizer.tokens(request)
            local_s.append(time.perf_counter() - t0)
            assert tokens == rendered["token_ids"]
            h.pump(lambda: True, timeout=1)
        print(f"render endpoint round trip median {sorted(render_s)[6] * 1e6:.0f} us, "
              f"local tokenizer median {sorted(local_s)[6] * 1e6:.0f} us")
    finally:
        for sub in subs:
            sub.close()
        h.close()
        for s in servers:
            s.stop()
        ctx.term()
