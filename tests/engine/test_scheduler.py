"""Scheduler behaviour on its own: token budget, chunked prefill, max_num_seqs, preemption order, priority."""

from kvgate.engine.request import RequestStatus
from kvgate.engine.sampling_params import SamplingParams
from tests.engine.helpers import request, scheduler, step


def test_budget_and_chunked_prefill():
    s = scheduler(max_num_batched_tokens=32)
    s.add_request(request("a", 50))
    s.add_request(request("bb", 10))
    out = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 32)]
    assert not out.scheduled[0].samples  # a partial prefill chunk samples nothing
    out = step(s)
    # a finishes its prompt (18) and bb's whole prompt (10) joins in the same step
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 18), ("bb", 10)]
    out = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 1), ("bb", 1)]


def test_long_prefill_token_threshold_lets_short_prompts_in_between_a_long_ones_chunks():
    """vLLM's --long-prefill-token-threshold: a long prompt computes at most the threshold a step, running or
    waiting, and the budget it leaves takes the short prompts queued behind it whole (their first token a step
    later, not after the whole long prefill)."""
    s = scheduler(num_blocks=128, max_num_batched_tokens=64, long_prefill_token_threshold=16)
    s.add_request(request("a", 60))
    s.add_request(request("bb", 12))
    out = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 16), ("bb", 12)]
    assert [x.samples for x in out.scheduled] == [False, True]  # bb's first token in the long prompt's first step
    s.add_request(request("ccc", 9))
    out = step(s)
    assert [(x.request.request_id, x.num_new_tokens) for x in out.scheduled] == [("a", 16), ("bb", 1), ("ccc", 9)]
    assert [x.samples for x in out.scheduled] == [False, True, True]
    chunks = [dict((x.request.request_id, x.num_new_tokens) for x in step(s).scheduled)["a"] for _ in range(2)]
    assert chunks == [16, 12] and s.requests["a"].num_computed_tokens == 60  # the last chunk is what is left
    # decodes are never capped, and a cap above the prompt changes nothing
    assert [x.num_new_tokens for x in step(s).scheduled] == [1, 1, 1]
    wide = scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=100)
    wide.add_request(request("a", 60))
    assert [x.num_new_tokens for x in step(wide).scheduled] == [60]


def test_without_chunked_prefill_a_long_prompt_waits_for_a_whole_budget():
    s = scheduler(max_num_batched_tokens=32, enable_chunked_prefill=False)
    s.add_request(request("a", 20))
    s.add_request(request("bb", 20))
    out = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["a"]


def test_max_num_seqs():
    s = scheduler(max_num_seqs=2, max_num_batched_tokens=100)
    for rid in ("a", "bb", "ccc"):
        s.add_request(request(rid, 5))
    out = step(s)
    assert len(out.scheduled) == 2 and s.num_waiting == 1


def test_preemption_recomputes_the_newest_request():
    s = scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    s.add_request(request("a", 8))
    s.add_request(request("bb", 8))
    step(s)  # both prompts: 2 + 2 blocks, plus room for 1 token each -> 3 + 3 blocks
    # decodes eventually need a 4th block each: the newest (bb) is preempted, a keeps running
    preempted = []
    for _ in range(8):
        preempted += [r.request_id for r in step(s).preempted]
        if preempted:
            break
    assert preempted == ["bb"]
    bb = s.requests["bb"]
    assert bb.status == RequestStatus.PREEMPTED and bb.num_computed_tokens == 0 and bb.num_preemptions == 1
    assert s.requests["a"].status == RequestStatus.RUNNING


def test_priority_policy_admits_and_preempts_by_priority():
    s = scheduler(num_blocks=64, max_num_seqs=1, policy="priority")
    s.add_request(request("low", 4, priority=5))
    s.add_request(request("high", 4, priority=-1))
    out = step(s)
    assert [x.request.request_id for x in out.scheduled] == ["high"]

    s = scheduler(num_blocks=5, block_size=4, max_num_batched_tokens=64, policy="priority")
    s.add_request(request("high", 8, priority=0))
    s.add_request(request("low", 8, priority=9))
    preempted = []
    for _ in range(8):
        preempted += [r.request_id for r in step(s).preempted]
        if preempted:
            break
    assert preempted[0] == "low"


def test_finish_and_abort_free_blocks():
    s = scheduler()
    s.add_request(request("a", 10))
    s.add_request(request("bb", 10))
    step(s)
    assert s.kv.usage() > 0
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    s.finish_request("bb", RequestStatus.FINISHED_ABORTED)
    assert s.kv.usage() == 0 and not s.has_unfinished_requests()


def test_the_engine_takes_the_threshold_from_its_config():
    """Through LLMEngine (sim backend: the real scheduler and KV cache): a 300-token prompt under a 64-token cap
    takes five steps to its first token, and a 20-token prompt sent after its first step gets its own in the next."""
    from kvgate.engine.config import EngineConfig
    from kvgate.engine.llm_engine import LLMEngine
    from kvgate.engine.sim_runner import SimProfile

    profile = SimProfile(step_overhead_ms=0.0, prefill_ms_per_token=0.0, decode_ms_per_seq=0.0,
                         ms_per_context_token=0.0, max_model_len=1024)
    e = LLMEngine(EngineConfig(model="sim", backend="sim", sim_profile=profile, long_prefill_token_threshold=64))
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    e.add_request("long", [40 + i % 200 for i in range(300)], params)
    first: dict[str, int] = {}
    for n in range(1, 8):
        if n == 2:
            e.add_request("short", list(range(1, 21)), params)
        for out in e.step():
            if out.outputs[0].token_ids:
                first.setdefault(out.request_id, n)
    assert first == {"long": 5, "short": 2}
