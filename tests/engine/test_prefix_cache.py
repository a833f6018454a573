"""Prefix caching, counted: which tokens are computed, which blocks stay hits, and cache_salt isolation."""


import pytest

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.block_pool import BlockPool
from kvgate.engine.kv_cache_manager import KVCacheManager
from kvgate.engine.request import Request
from tests.engine.tiny_models import random_tokens as tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    return LLM(str(folder), max_model_len=256, num_gpu_blocks_override=40)


def count_computed(llm, monkeypatch):
    """Record how many tokens each request has computed by the model."""
    counts: dict[str, int] = {}
    runner = llm.engine.runner
    original = runner.launch

    def launch(out, *args):
        for s in out.scheduled:
            counts[s.request.request_id] = counts.get(s.request.request_id, 0) + s.num_new_tokens
        return original(out, *args)

    monkeypatch.setattr(runner, "launch", launch)
    return counts


def run_one(llm, prompt, **kw):
    return llm.generate([{"prompt_token_ids": prompt}], GREEDY, **kw)[0]


def test_shared_prefix_computes_only_uncached_tokens(llm, monkeypatch):
    llm.engine.reset_prefix_cache()
    counts = count_computed(llm, monkeypatch)
    prefix = tokens(64, 1)
    first = run_one(llm, prefix + tokens(10, 2))
    assert first.num_cached_tokens == 0
    second = run_one(llm, prefix + tokens(7, 3))
    assert second.num_cached_tokens == 64
    # 7 new prompt tokens + 3 decode steps (the 4th token needs no forward): nothing of the prefix again
    assert counts[second.request_id] == 7 + GREEDY.max_tokens - 1
    assert counts[first.request_id] == 74 + GREEDY.max_tokens - 1


def test_last_prompt_token_is_always_recomputed(llm, monkeypatch):
    llm.engine.reset_prefix_cache()
    counts = count_computed(llm, monkeypatch)
    prompt = tokens(64, 4)  # exactly four full blocks
    run_one(llm, prompt)
    again = run_one(llm, prompt)
    assert again.num_cached_tokens == 48  # the fourth block holds the last token, which must be computed
    assert counts[again.request_id] == 16 + GREEDY.max_tokens - 1


def test_finished_blocks_stay_hits_until_reused(llm):
    llm.engine.reset_prefix_cache()
    prefix = tokens(64, 5)
    run_one(llm, prefix + [1, 2, 3])
    assert llm.engine.stats().kv_cache_usage == 0.0  # nothing held, yet ...
    assert run_one(llm, prefix + [4, 5]).num_cached_tokens == 64  # ... still cached
    # Fill the whole pool (40 blocks) with other prompts: the LRU free queue must hand out the old blocks.
    for seed in range(6):
        run_one(llm, tokens(150, 100 + seed))
    assert run_one(llm, prefix + [6, 7]).num_cached_tokens == 0


def test_cache_salt_isolates(llm):
    llm.engine.reset_prefix_cache()
    prefix = tokens(64, 6)
    run_one(llm, prefix + [1], cache_salt="tenant-a")
    assert run_one(llm, prefix + [2], cache_salt="tenant-b").num_cached_tokens == 0
    assert run_one(llm, prefix + [3]).num_cached_tokens == 0
    assert run_one(llm, prefix + [4], cache_salt="tenant-a").num_cached_tokens == 64


def test_prefix_stats_count_tokens(llm):
    llm.engine.reset_prefix_cache()
    before = llm.engine.stats()
    prefix = tokens(32, 7)
    run_one(llm, prefix + [1, 2])
    run_one(llm, prefix + [3, 4])
    after = llm.engine.stats()
    assert after.prefix_cache_queries - before.prefix_cache_queries == 68
    assert after.prefix_cache_hits - before.prefix_cache_hits == 32


# -- the block pool and manager directly -----------------------------------------------------------


def test_free_queue_evicts_least_recently_freed_first():
    pool = BlockPool(4, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_block(a, b"a")
    pool.cache_block(b, b"b")
    pool.free_blocks([b, a])  # b freed first -> evicted first
    assert pool.num_free_blocks == 4
    new = pool.get_new_blocks(3)  # the two never-used blocks, then b
    assert b in new and a not in new
    assert pool.get_cached_block(b"b") is None and pool.get_cached_block(b"a") is a


def test_touching_a_free_cached_block_takes_it_off_the_queue():
    pool = BlockPool(2, enable_caching=True)
    (a,) = pool.get_new_blocks(1)
    pool.cache_block(a, b"a")
    pool.free_blocks([a])
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.num_free_blocks == 1
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)


def test_shared_blocks_are_refcounted():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    p = SamplingParams(max_tokens=1)
    r1 = Request("r1", list(range(9)), p)
    assert kv.allocate_slots(r1, 9) is not None
    r1.num_computed_tokens = 9
    r2 = Request("r2", list(range(8)) + [99], p)
    hits, n = kv.get_computed_blocks(r2)
    assert n == 8 and [b.block_id for b in hits] == kv.get_block_ids("r1")[:2]
    kv.allocate_slots(r2, 1, hits, n)
    assert [b.ref_cnt for b in hits] == [2, 2]
    kv.free(r1)
    assert [b.ref_cnt for b in hits] == [1, 1]
    assert kv.pool.num_free_blocks == 8 - 3


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = Request("r", list(range(12)), SamplingParams(max_tokens=1))
    assert kv.allocate_slots(r, 12) is None
    assert kv.pool.num_free_blocks == 2 and kv.get_block_ids("r") == []
