"""precise-prefix-cache-scorer: its math, the prefix match it produces, its parameters, its tokenization
(the engine's own tokenizer and chat template), and what tokenizing and hashing cost per request."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kvgate.common.tokenizer_files import load_tokenizer
from kvgate.epp.prefix.hashing import chain, root_hash
from kvgate.epp.prefix.precise_index import Delta
from kvgate.epp.scheduling.config import ConfigError, parse_config
from kvgate.epp.scheduling.framework import CycleState, SchedulingProfile, Scorer, WeightedScorer
from kvgate.epp.scheduling.plugins import create_plugin
from kvgate.epp.scheduling.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvgate.epp.scheduling.prefix_match import PREFIX_MATCH
from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState, LLMRequest

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"


pytestmark = pytest.mark.usefixtures("module_cache_dir")


def state(address: str, block_size: int | None = None) -> EndpointState:
    return EndpointState(Endpoint(address), EndpointMetrics(kv_block_size=block_size), stale=False)


def request(tokens: list[int], salt: str | None = None, rid: str = "r") -> LLMRequest:
    return LLMRequest(rid, "m", "m", "", cache_salt=salt, body={"prompt": tokens})


def holding(scorer: PrecisePrefixCacheScorer, address: str, tokens: list[int], block_size: int, salt=None):
    scorer.index.watch(address, 1)
    scorer.index.apply(Delta(address, 1, added=chain(tokens, block_size, root_hash(None, salt)),
                             block_size=block_size))


def test_score_is_the_cached_fraction_of_the_prompt():
    scorer = PrecisePrefixCacheScorer(speculative_ttl_s=0)
    tokens = list(range(13))
    holding(scorer, A, tokens[:12], 4)  # all 3 usable blocks: (13 - 1) // 4
    holding(scorer, B, tokens[:4], 4)
    endpoints = [state(A), state(B), state(C)]
    cycle = CycleState()
    assert scorer.prompt_tokens(request(tokens), cycle) == 13
    np.testing.assert_array_equal(scorer.cached_tokens(request(tokens), endpoints, cycle), [12, 4, 0])
    np.testing.assert_allclose(scorer.score(request(tokens), endpoints, CycleState()), [12 / 13, 4 / 13, 0])


def test_the_last_prompt_token_is_never_counted_cached():
    """The engine always computes the last prompt token: a 12-token prompt reuses at most 2 blocks of 4."""
    scorer = PrecisePrefixCacheScorer(speculative_ttl_s=0)
    tokens = list(range(12))
    holding(scorer, A, tokens, 4)
    assert scorer.cached_tokens(request(tokens), [state(A)], None)[0] == 8


def test_block_size_per_endpoint_from_events_then_metrics_then_parameter():
    scorer = PrecisePrefixCacheScorer(block_size=2, speculative_ttl_s=5)
    tokens = list(range(17))
    holding(scorer, A, tokens[:16], 8)  # events say 8
    scorer.pre_request(request(tokens), state(B, block_size=4))  # metrics say 4 (speculative: its blocks)
    scorer.pre_request(request(tokens), state(C))  # nothing known: the parameter, 2
    cached = scorer.cached_tokens(request(tokens), [state(A), state(B, 4), state(C)], None)
    np.testing.assert_array_equal(cached, [16, 16, 16])
    assert scorer.block_size_of(state(C)) == 2 and scorer.block_size_of(state(B, 4)) == 4


def test_cache_salt_and_other_prompts_do_not_match():
    scorer = PrecisePrefixCacheScorer(speculative_ttl_s=0)
    holding(scorer, A, list(range(16)), 4, salt="s1")
    assert scorer.cached_tokens(request(list(range(17)), salt="s1"), [state(A)], None)[0] == 16
    assert scorer.cached_tokens(request(list(range(17))), [state(A)], None)[0] == 0
    assert scorer.cached_tokens(request([1] + list(range(16))), [state(A)], None)[0] == 0


def test_pre_request_holds_while_in_flight_then_the_ttl():
    """held until min(pick + maxSpeculativeHold, response end) + speculativeTTL: a request queued longer than
    the TTL keeps its prefix warm where it went (with a TTL from the pick, the entries were gone at 2.5 s)."""
    now = [0.0]
    scorer = PrecisePrefixCacheScorer(speculative_ttl_s=2.0)
    scorer.index.clock = lambda: now[0]
    tokens = list(range(40))
    endpoints = [state(A, 16), state(B, 16)]
    cycle = CycleState()
    assert scorer.score(request(tokens), endpoints, cycle).tolist() == [0, 0]
    scorer.pre_request(request(tokens), endpoints[1], cycle)
    np.testing.assert_allclose(scorer.score(request(tokens), endpoints, CycleState()), [0, 32 / 40])
    now[0] = 30.0  # still queued in the engine: held
    np.testing.assert_allclose(scorer.score(request(tokens), endpoints, CycleState()), [0, 32 / 40])
    scorer.response_complete(request(tokens), B, 40, 1)
    now[0] = 31.9  # the TTL after the response's end
    np.testing.assert_allclose(scorer.score(request(tokens), endpoints, CycleState()), [0, 32 / 40])
    now[0] = 32.1
    assert scorer.score(request(tokens), endpoints, CycleState()).tolist() == [0, 0]
    assert scorer.index.speculative_size() == 0 and scorer.index.held_size() == 0


def test_a_block_stays_held_while_any_request_computing_it_is_in_flight():
    now = [0.0]
    scorer = PrecisePrefixCacheScorer(speculative_ttl_s=1.0)
    scorer.index.clock = lambda: now[0]
    tokens = list(range(40))
    endpoints = [state(A, 16)]
    scorer.pre_request(request(tokens, rid="r1"), endpoints[0], CycleState())
    scorer.pre_request(request(tokens, rid="r2"), endpoints[0], CycleState())
    scorer.response_complete(request(tokens, rid="r1"), A, 40, 1)
    now[0] = 5.0  # r1's TTL is over, r2 still holds the blocks
    assert scorer.cached_tokens(request(tokens), endpoints, None).tolist() == [32]
    scorer.response_complete(request(tokens, rid="r2"), A, 40, 1)
    now[0] = 5.9
    assert scorer.cached_tokens(request(tokens), endpoints, None).tolist() == [32]
    now[0] = 6.1
    assert scorer.cached_tokens(request(tokens), endpoints, None).tolist() == [0]


def test_the_engines_events_end_a_hold():
    """Once the engine announces a held block, its events decide: an eviction while the request still decodes
    makes the prefix cold at once (a hold kept until the response's end would still count it)."""
    now = [0.0]
    scorer = PrecisePrefixCacheScorer(speculative_ttl_s=2.0)
    scorer.index.clock = lambda: now[0]
    tokens = list(range(40))
    endpoints = [state(A, 16)]
    scorer.index.watch(A, 1)
    scorer.pre_request(request(tokens, rid="r1"), endpoints[0], CycleState())
    hashes = chain(tokens[:32], 16, root_hash(None, None))
    scorer.index.apply(Delta(A, 1, added=hashes, block_size=16))
    assert scorer.index.held_size() == 0 and scorer.index.speculative_size() == 0
    assert scorer.cached_tokens(request(tokens), endpoints, None).tolist() == [32]
    scorer.index.apply(Delta(A, 1, removed=hashes[1:]))  # evicted while r1 still runs
    assert scorer.cached_tokens(request(tokens), endpoints, None).tolist() == [16]
    scorer.response_complete(request(tokens, rid="r1"), A, 40, 1)  # nothing left to release
    assert scorer.cached_tokens(request(tokens), endpoints, None).tolist() == [16]


def test_holds_end_at_the_max_hold_and_are_bounded():
    now = [0.0]
    scorer = PrecisePrefixCacheScorer(speculative_ttl_s=1.0, max_speculative_hold_s=10.0, max_speculative=4)
    scorer.index.clock = lambda: now[0]
    endpoints = [state(A, 4)]
    first, second = list(range(13)), list(range(100, 113))  # 3 usable blocks each
    scorer.pre_request(request(first, rid="r1"), endpoints[0], CycleState())
    now[0] = 10.5  # no response end came: the hold ends at 10 s, then the TTL
    assert scorer.cached_tokens(request(first), endpoints, CycleState()).tolist() == [12]
    now[0] = 11.1
    assert scorer.cached_tokens(request(first), endpoints, CycleState()).tolist() == [0]
    scorer.pre_request(request(first, rid="r2"), endpoints[0], CycleState())
    scorer.pre_request(request(second, rid="r3"), endpoints[0], CycleState())  # 6 held blocks > 4: r2 released
    assert scorer.index.held_size() == 3 and len(scorer._held) == 1
    now[0] = 12.2
    assert scorer.cached_tokens(request(first), endpoints, CycleState()).tolist() == [0]
    assert scorer.cached_tokens(request(second), endpoints, CycleState()).tolist() == [12]


def test_no_hold_gives_the_ttl_from_the_pick_and_removal_drops_holds():
    now = [0.0]
    scorer = PrecisePrefixCacheScorer(speculative_ttl_s=2.0, max_speculative_hold_s=0)
    scorer.index.clock = lambda: now[0]
    tokens = list(range(40))
    scorer.pre_request(request(tokens), state(A, 16))
    now[0] = 2.5
    assert scorer.cached_tokens(request(tokens), [state(A, 16)], None).tolist() == [0]
    held = PrecisePrefixCacheScorer(speculative_ttl_s=2.0)
    held.pre_request(request(tokens), state(A, 16))
    held.remove_endpoint(A)
    assert held.index.held_size() == 0 and held.index.speculative_size() == 0 and not held._held
    held.response_complete(request(tokens), A, 40, 1)  # after its endpoint left: nothing to release
    assert held.cached_tokens(request(tokens), [state(A, 16)], None).tolist() == [0]


def test_one_tokenization_per_cycle():
    scorer = PrecisePrefixCacheScorer(speculative_ttl_s=1)
    calls = []
    real = scorer.tokenizer.prefix_tokens
    scorer.tokenizer.prefix_tokens = lambda r, limit: calls.append(r) or real(r, limit)
    r = LLMRequest("r", "m", "m", "", body={"prompt": "hello world " * 20})
    cycle = CycleState()
    endpoints = [state(A), state(B)]
    scorer.prompt_tokens(r, cycle)
    scorer.cached_tokens(r, endpoints, cycle)
    scorer.score(r, endpoints, cycle)
    scorer.pre_request(r, endpoints[0], cycle)
    assert len(calls) == 1 and scorer.prompt_tokens(r, cycle) == 240


def test_untokenizable_requests_estimate_the_length_and_match_nothing():
    scorer = PrecisePrefixCacheScorer(speculative_ttl_s=1)
    r = LLMRequest("r", "m", "m", "a" * 400, body={"prompt": ["a" * 200, "a" * 200]})  # two prompts
    assert scorer.prompt_tokens(r, None) == 100  # len / 4
    assert scorer.score(r, [state(A)], None).tolist() == [0]
    scorer.pre_request(r, state(A))
    assert scorer.index.speculative_size() == 0


class Consumer(Scorer):
    type_name = "consumer"
    consumes_optional = (PREFIX_MATCH,)

    def score(self, request, endpoints, cycle=None):
        return np.zeros(len(endpoints))


def test_it_produces_the_prefix_match_load_aware_plugins_read():
    scorer = PrecisePrefixCacheScorer(speculative_ttl_s=0)
    consumer = Consumer()
    profile = SchedulingProfile("p", [], [WeightedScorer(scorer, 1.0), WeightedScorer(consumer, 1.0)],
                                create_plugin("max-score-picker"))
    profile.link()
    assert consumer.inputs == {PREFIX_MATCH: "precise-prefix-cache-scorer"}
    tokens = list(range(13))
    holding(scorer, A, tokens[:12], 4)
    endpoints = [state(A), state(B)]
    cycle = CycleState()
    profile.produce(request(tokens), endpoints, cycle)
    match = cycle.read(consumer, PREFIX_MATCH)
    assert match.prompt_tokens == 13 and match.cached.of(endpoints).tolist() == [12, 0]
    assert match.cached.of(endpoints[1:]).tolist() == [0] and match.cached.of([state(C)]).tolist() == [0]


def test_matches_the_engine_tokenizer_and_chat_template():
    scorer = PrecisePrefixCacheScorer()
    engine_tok = load_tokenizer(scorer.tokenizer.path)  # what the sim engine loads without a tokenizer
    text = "Héllo, wörld! 🌍 " * 10
    assert scorer.tokenizer.tokens(LLMRequest("r", "m", "m", text, body={"prompt": text})) == engine_tok.encode(text)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text",
                                                                                     "text": "hi there"}]}]
    ids = scorer.tokenizer.tokens(LLMRequest("r", "m", "m", "", body={"messages": messages}))
    flat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    rendered = engine_tok.apply_chat_template(flat, tokenize=True, add_generation_prompt=True)
    assert ids == list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered) and len(ids) > 20
    untrusted = {"messages": flat, "chat_template": "{{ messages }}"}
    assert scorer.tokenizer.tokens(LLMRequest("r", "m", "m", "", body=untrusted)) is None


@pytest.mark.parametrize("params, message", [
    ({"speculativeTTL": -1}, "speculativeTTL must be a number of seconds"),
    ({"maxSpeculativeHold": 7200}, "maxSpeculativeHold must be a number of seconds"),
    ({"speculativeTTL": "2s"}, "speculativeTTL must be a number of seconds"),
    ({"blockSize": 0}, "blockSize must be >= 1"),
    ({"tokenizer": 7}, "tokenizer must be a folder path"),
    ({"indexMaxBytes": 10}, "indexMaxBytes must be >= 65536"),
    ({"blocksize": 16}, "unknown parameter(s) blocksize"),
])
def test_bad_parameters_are_clear_errors(params, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        create_plugin("precise-prefix-cache-scorer", params)


def test_usable_from_an_endpoint_picker_config():
    config = parse_config("""
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
  parameters: {speculativeTTL: 1.5, blockSize: 16}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: precise-prefix-cache-scorer
    weight: 3
  - pluginRef: max-score-picker
""", source="test")
    plugin = config.scheduler.plugins["precise-prefix-cache-scorer"]
    assert plugin.index.speculative_ttl_s == 1.5 and plugin.subscriber is None  # no thread until the EPP starts it
    with pytest.raises(ConfigError, match="speculativeTTL"):
        parse_config("""
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
  parameters: {speculativeTTL: true}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: precise-prefix-cache-scorer}, {pluginRef: max-score-picker}]
""", source="test")


@pytest.mark.slow
def test_tokenize_and_hash_cost():
    """µs per request for a 1k-token prompt (printed; the numbers in the plugin's docstring come from here)."""
    scorer = PrecisePrefixCacheScorer(speculative_ttl_s=1)
    text = "".join(chr(97 + i % 26) for i in range(1023))  # byte tokenizer: 1023 tokens
    chat = [{"role": "user", "content": text[:1000]}]
    endpoints = [state(A, 16), state(B, 16)]
    holding(scorer, A, scorer.tokenizer.encode(text)[:512], 16)
    timings = {}
    for name, body in (("completion", {"prompt": text}), ("chat", {"messages": chat})):
        r = LLMRequest("r", "m", "m", "", body=body)
        best = {}
        for _ in range(200):
            t0 = time.perf_counter()
            tokens = scorer.tokenizer.tokens(r)
            t1 = time.perf_counter()
            hashes = chain(tokens[:1008], 16, root_hash(None, None))
            t2 = time.perf_counter()
            scorer.score(r, endpoints, CycleState())
            t3 = time.perf_counter()
            for key, value in (("tokenize", t1 - t0), ("hash", t2 - t1), ("score total", t3 - t2)):
                best[key] = min(best.get(key, 1), value)
        timings[name] = {k: round(v * 1e6, 1) for k, v in best.items()}
        assert len(tokens) >= 1000 and len(hashes) == min(len(tokens), 1008) // 16
    print("best-of-200 µs, 1k-token prompt:", timings)
    assert timings["completion"]["score total"] < 5000  # generous: a shared, loaded machine
