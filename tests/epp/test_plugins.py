"""Each scheduling plugin's math, on hand-built endpoint states."""

import collections

import pytest

from kvgate.epp.prefix.approx_index import PrefixIndex
from kvgate.epp.prefix.hashing import hash_prompt
from kvgate.epp.scheduling.framework import CycleState, PinnedOrder, score_map
from kvgate.epp.scheduling.plugins import REGISTRY, create_plugin
from kvgate.epp.scheduling.plugins.header_filter import HeaderBasedTestingFilter, split_host_port
from kvgate.epp.scheduling.plugins.kv_cache_utilization_scorer import KVCacheUtilizationScorer
from kvgate.epp.scheduling.plugins.lora_affinity_scorer import LoraAffinityScorer
from kvgate.epp.scheduling.plugins.pickers import MaxScorePicker, RandomPicker, WeightedRandomPicker
from kvgate.epp.scheduling.plugins.prefix_cache_scorer import PrefixCacheScorer
from kvgate.epp.scheduling.plugins.queue_scorer import QueueScorer
from kvgate.epp.scheduling.plugins.running_requests_scorer import RunningRequestsScorer
from kvgate.epp.scheduling.plugins.token_load_scorer import TokenLoadScorer
from tests.epp.helpers import addresses, request, state

A, B, C, D = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.1:8002"


def scored(plugin, req, endpoints):
    """{address: score} of a scorer's answer (dense arrays or sparse mappings alike)."""
    return score_map(plugin.score(req, endpoints), endpoints)


def hits(plugin, req, endpoints):
    """The endpoints a scorer scores above 0: the prefix scorer's matches."""
    return {a: v for a, v in scored(plugin, req, endpoints).items() if v}


# ------------------------------------------------------------------------------------------- load scorers

def test_queue_scorer_min_max():
    scores = scored(QueueScorer(), request(), [state(A, queue=0), state(B, queue=5), state(C, queue=10)])
    assert scores == {A: 1.0, B: 0.5, C: 0.0}


def test_queue_scorer_all_equal_is_all_one():
    assert scored(QueueScorer(), request(), [state(A, queue=3), state(B, queue=3)]) == {A: 1.0, B: 1.0}
    assert scored(QueueScorer(), request(), [state(A, queue=7)]) == {A: 1.0}


def test_running_requests_scorer_min_max():
    scores = scored(RunningRequestsScorer(), request(), [state(A, running=2), state(B, running=6), state(C, running=4)])
    assert scores == {A: 1.0, B: 0.0, C: 0.5}


def test_token_load_scorer_uses_in_flight_tokens():
    scores = scored(TokenLoadScorer(), request(), [state(A, tokens=100), state(B, tokens=300), state(C, tokens=200)])
    assert scores == {A: 1.0, B: 0.0, C: 0.5}
    assert scored(TokenLoadScorer(), request(), [state(A), state(B)]) == {A: 1.0, B: 1.0}


def test_kv_cache_scorer_is_free_fraction():
    scores = scored(KVCacheUtilizationScorer(), request(), [state(A, kv=0.0), state(B, kv=0.25), state(C, kv=1.5)])
    assert scores == {A: 1.0, B: 0.75, C: 0.0}


# ------------------------------------------------------------------------------------------- lora affinity

def test_lora_affinity_levels():
    endpoints = [
        state(A, max_lora=2, running_loras={"sql"}),  # running
        state(B, max_lora=2, running_loras={"x", "y"}, waiting_loras={"sql"}),  # waiting
        state(C, max_lora=2, running_loras={"x"}),  # a free slot
        state(D, max_lora=2, running_loras={"x", "y"}),  # full
    ]
    assert scored(LoraAffinityScorer(), request(model="sql"), endpoints) == {A: 1.0, B: 0.8, C: 0.6, D: 0.0}


def test_lora_affinity_without_adapters_is_neutral():
    scores = scored(LoraAffinityScorer(), request(model="base"), [state(A), state(B)])
    assert scores == {A: 1.0, B: 1.0}


# ------------------------------------------------------------------------------------------- header filter

def header(value):
    return request(headers={"test-epp-endpoint-selection": value})


@pytest.mark.parametrize("listed", [[B], [C, A], [B, C, A]])
def test_header_filter_keeps_listed_order(listed):
    out = HeaderBasedTestingFilter().filter(header(",".join(listed)), [state(A), state(B), state(C)])
    assert isinstance(out, PinnedOrder)
    assert addresses(out) == listed


def test_header_filter_bare_ip_selects_every_port_of_the_pod_spread_over_requests():
    endpoints = [state(A), state(B), state(D)]  # A and D: two data-parallel ranks of 10.0.0.1
    seconds = collections.Counter()
    for i in range(100):
        selection = request(request_id=str(i), headers={"test-epp-endpoint-selection": "10.0.0.2, 10.0.0.1"})
        out = addresses(HeaderBasedTestingFilter().filter(selection, endpoints))
        assert out[0] == B and sorted(out[1:]) == sorted([A, D])
        seconds[out[1]] += 1
    assert min(seconds.values()) > 25


def test_header_filter_exact_port_and_dedup():
    endpoints = [state(A), state(B), state(D)]
    assert addresses(HeaderBasedTestingFilter().filter(header(f"{D},{D},10.0.0.1"), endpoints)) == [D, A]


def test_header_filter_unknown_address_is_empty():
    endpoints = [state(A), state(B)]
    assert HeaderBasedTestingFilter().filter(header("256.256.256.256"), endpoints) == []
    assert HeaderBasedTestingFilter().filter(header("10.0.0.1:9999"), endpoints) == []


def test_header_filter_absent_or_blank_is_noop():
    endpoints = [state(A), state(B)]
    f = HeaderBasedTestingFilter()
    assert f.filter(request(), endpoints) is endpoints
    assert f.filter(header("  "), endpoints) is endpoints
    mixed_case = request(headers={"Test-EPP-Endpoint-Selection": B})
    assert addresses(f.filter(mixed_case, endpoints)) == [B]


def test_split_host_port():
    assert split_host_port("1.2.3.4:80") == ("1.2.3.4", "80")
    assert split_host_port("1.2.3.4") == ("1.2.3.4", "")
    assert split_host_port("[fd00::1]:80") == ("fd00::1", "80")
    assert split_host_port("fd00::1") == ("fd00::1", "")


# ------------------------------------------------------------------------------------------- pickers

def test_max_score_picker_orders_by_score():
    endpoints = [state(A), state(B), state(C)]
    ordered = MaxScorePicker().pick(request(), endpoints, {A: 0.2, B: 0.9, C: 0.5})
    assert addresses(ordered) == [B, C, A]


def test_max_score_picker_spreads_ties_deterministically_per_request():
    endpoints = [state(A), state(B), state(C), state(D)]
    scores = {A: 1.0, B: 1.0, C: 1.0, D: 0.0}
    picker = MaxScorePicker()
    firsts = collections.Counter(picker.pick(request(request_id=f"r{i}"), endpoints, scores)[0].address
                                 for i in range(600))
    assert set(firsts) == {A, B, C}
    assert min(firsts.values()) > 120  # roughly a third each
    again = picker.pick(request(request_id="r7"), endpoints, scores)
    assert addresses(again) == addresses(picker.pick(request(request_id="r7"), endpoints, scores))
    assert again[-1].address == D


def test_picker_max_endpoints_caps_the_list():
    endpoints = [state(A), state(B), state(C)]
    picker = create_plugin("max-score-picker", {"maxNumOfEndpoints": 2})
    assert addresses(picker.pick(request(), endpoints, {A: 0.1, B: 0.3, C: 0.2})) == [B, C]


def test_random_picker_returns_a_permutation():
    endpoints = [state(A), state(B), state(C)]
    seen = set()
    for i in range(50):
        ordered = addresses(RandomPicker().pick(request(request_id=str(i)), endpoints, dict.fromkeys([A, B, C], 0.0)))
        assert sorted(ordered) == sorted([A, B, C])
        seen.add(ordered[0])
    assert seen == {A, B, C}


def test_weighted_random_picker_is_proportional_and_zero_goes_last():
    endpoints = [state(A), state(B), state(C)]
    scores = {A: 3.0, B: 1.0, C: 0.0}
    firsts = collections.Counter()
    for i in range(2000):
        ordered = WeightedRandomPicker().pick(request(request_id=str(i)), endpoints, scores)
        assert ordered[-1].address == C and len(ordered) == 3
        firsts[ordered[0].address] += 1
    assert 0.70 < firsts[A] / 2000 < 0.80  # expected 0.75


def test_weighted_random_picker_all_zero_is_uniform():
    endpoints = [state(A), state(B)]
    firsts = collections.Counter(WeightedRandomPicker().pick(request(request_id=str(i)), endpoints,
                                                             {A: 0.0, B: 0.0})[0].address for i in range(400))
    assert min(firsts.values()) > 140


# ------------------------------------------------------------------------------------------- prefix cache

PROMPT = "You are a helpful assistant. " * 40  # 1160 characters = 18 blocks of 64


def scorer(**kw):
    kw.setdefault("auto_tune", False)
    return PrefixCacheScorer(**kw)


def test_hash_prompt_chains_and_salts():
    h = hash_prompt(PROMPT, "m", None, 64, 256)
    assert len(h) == len(PROMPT) // 64
    assert hash_prompt(PROMPT[:640], "m", None, 64, 256) == h[:10]  # a prefix hashes to a prefix
    assert hash_prompt(PROMPT, "other", None, 64, 256)[0] != h[0]
    assert hash_prompt(PROMPT, "m", "salt", 64, 256)[0] != h[0]
    assert len(hash_prompt(PROMPT, "m", None, 64, 5)) == 5
    assert hash_prompt("short", "m", None, 64, 256) == []


def test_prefix_same_prompt_goes_to_same_endpoint_after_pick():
    s = scorer()
    endpoints = [state(A), state(B)]
    first = request(PROMPT, request_id="1")
    assert hits(s, first, endpoints) == {}
    s.pre_request(first, endpoints[1])
    again = request(PROMPT + " and a different question", request_id="2")
    assert hits(s, again, endpoints) == {B: pytest.approx(18 / len(hash_prompt(again.prompt, "m", None, 64, 256)))}
    assert hits(s, request(PROMPT, request_id="3"), endpoints) == {B: 1.0}


def test_prefix_partial_match_counts_leading_blocks_only():
    s = scorer()
    s.pre_request(request(PROMPT[:640], request_id="1"), state(A))  # 10 blocks
    assert hits(s, request(PROMPT, request_id="2"), [state(A)]) == {A: pytest.approx(10 / 18)}
    changed_start = "X" + PROMPT[1:]
    assert hits(s, request(changed_start, request_id="3"), [state(A)]) == {}


def test_prefix_different_model_or_salt_misses():
    s = scorer()
    s.pre_request(request(PROMPT, model="m1", request_id="1"), state(A))
    assert hits(s, request(PROMPT, model="m2", request_id="2"), [state(A)]) == {}
    assert hits(s, request(PROMPT, model="m1", cache_salt="tenant", request_id="3"), [state(A)]) == {}
    assert hits(s, request(PROMPT, model="m1", request_id="4"), [state(A)]) == {A: 1.0}


def test_prefix_lru_evicts_oldest_blocks_per_endpoint():
    s = scorer(lru_capacity_per_server=18)
    old, new = "a" * 64 * 18, "b" * 64 * 18
    s.pre_request(request(old, request_id="1"), state(A))
    s.pre_request(request(old, request_id="2"), state(B))
    s.pre_request(request(new, request_id="3"), state(A))  # pushes every block of `old` out of A only
    assert hits(s, request(old, request_id="4"), [state(A), state(B)]) == {B: 1.0}
    assert hits(s, request(new, request_id="5"), [state(A), state(B)]) == {A: 1.0}
    assert s.stats()["index_size"] == 36


def test_prefix_remove_endpoint_drops_its_index():
    s = scorer()
    s.pre_request(request(PROMPT, request_id="1"), state(A))
    s.pre_request(request(PROMPT, request_id="2"), state(B))
    s.remove_endpoint(A)
    assert hits(s, request(PROMPT, request_id="3"), [state(A), state(B)]) == {B: 1.0}
    assert s.index.endpoints() == [B]
    s.remove_endpoint(B)
    assert s.stats()["index_size"] == 0 and s.index._holders == {}


def test_prefix_stats_hit_ratio():
    s = scorer()
    for i, endpoint in enumerate([state(A), state(A)]):
        req = request(PROMPT, request_id=str(i))
        cycle = CycleState()
        s.score(req, [endpoint], cycle)
        s.pre_request(req, endpoint, cycle)
    stats = s.stats()
    assert stats["total_blocks"] == 36 and stats["hit_blocks"] == 18 and s.hit_ratio() == 0.5
    assert stats["indexed_endpoints"] == 1


def test_prefix_auto_tune_follows_kv_block_size():
    s = PrefixCacheScorer(block_size=64, auto_tune=True)
    assert s.block_size_for([state(A, block_size=32)]) == 128
    assert s.block_size_for([state(A)]) == 64


def test_prefix_index_match_lengths():
    index = PrefixIndex(100)
    index.add([1, 2, 3, 4], A)
    index.add([1, 2], B)
    index.add([1, 2, 3, 4, 5], C)
    assert index.match([1, 2, 3, 4, 5]) == {A: 4, B: 2, C: 5}
    assert index.match([9, 2]) == {}


def test_prefix_factory_parameters():
    p = create_plugin("prefix-cache-scorer", {"blockSize": 32, "maxPrefixBlocksToMatch": 8,
                                              "lruCapacityPerServer": 100})
    assert (p.block_size, p.max_prefix_blocks, p.index.capacity, p.auto_tune) == (32, 8, 100, False)
    p = create_plugin("prefix-cache-scorer", {"blockSizeTokens": 16, "maxPrefixTokensToMatch": 1024})
    assert (p.block_size, p.max_prefix_blocks) == (64, 64)
    assert create_plugin("prefix-cache-scorer").auto_tune is True
    with pytest.raises(ValueError, match="blockSize"):
        create_plugin("prefix-cache-scorer", {"blockSize": "big"})
    with pytest.raises(ValueError, match="unknown parameter"):
        create_plugin("prefix-cache-scorer", {"blocksize": 8})


def test_registry_names_match_upstream():
    assert set(REGISTRY) == {
        "queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer", "lora-affinity-scorer",
        "running-requests-size-scorer", "token-load-scorer", "header-based-testing-filter", "max-score-picker",
        "random-picker", "weighted-random-picker", "single-profile-handler",
        # llm-d's names, and kvgate's own predicted-ttft-scorer, predicted-latency-scorer, prefix-group-balance-scorer,
        # prefill-interference-scorer, previous-response-affinity-filter
        "precise-prefix-cache-scorer", "prefix-cache-affinity-filter", "no-hit-lru-scorer", "predicted-ttft-scorer",
        "predicted-latency-scorer", "prefix-group-balance-scorer", "prefill-interference-scorer",
        "previous-response-affinity-filter"}
    for type_name in REGISTRY:
        assert create_plugin(type_name).type_name == type_name


def test_prompt_hasher_memo_matches_hash_prompt():
    import random

    from kvgate.epp.prefix.hashing import PromptHasher

    rng = random.Random(3)
    hasher = PromptHasher(capacity=4)  # small: evictions happen too
    system = [PROMPT * k for k in (1, 2, 5)]
    prompts = [rng.choice(system)[: rng.randint(0, 3000)] + f"question {i} " * rng.randint(0, 40)
               for i in range(200)] + ["x" * 63, "é" * 100, PROMPT * 20]
    for prompt in prompts:
        for block_size, max_blocks in ((64, 256), (64, 10), (32, 256)):
            for model, salt in (("m", None), ("m", "s"), ("n", None)):
                assert hasher.hashes(prompt, model, salt, block_size, max_blocks) == \
                    hash_prompt(prompt, model, salt, block_size, max_blocks)
