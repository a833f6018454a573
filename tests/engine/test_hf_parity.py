"""Greedy outputs must be token-identical to HF transformers' own generate(), in every scheduling mode."""

import random

import pytest
import torch

from kvgate.engine import LLM, SamplingParams

MAX_NEW = 24
PROMPT_LENGTHS = [3, 7, 15, 16, 17, 33, 48, 70, 5, 40]

MODES = {
    "prefix-caching": dict(enable_prefix_caching=True),
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_gpu_blocks_override=12, max_num_seqs=16),
}


def make_prompts() -> list[list[int]]:
    rng = random.Random(1234)
    shared = [rng.randrange(256) for _ in range(32)]  # two prompts share a 32-token (2-block) prefix
    prompts = [[rng.randrange(256) for _ in range(n)] for n in PROMPT_LENGTHS]
    prompts[6] = shared + prompts[6][:16]
    prompts[9] = shared + prompts[9][:8]
    return prompts


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir):
    cache = {}

    def get(family):
        if family not in cache:
            _, model = tiny_model_dir(family)
            outs = []
            for prompt in make_prompts():
                with torch.no_grad():
                    gen = model.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW,
                                         do_sample=False, eos_token_id=None, pad_token_id=0)
                outs.append(gen[0, len(prompt):].tolist())
            cache[family] = outs
        return cache[family]

    return get


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_matches_hf(family, mode, tiny_model_dir, hf_reference):
    folder, _ = tiny_model_dir(family)
    expected = hf_reference(family)
    llm = LLM(str(folder), max_model_len=128, **MODES[mode])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params)
    got = [o.outputs[0].token_ids for o in outs]
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"{family}/{mode}: prompt {i} (len {len(make_prompts()[i])}) diverges from HF"
    stats = llm.engine.stats()
    if mode == "preemption":
        assert stats.num_preemptions > 0, "the small KV pool should have forced preemption"
    if mode == "prefix-caching":
        # the second pass over the same prompts is served from the cache and still matches
        again = llm.generate([{"prompt_token_ids": p} for p in make_prompts()], params)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert sum(o.num_cached_tokens for o in again) > 0
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_cache_usage == 0.0
