"""Prompt logprobs (SamplingParams.prompt_logprobs, what completions' `echo` with `logprobs` returns) equal HF
transformers' own log-softmax of every prompt position, fp32, token by token — chunked prefills under synchronous
and async scheduling with preemption, a whole prefill past a warm prefix cache (which such a request skips) with
its logits computed in small pieces, and chunked prefills on two tensor-parallel ranks."""

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine import prompt_logprobs
from tests.engine.tiny_models import random_tokens

TOLERANCE = 1e-4
TOP = 3
MAX_NEW = 40  # enough to fill the preemption mode's small KV pool
PROMPTS = [random_tokens(n, seed) for n, seed in ((2, 1), (9, 2), (33, 3), (70, 4))]

# Both modes chunk the prefill (16 tokens a step) and preempt (a 12-block pool): synchronous and async scheduling
# (the next step scheduled before this one's tokens are taken, the default on CUDA). A whole-prompt prefill runs in
# the prefix-cache test below.
MODES = {
    "chunked-preempted": dict(max_num_batched_tokens=16, num_gpu_blocks_override=12, max_num_seqs=8),
    "async-chunked-preempted": dict(async_scheduling=True, max_num_batched_tokens=16, num_gpu_blocks_override=12,
                                    max_num_seqs=8),
}


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row p is the log-softmax at position p, which scores prompt token p + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long)).logits
    return logits[0, :-1].float().log_softmax(dim=-1)


def check_against_hf(hf_model, prompt: list[int], got: list) -> None:
    """Every entry: the prompt token's logprob and rank, and the top-TOP tokens with theirs, as HF computes them."""
    assert len(got) == len(prompt) and got[0] is None
    want = hf_prompt_logprobs(hf_model, prompt)
    for p, entry in enumerate(got[1:]):
        token, row = prompt[p + 1], want[p]
        assert abs(entry[token].logprob - row[token].item()) < TOLERANCE, (p, entry[token], row[token])
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top_vals, top_ids = row.topk(TOP)
        for rank, (tid, value) in enumerate(zip(top_ids.tolist(), top_vals.tolist()), start=1):
            assert abs(entry[tid].logprob - value) < TOLERANCE, (p, tid)
        assert set(entry) <= {token, *top_ids.tolist()}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_prompt_logprobs_match_hf(model, mode):
    folder, hf_model = model
    llm = LLM(str(folder), max_model_len=128, **MODES[mode])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, prompt_logprobs=TOP, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs):
        check_against_hf(hf_model, prompt, out.prompt_logprobs)
        assert len(out.outputs[0].logprobs) == MAX_NEW  # the generated tokens' logprobs are there too
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, "the small KV pool should have forced preemption"
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


def test_warm_prefix_cache_is_skipped_and_pieces_are_exact(model, monkeypatch):
    """A request asking for prompt logprobs computes its whole prompt even when the cache holds it (a cached block
    has no logits); one that does not ask still hits. Logits computed two rows at a time give the same numbers."""
    folder, hf_model = model
    llm = LLM(str(folder), max_model_len=128, enable_prefix_caching=True)
    prompt = PROMPTS[3]
    plain = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([{"prompt_token_ids": prompt}], plain)
    assert llm.generate([{"prompt_token_ids": prompt}], plain)[0].num_cached_tokens > 0
    monkeypatch.setattr(prompt_logprobs, "PIECE_ELEMENTS", 2 * llm.engine.vocab_size)
    asked = llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=TOP))[0]
    assert asked.num_cached_tokens == 0
    check_against_hf(hf_model, prompt, asked.prompt_logprobs)


def test_prompt_logprobs_bounds():
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
    for bad in (21, -1, "2"):
        with pytest.raises(Exception) as info:
            SamplingParams(prompt_logprobs=bad)
        assert getattr(info.value, "param", None) == "prompt_logprobs"
    assert prompt_logprobs.piece_rows(152_064) * 152_064 <= prompt_logprobs.PIECE_ELEMENTS
    assert prompt_logprobs.piece_rows(2**30) == 1


@pytest.mark.processes
@pytest.mark.slow
def test_prompt_logprobs_with_tensor_parallel_workers(model):
    """Rank 0 sends the rows it scores with the step; each worker runs the same LM-head pieces (a gather across
    ranks), so the numbers are HF's on two ranks too."""
    folder, hf_model = model
    llm = LLM(str(folder), max_model_len=128, tensor_parallel_size=2, max_num_batched_tokens=16)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=TOP)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        for prompt, out in zip(PROMPTS, outs):
            check_against_hf(hf_model, prompt, out.prompt_logprobs)
    finally:
        llm.engine.close()
