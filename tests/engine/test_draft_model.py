"""Speculative decoding with a draft model (--speculative-config, method draft_model): greedy outputs identical to
non-speculative greedy (and HF) in every scheduling mode, a draft that is the target itself accepts every draft,
sampling with a different draft keeps the target distribution, prefix reuse of the draft's K/V (shared prefixes
drafted once, nothing stale reused after eviction or preemption), and the config's checks."""

import copy
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.block_pool import hash_block_tokens, root_block_hash
from kvgate.common.demo import build_byte_tokenizer, write_tokenizer_files
from kvgate.engine.draft_model import DraftState
from kvgate.common.errors import ConfigError
from kvgate.engine.spec_decode import SpeculativeConfig
from tests.engine import test_spec_decode
from tests.engine.test_spec_decode import MAX_NEW, MODES, check_speculative_greedy, chi_square_p, repetitive_prompts
from tests.engine.tiny_models import build_tiny_model, hf_greedy, make_config

pytestmark = pytest.mark.slow

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
    if mode == "prefix-caching":  # the second round's drafts start after the prefixes the first round's computed
        assert llm.engine.runner.draft.stats.reused_tokens > 0, llm.engine.runner.draft.stats


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


# -- prefix reuse: the draft's K/V of a shared prefix computed once ----------------------------------------------


def shared_prefix_prompts(n: int, seed: int = 11, prefix_len: int = 70) -> list[list[int]]:
    """n prompts of one shared prefix (4 full blocks of 16 and 6 tokens) and tails of their own (1-13 tokens); no
    token 0 (HF generate would take it for padding)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 256) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 14))] for _ in range(n)]


def greedy(max_tokens=MAX_NEW, logprobs=None):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def check_draft_blocks(engine) -> int:
    """With the target as its own draft: every block whose draft K/V the proposer records as some content's (a block
    hash) holds the K/V the target holds for that content, in each layer, wherever the pool still has a block of
    that hash (the target's K/V is computed once hashed, with synchronous scheduling). A stale record (the draft
    wrote the block for other content since) fails here whether or not a request reuses it. Returns the blocks
    compared."""
    draft, target, pool = engine.runner.draft, engine.runner, engine.kv_cache_manager.pool
    bs, compared = draft.block_size, 0
    for block_id, block_hash in enumerate(draft.block_hashes):
        cached = pool.get_cached_block(block_hash) if block_hash is not None else None
        if cached is None:
            continue
        mine = slice(block_id * bs, (block_id + 1) * bs)
        theirs = slice(cached.block_id * bs, (cached.block_id + 1) * bs)
        for draft_cache, target_cache in zip(draft.kv_caches, target.kv_caches):
            torch.testing.assert_close(draft_cache[:, :, mine], target_cache[:, :, theirs], atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"block {block_id}: stale draft K/V ({m})")
        compared += 1
    return compared


@pytest.mark.parametrize("reuse", [True, False])
def test_a_shared_prefix_is_drafted_once(reuse, tiny_model_dir, draft_dir):
    """Requests sharing a 70-token prefix, one after another then together (the one-layer draft): greedy outputs
    equal plain greedy and HF's with prefix reuse on and off, and with it on, a request's first drafting computes
    only its tail past the 4 shared full blocks (64 tokens), from the second request on; off, all of it. Then all
    of them at once on a new engine: they first draft in the same step, where one computes the prefix and the
    others start after it."""
    folder, model = tiny_model_dir("llama")
    prompts = shared_prefix_prompts(6)
    want = hf_greedy(model, prompts, MAX_NEW)
    plain = LLM(str(folder), max_model_len=128)
    assert [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], greedy())] \
        == want
    llm = LLM(str(folder), max_model_len=128, speculative_config=spec_config(draft_dir("llama")))
    engine, draft = llm.engine, llm.engine.runner.draft
    draft.reuse_prefix = reuse
    got = {}
    for i, prompt in enumerate(prompts[:3]):  # one at a time: each starts drafting after the one before ended
        before = copy.copy(draft.stats)
        engine.add_request(str(i), prompt, greedy())
        first = None
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    got[o.request_id] = o.outputs[0].token_ids
            request = engine.scheduler.requests.get(str(i))
            if first is None and request is not None and request.spec_state is not None:
                first = draft.stats.since(before)  # its first drafting step: prompt + first token caught up on
        skipped = 64 if reuse and i > 0 else 0
        assert (first.reused_tokens, first.catch_up_tokens) == (skipped, len(prompt) + 1 - skipped), (i, first)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[3:]], greedy())  # together, the prefix cached
    assert [got[str(i)] for i in range(3)] + [o.outputs[0].token_ids for o in outs] == want
    spec = engine.stats().spec_decode
    assert 0 < spec.num_accepted_tokens < spec.num_draft_tokens, spec  # drafts both accepted and rejected
    assert draft.stats.reused_tokens == (5 * 64 if reuse else 0), draft.stats
    stats = engine.stats()  # the metrics' snapshot (kvgate:spec_decode_draft_*): a copy, not the live counters
    assert stats.draft_model == draft.stats and stats.draft_model is not draft.stats
    assert plain.engine.stats().draft_model is None

    llm = LLM(str(folder), max_model_len=128, speculative_config=spec_config(draft_dir("llama")))
    engine, draft = llm.engine, llm.engine.runner.draft
    draft.reuse_prefix = reuse
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy())
    got, first = {}, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
        if first is None and engine.stats().spec_decode.num_drafts:
            first = copy.copy(draft.stats)  # the step in which all six first drafted
            assert engine.stats().spec_decode.num_drafts == len(prompts)
    assert [got[str(i)] for i in range(len(prompts))] == want
    skipped = 5 * 64 if reuse else 0
    assert (first.reused_tokens, first.catch_up_tokens) == (skipped, sum(len(p) + 1 for p in prompts) - skipped)


def test_no_stale_draft_kv_after_eviction(tiny_model_dir):
    """A KV cache of 12 blocks of 16 (with the target as its own draft): rounds of two requests of a shared prefix
    and two of other text (one of them not speculated: logprobs), so the shared prefix's blocks are evicted and
    handed to other text (written by the target alone, or by the draft too), requests are preempted, and the prefix is
    computed again. After every step no block's record is stale (check_draft_blocks), every draft is accepted (the
    draft's K/V is the target's), outputs equal plain greedy, and reuse happened where it was valid."""
    folder, _ = tiny_model_dir("llama")
    rng = random.Random(7)
    prefix = [rng.randrange(1, 256) for _ in range(64)]
    rounds = []
    for _ in range(5):
        batch = [(prefix + [rng.randrange(1, 256) for _ in range(rng.randrange(1, 14))], None) for _ in range(2)]
        batch += [([rng.randrange(1, 256) for _ in range(rng.randrange(40, 90))], logprobs)
                  for logprobs in (None, 1)]
        rounds.append(batch)
    plain = LLM(str(folder), max_model_len=128)
    want = [[o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p, _ in batch],
                                                             [greedy(16, lp) for _, lp in batch])] for batch in rounds]
    llm = LLM(str(folder), max_model_len=128, num_gpu_blocks_override=12, max_num_seqs=16,
              speculative_config=spec_config(folder))
    engine = llm.engine
    first_block = hash_block_tokens(root_block_hash((None,)), prefix[:16])
    evicted = compared = 0
    for k, batch in enumerate(rounds):
        evicted += engine.kv_cache_manager.pool.get_cached_block(first_block) is None
        for i, (prompt, logprobs) in enumerate(batch):
            engine.add_request(f"{k}-{i}", prompt, greedy(16, logprobs))
        got = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    got[o.request_id] = o.outputs[0].token_ids
            compared += check_draft_blocks(engine)
        assert [got[f"{k}-{i}"] for i in range(len(batch))] == want[k], k
    stats = engine.stats()
    spec, draft = stats.spec_decode, engine.runner.draft.stats
    assert spec.num_draft_tokens > 100 and spec.num_accepted_tokens == spec.num_draft_tokens, spec
    assert evicted >= 2 and stats.num_preemptions > 0 and compared > 100, (evicted, stats.num_preemptions, compared)
    assert draft.reused_tokens > 0, draft


def test_a_preempted_request_reuses_its_own_blocks(tiny_model_dir):
    """Preemption (12 blocks for requests of a shared 70-token prefix, the target as its own draft): a request that
    comes back finds its blocks in the prefix cache, and its new draft state starts after those whose K/V the draft
    computed before; every draft is accepted, outputs equal plain greedy."""
    folder, _ = tiny_model_dir("llama")
    prompts = shared_prefix_prompts(6, seed=3)
    plain = LLM(str(folder), max_model_len=128)
    want = [o.outputs[0].token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], greedy())]
    llm = LLM(str(folder), max_model_len=128, speculative_config=spec_config(folder), **MODES["preemption"])
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, greedy())
    got, resumed, compared = {}, {}, 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                got[o.request_id] = o.outputs[0].token_ids
        for r in engine.scheduler.running:
            if r.num_preemptions and r.spec_state is not None and r.spec_state.preemptions == r.num_preemptions:
                resumed.setdefault((r.request_id, r.num_preemptions), r.spec_state.reused)
        compared += check_draft_blocks(engine)
    assert [got[str(i)] for i in range(len(prompts))] == want
    spec = engine.stats().spec_decode
    assert spec.num_draft_tokens > 50 and spec.num_accepted_tokens == spec.num_draft_tokens, spec
    assert engine.stats().num_preemptions > 0 and resumed, resumed
    assert any(reused > 0 for reused in resumed.values()) and compared > 0, (resumed, compared)


def test_reuse_leaves_the_last_token_and_stops_at_other_content(tiny_model_dir):
    """The run of reused blocks alone (DraftModelProposer._reuse over a request's hashes and block ids): never the
    block of the last token (its row gives the first draft), up to the first block recorded for other content or
    not at all, and through a block of this step's first catch-up (then the request catches up after it)."""
    folder, _ = tiny_model_dir("llama")
    draft = LLM(str(folder), max_model_len=128, speculative_config=spec_config(folder)).engine.runner.draft
    hashes, table = [bytes([n]) * 16 for n in range(3)], [5, 7, 9]
    for block, block_hash in zip(table, hashes):
        draft.block_hashes[block] = block_hash

    def reuse(num_tokens, pending=None):
        request = SimpleNamespace(block_hashes=hashes[:num_tokens // 16], num_tokens=num_tokens,
                                  spec_state=DraftState(0))
        waits = draft._reuse(request, table, pending or {})
        return request.spec_state.computed, waits

    assert reuse(48) == (32, False)  # the three blocks are the draft's, but the last token is in the third
    assert reuse(49) == (48, False)
    assert reuse(20) == (16, False)
    draft.block_hashes[7] = hashes[2]  # the draft wrote block 7 for other content since
    assert reuse(49) == (16, False)
    assert reuse(49, {7: hashes[1]}) == (48, True)
    assert reuse(49, {7: hashes[2]}) == (16, False)
    draft.block_hashes[5] = None
    assert reuse(49) == (0, False)
