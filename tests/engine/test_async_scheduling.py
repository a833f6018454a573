"""Async scheduling (vLLM's --async-scheduling): the next step is scheduled and queued before the running step's
tokens reach the host. The scheduler keeps output placeholders; the engine's outputs must be the same as with
synchronous steps, whatever ends a request (max_tokens, EOS, stop ids, stop strings, abort, preemption)."""

import random

import pytest

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.request import RequestStatus
from kvgate.engine.sampling_params import StructuredOutputsParams
from kvgate.engine.scheduler import prefill_tokens_pending
from tests.engine.helpers import request, sampled, scheduler


# -- the scheduler's placeholders -----------------------------------------------------------------


def test_a_decode_is_scheduled_on_the_placeholder_of_the_running_step():
    s = scheduler()
    s.add_request(request("a", range(10), max_tokens=3))
    out1 = s.schedule()  # the prompt: samples the first output
    a = s.requests["a"]
    assert (out1.scheduled[0].start, out1.scheduled[0].num_new_tokens, out1.scheduled[0].samples) == (0, 10, True)
    assert a.num_computed_tokens == 10 and a.num_output_placeholders == 1
    out2 = s.schedule()  # before out1's token is known: a decode of position 10, the placeholder
    assert (out2.scheduled[0].start, out2.scheduled[0].num_new_tokens, out2.scheduled[0].samples) == (10, 1, True)
    assert a.num_tokens == 10 and a.num_output_placeholders == 2
    out3 = s.schedule()
    assert a.num_output_placeholders == 3
    assert s.schedule().is_empty  # three outputs are being sampled: max_tokens needs no fourth step
    assert s.num_prefill_tokens_pending == 0
    for out, token in ((out1, 5), (out2, 6), (out3, 7)):
        s.update_from_output(out, sampled(out, token))
    assert a.output_token_ids == [5, 6, 7] and a.status == RequestStatus.FINISHED_LENGTH
    assert not s.requests and s.kv.usage() == 0.0


def test_the_token_of_a_step_queued_after_the_end_is_dropped():
    s = scheduler()
    s.add_request(request("a", range(10), max_tokens=50, stop_token_ids=[6]))
    out1, out2 = s.schedule(), s.schedule()
    s.update_from_output(out1, sampled(out1, 6))  # the stop id: a ends while out2 is queued
    assert s.requests == {} and s.kv.usage() == 0.0
    out3 = s.schedule()
    assert out3.is_empty
    assert s.update_from_output(out2, sampled(out2, 9)) == []
    a = out1.scheduled[0].request
    assert a.output_token_ids == [6] and a.stop_reason == 6


def test_a_preempted_request_keeps_the_token_of_its_queued_step():
    s = scheduler(num_blocks=4, block_size=4, caching=False)
    s.add_request(request("a", range(8), max_tokens=50))
    s.add_request(request("b", range(100, 108), max_tokens=50))
    out1 = s.schedule()  # both prompts: 4 blocks, the whole pool
    out2 = s.schedule()  # a's decode needs a fifth block: b, the newest, is preempted
    b = s.requests["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_output_placeholders == 0
    assert [x.request.request_id for x in out2.scheduled] == ["a"]
    s.update_from_output(out1, sampled(out1, 3))
    # Sampled from b's whole prompt before its blocks were freed: kept, and recomputed with the prompt.
    assert b.output_token_ids == [3] and s.requests["a"].output_token_ids == [3]
    assert s.num_prefill_tokens_pending == prefill_tokens_pending(b) == 8
    out3 = s.schedule()  # a decodes; b waits (a holds the pool)
    s.update_from_output(out2, sampled(out2, 4))
    s.finish_request("a", RequestStatus.FINISHED_ABORTED)
    s.update_from_output(out3, sampled(out3, 5))  # a ended: dropped
    out4 = s.schedule()  # b again: prompt and its token, to sample its second
    assert [(x.request.request_id, x.start, x.num_new_tokens, x.samples) for x in out4.scheduled] == [("b", 0, 9, True)]


def test_the_backlog_counter_equals_a_recount_with_a_step_queued():
    rng = random.Random(5)
    for policy in ("fcfs", "priority"):
        s = scheduler(num_blocks=24, block_size=4, max_num_seqs=4, max_num_batched_tokens=24, policy=policy)
        prefixes = [list(range(p * 100, p * 100 + 12)) for p in range(3)]
        queued = None
        finished = []
        for i in range(400):
            if rng.random() < 0.3:
                tail = [rng.randrange(1000, 2000) for _ in range(rng.randrange(1, 20))]
                r = request(f"r{i}", rng.choice(prefixes) + tail, max_tokens=rng.randrange(1, 12),
                            stop_token_ids=[13])
                r.priority = rng.randrange(3)
                s.add_request(r)
            if s.requests and rng.random() < 0.05:
                s.finish_request(rng.choice(list(s.requests)), RequestStatus.FINISHED_ABORTED)
            out = s.schedule()
            if queued is not None:
                finished += [r for r in s.update_from_output(queued, sampled(queued, rng.randrange(5, 50)))
                             if r.is_finished]
            queued = out
            assert s.num_prefill_tokens_pending == sum(prefill_tokens_pending(r) for r in s.requests.values())
        assert s.num_preemptions > 0 and finished
        for r in finished:  # never a token past the end, and the end decided by what was sampled
            assert len(r.output_token_ids) <= r.sampling_params.max_tokens
            assert r.output_token_ids[-1] == 13 or len(r.output_token_ids) == r.sampling_params.max_tokens
            assert 13 not in r.output_token_ids[:-1]


# -- the engine: the same outputs as synchronous steps --------------------------------------------


def workload(n=20, seed=3):
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(3, 70))] for _ in range(n)]
    params = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            p = SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 30), ignore_eos=True)
        elif kind == 1:
            p = SamplingParams(temperature=0.0, max_tokens=40)  # EOS may end it
        elif kind == 2:
            p = SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=25, logprobs=2)
        elif kind == 3:
            p = SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[101, 102, 103], min_tokens=3)
        elif kind == 4:
            p = SamplingParams(temperature=1.0, seed=100 + i, n=2, max_tokens=12)
        else:
            p = SamplingParams(temperature=0.0, max_tokens=30, stop=["e", "a "])
        params.append(p)
    return prompts, params


def run(prompts, params, **engine_args):
    llm = LLM("demo", max_model_len=128, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0
    return [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs] for o in outs], stats


def assert_same_outputs(got, expected):
    """Tokens, text and ends identical; logprobs for the same tokens, equal up to float rounding (the steps batch
    requests differently, and a matmul's rounding depends on its batch)."""
    assert [[c[:4] for c in o] for o in got] == [[c[:4] for c in o] for o in expected]
    for o, e in zip(got, expected):
        for c, ce in zip(o, e):
            assert (c[4] is None) == (ce[4] is None)
            for step, step_e in zip(c[4] or [], ce[4] or []):
                assert step.keys() == step_e.keys()
                for t in step:
                    assert step[t].logprob == pytest.approx(step_e[t].logprob, abs=1e-4)
                    assert step[t].rank == step_e[t].rank


@pytest.mark.parametrize("engine_args", [
    dict(max_num_seqs=8, max_num_batched_tokens=48),  # chunked prefill beside decodes
    dict(max_num_seqs=16, max_num_batched_tokens=64, num_gpu_blocks_override=10),  # preemption
], ids=["chunked-prefill", "preemption"])
@pytest.mark.slow
def test_outputs_equal_synchronous_steps(engine_args):
    prompts, params = workload()
    sync, _ = run(prompts, params, async_scheduling=False, **engine_args)
    queued, stats = run(prompts, params, async_scheduling=True, **engine_args)
    assert_same_outputs(queued, sync)
    if "num_gpu_blocks_override" in engine_args:
        assert stats.num_preemptions > 0
    reasons = {c[2] for o in sync for c in o}
    assert reasons == {"length", "stop"}  # both kinds of end were exercised


@pytest.mark.slow
def test_abort_while_a_step_is_queued():
    rng = random.Random(8)
    prompts = [[rng.randrange(256) for _ in range(20)] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    expected, _ = run(prompts[1:], params, async_scheduling=False)
    llm = LLM("demo", max_model_len=256, async_scheduling=True)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    outputs = {}
    for _ in range(4):
        for o in engine.step():
            outputs[o.request_id] = o
    assert engine._queued is not None  # a step is on the "device" while r0 is aborted
    assert engine.abort_request("r0")
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            assert o.request_id != "r0"
            outputs[o.request_id] = o
    assert not engine.has_unfinished_requests() and engine.stats().kv_cache_usage == 0.0
    got = [[(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in outputs[f"r{i}"].outputs]
           for i in range(1, 4)]
    assert_same_outputs(got, expected)


@pytest.mark.slow
def test_a_constrained_request_makes_steps_synchronous():
    llm = LLM("demo", max_model_len=256, async_scheduling=True)
    engine = llm.engine
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request("plain", list(range(40, 60)), plain)
    engine.step()
    engine.step()
    assert engine._queued is not None
    engine.add_request("json", list(range(60, 70)), SamplingParams(
        temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}")))
    saw_constrained = False
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            if o.request_id == "json" and o.finished:
                assert len(o.outputs[0].text) == 3 and o.outputs[0].text.isdigit()
        if engine.scheduler.num_host_bound:
            saw_constrained = True
            assert engine._queued is None  # its mask needs the token before: nothing stays queued
    assert saw_constrained and not engine.has_unfinished_requests()
