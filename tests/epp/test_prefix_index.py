"""The prefix index's bounds: per-endpoint capacity (from the engine when it reports it), a global memory budget
held with real memory (tracemalloc), global LRU eviction, prefix-closed matches, and id reuse."""

import random
import tracemalloc

import pytest

from kvgate.epp.scheduling.framework import CycleState, Scheduler, score_map
from kvgate.epp.scheduling.plugins import create_plugin
from kvgate.epp.prefix.approx_index import MIN_INDEX_BYTES, PrefixIndex
from kvgate.epp.prefix.hashing import hash_prompt
from kvgate.epp.scheduling.plugins.prefix_cache_scorer import PrefixCacheScorer
from tests.epp.helpers import request, state

A, B, C, E = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000", "10.0.0.5:8000"
PROMPT = "You are a helpful assistant. " * 40  # 1160 characters = 18 blocks of 64


def address(i: int) -> str:
    return f"10.{i // 65536}.{i // 256 % 256}.{i % 256}:8000"


def fill(index: PrefixIndex, endpoints: int, blocks: int, rng: random.Random, shared: list[int] = ()) -> None:
    """Every endpoint gets `blocks` blocks: the `shared` chain, then unique ones (the worst case for memory)."""
    for i in range(endpoints):
        index.add(list(shared) + [rng.getrandbits(64) for _ in range(blocks - len(shared))], address(i))


@pytest.mark.slow
@pytest.mark.parametrize("shared_blocks", [0, 64])
def test_1000_endpoints_at_full_capacity_stay_under_the_memory_budget(shared_blocks):
    budget = 8 * 1024 * 1024
    rng = random.Random(shared_blocks)
    shared = [rng.getrandbits(64) for _ in range(shared_blocks)]
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex(capacity_per_server=200, max_bytes=budget)
        fill(index, 1000, 200, rng, shared)  # 200k entries wanted: ~60 MB unbounded
        fill(index, 1000, 200, rng, shared)  # and a second round: eviction under churn
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert index.evictions > 0 and 0 < index.size() <= index.max_entries
    assert used <= budget, f"index uses {used} bytes, budget {budget}"
    assert used > budget // 2  # the budget is used, not left idle by an over-cautious estimate
    # Globally LRU: the most recently served endpoints keep all their blocks, the oldest are gone.
    kept = index.endpoints()
    assert len(kept) >= index.max_entries // 200 and address(999) in kept and address(0) not in kept
    assert len(index._lru[index.id_of(address(999))]) == 200


def test_global_eviction_takes_the_least_recently_used_entries_of_any_endpoint():
    index = PrefixIndex(capacity_per_server=1000, max_bytes=MIN_INDEX_BYTES)
    per_request = index.max_entries // 4
    old_a = list(range(1, per_request + 1))
    old_b = list(range(10_000, 10_000 + per_request))
    index.add(old_a, A)
    index.add(old_b, B)
    index.add(old_a, A)  # A's blocks are used again: B's are now the oldest
    # Room for all but `per_request` entries: exactly B's go, not A's (older by insertion, newer by use).
    index.add(list(range(20_000, 20_000 + index.max_entries - per_request)), C)
    assert index.match(old_a) == {A: per_request}
    assert index.match(old_b) == {}
    assert index.size() <= index.max_entries


def test_eviction_keeps_a_prefix_not_a_suffix():
    """Over capacity, an endpoint keeps the leading blocks of a prompt (what the engine's own cache keeps); the
    old index evicted the first blocks first and then matched nothing."""
    index = PrefixIndex(capacity_per_server=6)
    chain = list(range(100, 110))
    index.add(chain, A)
    assert index.match(chain) == {A: 6}
    assert index.match(chain[:4]) == {A: 4}


def test_capacity_follows_the_engines_kv_cache():
    s = PrefixCacheScorer(block_size=64, lru_capacity_per_server=1000, auto_tune=True)
    small = state(A, block_size=16)
    small.metrics.num_kv_blocks = 10  # 10 × 16 tokens = 160 tokens = 10 index blocks of 16 tokens
    assert s.capacity_for(small) == 10
    assert s.capacity_for(state(B, block_size=16)) == 1000  # not reported: lruCapacityPerServer
    cycle = CycleState()
    s.score(request(PROMPT), [small], cycle)
    s.pre_request(request(PROMPT), small, cycle)
    assert s.index.size() == 10
    assert score_map(s.score(request(PROMPT, request_id="2"), [small]), [small]) == {A: pytest.approx(10 / 18)}


def test_match_of_a_prefix_every_endpoint_holds_is_one_run():
    index = PrefixIndex(capacity_per_server=1000)
    hashes = list(range(1, 65))
    for i in range(1000):
        index.add(hashes, address(i))
    index.add(hashes + [999_999], address(7))
    runs = index.match_runs(hashes + [999_999, 123])
    assert [(mask.bit_count(), n) for mask, n in runs] == [(1, 65), (999, 64)]


def test_removed_endpoint_id_reuse_does_not_leak_scores():
    s = Scheduler(create_plugin_config())
    prefix = s.plugins_of_type("prefix-cache-scorer")[0]
    endpoints = [state(A), state(B)]
    first = request(PROMPT, request_id="1")
    s.on_picked(first, endpoints[0])  # A holds the prompt
    cycle = CycleState()
    s.schedule(request(PROMPT, request_id="2"), endpoints, cycle)
    s.remove_endpoint(A)
    newcomer = [state(E), state(B)]
    s.on_picked(request("other " * 40, request_id="3"), newcomer[0])  # E takes A's freed id
    assert prefix.index.id_of(E) == 0
    scores = score_map(prefix.score(request(PROMPT, request_id="4"), newcomer, CycleState()), newcomer)
    assert scores == {E: 0.0, B: 0.0}


def create_plugin_config():
    from kvgate.epp.scheduling.framework import SchedulerConfig, SchedulingProfile, WeightedScorer

    prefix = create_plugin("prefix-cache-scorer", {"blockSize": 64})
    return SchedulerConfig([SchedulingProfile("p", [], [WeightedScorer(prefix, 1.0)],
                                              create_plugin("max-score-picker"))], {"prefix": prefix})


def test_pre_request_reuses_the_cycles_hashes():
    s = PrefixCacheScorer(block_size=64, auto_tune=False)
    calls = []
    real = s.hashes
    s.hashes = lambda req, endpoints: calls.append(req.request_id) or real(req, endpoints)
    cycle = CycleState()
    r = request(PROMPT)
    s.score(r, [state(A)], cycle)
    s.pre_request(r, state(A), cycle)
    assert calls == [r.request_id]  # hashed once per decision
    s.pre_request(request(PROMPT, request_id="no-cycle"), state(A))
    assert calls == [r.request_id, "no-cycle"]  # without a cycle state it hashes again
    assert hash_prompt(PROMPT, "m", None, 64, 256) == cycle[s][0]


def test_index_budget_parameter_and_minimum():
    p = create_plugin("prefix-cache-scorer", {"indexMaxBytes": 1 << 20})
    assert p.index.max_bytes == 1 << 20 and p.index.max_entries > 0
    with pytest.raises(ValueError, match="indexMaxBytes"):
        create_plugin("prefix-cache-scorer", {"indexMaxBytes": 10})


def test_prefix_index_max_bytes_flag_reaches_the_index():
    import argparse

    from kvgate.epp.main import add_epp_parser
    from kvgate.epp.server_assembly import plugin_context
    from kvgate.epp.scheduling.config import default_config

    parser = argparse.ArgumentParser()
    add_epp_parser(parser.add_subparsers())
    args = parser.parse_args(["epp", "--prefix-index-max-bytes", str(1 << 20)])
    assert parser.parse_args(["epp"]).prefix_index_max_bytes is None  # the plugin's own budget stays
    s = Scheduler(default_config().scheduler)
    s.start(plugin_context(args))
    assert s.plugins_of_type("prefix-cache-scorer")[0].index.max_bytes == 1 << 20
    with pytest.raises(SystemExit):
        parser.parse_args(["epp", "--prefix-index-max-bytes", "100"])
