"""Speculative decoding with a draft model (--speculative-config, method draft_model): greedy outputs identical to
non-speculative greedy (and HF) in every scheduling mode, a draft that is the target itself accepts every draft,
sampling with a different draft keeps the target distribution, and the config's checks."""

import copy
from collections import Counter

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.demo import build_byte_tokenizer, write_tokenizer_files
from kvgate.engine.errors import ConfigError
from kvgate.engine.spec_decode import SpeculativeConfig
from tests.engine import test_spec_decode
from tests.engine.test_spec_decode import MAX_NEW, MODES, check_speculative_greedy, chi_square_p, repetitive_prompts
from tests.engine.tiny_models import build_tiny_model, make_config

K = 3
hf_reference = test_spec_decode.hf_reference  # the ngram tests' fixture: HF's greedy outputs per family


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir, tmp_path_factory):
    """family -> the folder of a smaller draft: the target's first layer alone (its embeddings and LM head), a
    different model whose greedy choices agree with the target's now and then (both acceptances and rejections)."""
    cache = {}

    def get(family):
        if family not in cache:
            _, model = tiny_model_dir(family)
            draft = copy.deepcopy(model)
            draft.model.layers = draft.model.layers[:1]
            draft.config.num_hidden_layers = 1
            if getattr(draft.config, "layer_types", None):
                draft.config.layer_types = draft.config.layer_types[:1]
            folder = tmp_path_factory.mktemp(f"draft-{family}")
            draft.save_pretrained(str(folder), safe_serialization=True)
            write_tokenizer_files(build_byte_tokenizer(), folder, model.config.max_position_embeddings)
            cache[family] = folder
        return cache[family]

    return get


def spec_config(folder, k=K):
    return {"method": "draft_model", "model": str(folder), "num_speculative_tokens": k}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_with_a_draft_model_matches_hf(family, mode, tiny_model_dir, draft_dir, hf_reference):
    folder, _ = tiny_model_dir(family)
    llm = LLM(str(folder), max_model_len=128, speculative_config=spec_config(draft_dir(family)), **MODES[mode])
    check_speculative_greedy(llm, hf_reference(family), family, mode)


@pytest.mark.parametrize("mode", list(MODES))
def test_the_target_as_its_own_draft_accepts_every_draft(mode, tiny_model_dir):
    """The issue's sanity check: draft = target gives exactly 100% acceptance with greedy (the draft's K/V and
    catch-up are the target's own computation), outputs unchanged, also across preemption and chunked prefill."""
    folder, _ = tiny_model_dir("llama")
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts()]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(str(folder), max_model_len=128).generate(prompts, params)]
    llm = LLM(str(folder), max_model_len=128, speculative_config=spec_config(folder, 4), **MODES[mode])
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    spec = llm.engine.stats().spec_decode
    assert spec.num_draft_tokens > 100 and spec.num_accepted_tokens == spec.num_draft_tokens, spec


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_with_a_draft_model_paused_by_backoff_matches_hf(mode, tiny_model_dir, draft_dir, hf_reference):
    """Adaptive drafting with a threshold the one-layer draft often misses (2 accepted drafts a step), so requests
    pause and probe: the draft then catches up over the tokens it skipped (its K/V written late into the request's
    blocks, also after preemption and in chunked prefill) and outputs stay identical to HF's."""
    folder, _ = tiny_model_dir("llama")
    llm = LLM(str(folder), max_model_len=128, speculative_config=spec_config(draft_dir("llama")),
              speculative_backoff_threshold=2.0, **MODES[mode])
    check_speculative_greedy(llm, hf_reference("llama"), "llama", mode)
    spec = llm.engine.stats().spec_decode
    # Pauses, and more drafted steps than each request's first 3: probes after pauses (56 against 30 when written).
    assert spec.num_paused_steps > 0 and spec.num_drafts > 3 * len(repetitive_prompts()), spec


def test_sampling_with_a_draft_model_keeps_the_distribution(tiny_model_dir, draft_dir):
    """10k requests each way (20k draws a position), temperature 0.8 and top-k 40: with a draft model whose q differs
    from the target's p (so acceptance is min(1, p/q) and a rejection draws from max(p - q, 0)), the first to fourth
    tokens' distributions agree with plain sampling (two-sample chi-square), drafts both accepted and rejected."""
    folder, _ = tiny_model_dir("qwen2")
    prompt = repetitive_prompts()[1]
    params = SamplingParams(temperature=0.8, top_k=40, max_tokens=4, ignore_eos=True)
    n = 10_000
    torch.manual_seed(1)
    engine_args = dict(max_model_len=128, max_num_seqs=256, max_num_batched_tokens=2048)
    plain = LLM(str(folder), **engine_args)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": prompt}] * n, params)]
    spec = LLM(str(folder), speculative_config=spec_config(draft_dir("qwen2"), 2), **engine_args)
    got = [o.outputs[0].token_ids for o in spec.generate([{"prompt_token_ids": prompt}] * n, params)]
    stats = spec.engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0.05 * stats.num_draft_tokens, stats
    assert stats.num_accepted_tokens < 0.95 * stats.num_draft_tokens, stats
    for position in range(4):
        pvalue = chi_square_p(Counter(t[position] for t in got), Counter(t[position] for t in want))
        print(f"token {position + 1}: chi-square p = {pvalue:.3f} ({stats})")
        assert pvalue > 1e-3, (position, pvalue)


def test_a_draft_with_a_larger_vocabulary_is_a_config_error(tiny_model_dir, tmp_path):
    folder, _ = tiny_model_dir("llama")
    config = make_config("llama")
    config.vocab_size = 300
    config.num_hidden_layers = 1
    build_tiny_model("llama", tmp_path, config=config)
    with pytest.raises(ConfigError, match="vocab_size 300 exceeds the target's 262"):
        LLM(str(folder), max_model_len=128, speculative_config=spec_config(tmp_path))


@pytest.mark.parametrize("data, error", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs \"model\""),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "ngram keys"),
])
def test_bad_draft_model_config(data, error):
    with pytest.raises(ConfigError, match=error):
        SpeculativeConfig.from_dict(data)


def test_draft_model_config_as_vllm():
    assert SpeculativeConfig.from_dict({"method": "draft_model", "model": "/m", "num_speculative_tokens": 3}) == \
        SpeculativeConfig("draft_model", 3, 0, 0, "/m")
    # vLLM infers the method from a model alone
    assert SpeculativeConfig.from_dict({"model": "/m", "num_speculative_tokens": 3}).method == "draft_model"
