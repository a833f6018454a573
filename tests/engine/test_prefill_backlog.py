"""The scheduler's prefill backlog (`kvgate:num_prefill_tokens_pending`): exact values through admission,
chunked prefill, prefix-cache hits, preemption and abort, and equal to a full recount after every change."""

import random

from kvgate.engine.kv_cache_manager import KVCacheManager
from kvgate.engine.request import Request, RequestStatus
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.scheduler import prefill_tokens_pending
from tests.engine.helpers import request, sampled, scheduler, step


def recount(s) -> int:
    return sum(prefill_tokens_pending(r) for r in s.requests.values())


def test_exact_values_through_chunked_prefill():
    s = scheduler(max_num_batched_tokens=32)
    assert s.num_prefill_tokens_pending == 0
    s.add_request(request("a", range(100, 150)))  # 50 prompt tokens
    s.add_request(request("b", range(200, 210)))  # 10
    assert s.num_prefill_tokens_pending == 60  # both waiting, in full
    step(s)  # a's first chunk: 32 of 50
    assert s.num_prefill_tokens_pending == 18 + 10
    step(s)  # a's last 18 and all of b: both sampled their first token
    assert s.num_prefill_tokens_pending == 0
    step(s)  # decodes only
    assert s.num_prefill_tokens_pending == 0


def test_prefix_cache_hits_count_as_computed_at_admission():
    s = scheduler(block_size=4, max_num_batched_tokens=64)
    prefix = list(range(500, 520))  # 5 full blocks
    s.add_request(request("a", prefix + [1, 2]))
    step(s)
    assert s.num_prefill_tokens_pending == 0
    s.add_request(request("b", prefix + [3, 4, 5]))
    assert s.num_prefill_tokens_pending == 3 == recount(s)  # waiting: less the 20 tokens the cache held on arrival
    s.max_num_batched_tokens = 2  # admit b with a budget that leaves part of its prompt
    out = s.schedule()
    b = s.requests["b"]
    assert b.num_cached_tokens == 20  # 5 blocks from a
    s.update_from_output(out, sampled(out, 7))
    # a decoded its 1; b got 20 from the cache and 1 computed: 2 of its 23 left
    assert s.num_prefill_tokens_pending == 2 == recount(s)


def test_a_waiting_request_whose_cached_prefix_is_evicted_before_admission_counts_it_once_admitted():
    s = scheduler(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    prefix = list(range(500, 520))  # 5 full blocks
    s.add_request(request("a", prefix + [1], max_tokens=1))
    step(s)  # a ran and finished: its 5 blocks stay cached, free
    s.max_num_seqs = 0  # hold the next arrivals in the queue
    s.add_request(request("b", prefix + [3, 4, 5]))
    assert s.requests["b"].num_cached_on_arrival == 20 and s.num_prefill_tokens_pending == 3
    s.max_num_seqs = 8
    squatter = request("squatter", range(900, 932))
    s.kv.allocate_slots(squatter, 32)  # takes all 8 blocks: the prefix is evicted
    s.kv.free(squatter)
    out = s.schedule()
    assert s.requests["b"].num_cached_tokens == 0  # admission asked the cache again: nothing left
    s.update_from_output(out, sampled(out, 7))
    assert s.num_prefill_tokens_pending == 0 == recount(s)


def test_preempted_request_counts_its_recompute_less_its_decode_token():
    s = scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64, caching=False)
    s.add_request(request("a", range(10, 18)))  # 8 tokens: 2 blocks, then grows
    s.add_request(request("b", range(30, 38)))
    step(s)
    assert s.num_prefill_tokens_pending == 0
    for _ in range(12):  # decode until the 6-block pool preempts the newer request
        step(s)
        assert s.num_prefill_tokens_pending == recount(s)
        if s.num_preemptions:
            break
    assert s.num_preemptions >= 1
    victim = next(r for r in s.requests.values() if r.status == RequestStatus.PREEMPTED)
    assert prefill_tokens_pending(victim) == victim.num_tokens - 1  # prompt + outputs, less the decode token
    assert s.num_prefill_tokens_pending == recount(s) == victim.num_tokens - 1


def test_abort_removes_what_is_left():
    s = scheduler(max_num_batched_tokens=16)
    s.add_request(request("a", range(100, 140)))
    s.add_request(request("b", range(200, 220)))
    step(s)
    assert s.num_prefill_tokens_pending == 24 + 20
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert s.num_prefill_tokens_pending == 20
    s.finish_request("b", RequestStatus.FINISHED_ABORTED)
    assert s.num_prefill_tokens_pending == 0


def test_counter_equals_a_recount_under_a_random_workload():
    rng = random.Random(14)
    for policy in ("fcfs", "priority"):
        s = scheduler(num_blocks=24, block_size=4, max_num_seqs=4, max_num_batched_tokens=24, policy=policy)
        prefixes = [list(range(p * 100, p * 100 + 12)) for p in range(3)]
        next_id = 0
        for _ in range(400):
            if rng.random() < 0.3:
                tail = [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 20))]
                r = request(f"r{next_id}", rng.choice(prefixes) + tail, max_tokens=rng.randrange(1, 12))
                r.priority = rng.randrange(3)
                s.add_request(r)
                next_id += 1
            if s.requests and rng.random() < 0.05:
                s.finish_request(rng.choice(list(s.requests)), RequestStatus.FINISHED_ABORTED)
            step(s, token=rng.randrange(5, 50))
            assert s.num_prefill_tokens_pending == recount(s)
        assert s.num_preemptions > 0  # the pool was tight enough to exercise preemption
        while s.requests:
            s.finish_request(next(iter(s.requests)), RequestStatus.FINISHED_ABORTED)
        assert s.num_prefill_tokens_pending == 0


def test_the_arrival_probe_finds_what_admission_would_and_changes_nothing():
    """KVCacheManager.probe_prefix (what the engine's side asks while a step may run): the same tokens as
    get_computed_blocks for every namespace and length, hashes that begin the request's own, and no table, order
    or statistic touched."""
    from kvgate.engine.lora.request import LoRARequest

    rng = random.Random(5)
    lora = LoRARequest("a", 3, "/nowhere")
    s = scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=256)
    prefix = list(range(300, 330))  # 7 full blocks and 2 tokens
    s.add_request(Request("cached", prefix, SamplingParams(max_tokens=1), max_model_len=256, cache_salt="t1"))
    step(s)
    kv = s.kv  # the adapter's blocks entered as a step would (this scheduler has no adapter manager)
    kv.allocate_slots(Request("lora", prefix, SamplingParams(), max_model_len=256, lora_request=lora), len(prefix))
    table, order, stats = dict(kv.pool.cached), [b.block_id for b in kv.pool.free_queue], vars(kv.prefix_stats).copy()
    for salt, adapter in ((None, None), ("t1", None), ("t2", None), (None, lora), ("t1", lora)):
        for n in (1, 3, 4, 5, 8, 28, 29, 30, 31, 40):
            prompt = prefix[:n] + [rng.randrange(1000) for _ in range(rng.randrange(3))]
            if not prompt:
                continue
            probed, hashes = kv.probe_prefix(prompt, salt, adapter)
            fresh = Request("q", prompt, SamplingParams(), max_model_len=256, cache_salt=salt, lora_request=adapter)
            assert probed == kv.get_computed_blocks(fresh)[1], (salt, adapter, n)
            assert hashes == fresh.block_hashes[:len(hashes)]  # the request's own chain, to the first miss
            assert len(hashes) == min(probed // 4 + 1, (len(prompt) - 1) // 4)
    assert kv.probe_prefix(prefix + [1], "t1")[0] == 28  # the 7 blocks a's step entered
    assert kv.probe_prefix(prefix + [1], None, lora)[0] == 28 and kv.probe_prefix(prefix + [1])[0] == 0
    assert dict(kv.pool.cached) == table and [b.block_id for b in kv.pool.free_queue] == order
    assert vars(kv.prefix_stats) == stats
    assert KVCacheManager(8, 4, enable_caching=False).probe_prefix(prefix) == (0, [])


def test_the_arrival_probe_counts_the_uncached_prompt_and_never_raises():
    """engine_loop.arrival_probe: (prompt - cached) x n for a prompt the engine can read; None for one it cannot
    (ids that are not int64s: the engine refuses those itself), so the front counts it whole until a report."""
    from types import SimpleNamespace

    from kvgate.engine.engine_loop import arrival_probe
    from kvgate.engine.engine_messages import AddRequest, ArrivalProbe

    s = scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=256)
    s.add_request(request("a", range(400, 420)))
    step(s)
    engine = SimpleNamespace(kv_cache_manager=s.kv)
    follower = AddRequest("b", list(range(400, 420)) + [1, 2, 3], SamplingParams(n=2))
    assert arrival_probe(engine, follower, 7) == ArrivalProbe(7, (23 - 20) * 2)
    assert follower.block_hashes == s.requests["a"].block_hashes[:5]  # handed on: add_request does not redo them
    assert arrival_probe(engine, AddRequest("c", [5, 6, 7], SamplingParams()), 8) == ArrivalProbe(8, 3)
    for bad in ([2**70] * 9, ["x"] * 9, [None] * 9):
        command = AddRequest("d", bad, SamplingParams())
        assert arrival_probe(engine, command, 9) is None and command.block_hashes is None
