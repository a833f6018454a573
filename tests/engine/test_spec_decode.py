"""Speculative decoding by prompt lookup (--speculative-config, method ngram): greedy outputs identical to
non-speculative greedy (and HF) in every scheduling mode, rejection sampling that keeps the target distribution,
rejected tokens never in the prefix cache, and the flag's validation."""

import logging
import random
from collections import Counter

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.attention import AttentionMetadata, paged_attention
from kvgate.engine.block_pool import hash_block_tokens, root_block_hash
from kvgate.common.errors import ConfigError
from kvgate.engine.kv_cache_manager import cdiv
from kvgate.engine.spec_decode import (DraftBackoff, NgramProposer, Proposer, SpecDecodeStats, SpeculativeConfig,
                                       verify_greedy, verify_sampled)
from tests.engine.paged_reference import random_paged_batch, reference_attention
from tests.engine.tiny_models import hf_greedy_by_family

MAX_NEW = 24
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MODES = {
    "prefix-caching": dict(enable_prefix_caching=True),
    "chunked-prefill": dict(max_num_batched_tokens=16),
    "preemption": dict(num_gpu_blocks_override=12, max_num_seqs=16),
}


def repetitive_prompts() -> list[list[int]]:
    """Prompts that quote themselves (so drafts are proposed), of mixed lengths, two sharing a 2-block prefix."""
    rng = random.Random(4321)
    prompts = []
    for n in (5, 9, 12, 17, 20, 6, 11, 3):
        text = [rng.randrange(256) for _ in range(n)]
        prompts.append((text * 4)[:3 * n + 2])
    shared = prompts[4][:32]
    prompts.append(shared + [7, 8, 9, 7, 8])
    prompts.append(shared + [1, 2, 3])
    return prompts


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir):
    return hf_greedy_by_family(tiny_model_dir, repetitive_prompts(), MAX_NEW)


def check_speculative_greedy(llm: LLM, expected: list[list[int]], label: str, mode: str) -> None:
    """The repetitive prompts through a speculating engine, one request asking for logprobs (not speculated, in the
    same batches): every output equals `expected`, drafts were both accepted and rejected (so the check is not
    vacuous), the mode did what it names, and nothing is left running or holding blocks."""
    prompts = repetitive_prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=1 if i == 3 else None)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for i, (o, e) in enumerate(zip(outs, expected)):
        assert o.outputs[0].token_ids == e, f"{label}/{mode}: prompt {i} diverges from HF"
    spec = llm.engine.stats().spec_decode
    assert spec.num_accepted_tokens > 0, spec
    assert spec.num_draft_tokens > spec.num_accepted_tokens, spec  # some rejected, rolled back
    assert sum(spec.accepted_per_pos) == spec.num_accepted_tokens
    stats = llm.engine.stats()
    if mode == "preemption":
        assert stats.num_preemptions > 0
    if mode == "prefix-caching":
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert sum(o.num_cached_tokens for o in again) > 0
    assert stats.num_running == stats.num_waiting == 0 and stats.kv_cache_usage == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_with_ngram_speculation_matches_hf(family, mode, tiny_model_dir, hf_reference):
    folder, _ = tiny_model_dir(family)
    llm = LLM(str(folder), max_model_len=128, speculative_config=SPEC, **MODES[mode])
    check_speculative_greedy(llm, hf_reference(family), family, mode)


@pytest.mark.slow
def test_stops_inside_an_accepted_run_match_plain_decoding(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    plain = LLM(str(folder), max_model_len=128)
    spec = LLM(str(folder), max_model_len=128, speculative_config=SPEC)
    prompts = [{"prompt_token_ids": p} for p in repetitive_prompts()]
    free = [o.outputs[0].token_ids for o in plain.generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))]
    # A stop token that each output meets mid-way, and max_tokens cutting runs short.
    stop_ids = [out[len(out) // 2] for out in free[:4]]
    for params in (SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop_token_ids=stop_ids, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=MAX_NEW, stop=["\x10"], ignore_eos=True)):
        want = plain.generate(prompts, params)
        got = spec.generate(prompts, params)
        for w, g in zip(want, got):
            assert (g.outputs[0].token_ids, g.outputs[0].finish_reason, g.outputs[0].stop_reason, g.outputs[0].text) \
                == (w.outputs[0].token_ids, w.outputs[0].finish_reason, w.outputs[0].stop_reason, w.outputs[0].text)
    assert spec.engine.stats().spec_decode.num_accepted_tokens > 0


@pytest.mark.slow
def test_rejected_tokens_never_enter_the_prefix_cache(tiny_model_dir):
    """Every cached block hash is one of a real token sequence's (prompt + output) blocks, and the blocks of rejected
    drafts are freed at once: a request never holds a block past its tokens. With block size 4 and K = 8, rejected
    runs cross block boundaries, so hashing a draft or keeping its block would fail here."""
    folder, _ = tiny_model_dir("qwen3")
    llm = LLM(str(folder), max_model_len=128, block_size=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 1,
                                  "prompt_lookup_max": 2})
    engine, kv = llm.engine, llm.engine.kv_cache_manager
    prompts = repetitive_prompts()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] = o.outputs[0].token_ids
        for r in engine.scheduler.running:  # the next token's slot is allocated by the next step
            assert len(kv.req_blocks.get(r.request_id, ())) <= cdiv(r.num_tokens, 4), r.request_id
    spec = engine.stats().spec_decode
    assert spec.num_draft_tokens - spec.num_accepted_tokens >= 20, spec
    valid = set()
    for i, p in enumerate(prompts):
        tokens, parent = p + outputs[str(i)], root_block_hash((None,))
        for b in range(len(tokens) // 4):
            parent = hash_block_tokens(parent, tokens[4 * b:4 * b + 4])
            valid.add(parent)
    cached = set(kv.pool.cached)
    assert cached and cached <= valid
    # The cached K/V are the accepted tokens' own: continuing from a cached prompt + output gives plain greedy.
    plain = LLM(str(folder), max_model_len=128, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    follow = [{"prompt_token_ids": p + outputs[str(i)][:-1]} for i, p in enumerate(prompts)]
    got = llm.generate(follow, params)
    assert sum(o.num_cached_tokens for o in got) > 0
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain.generate(follow, params)]


# -- adaptive drafting ---------------------------------------------------------------------------------------------


def drive_backoff(backoff: DraftBackoff, request, accepted, steps: int) -> list[int]:
    """`steps` decode steps of one request whose every drafted step accepts accepted(i) drafts (i: its drafted
    steps so far); returns the steps in which it drafted."""
    drafted = []
    for step in range(steps):
        if backoff.allows(request):
            backoff.record(request, accepted(len(drafted)))
            drafted.append(step)
    return drafted


def test_backoff_pauses_rejected_drafting_with_doubling_gaps_and_resumes_on_success():
    class Req:
        draft_backoff = None

    stats = SpecDecodeStats(accepted_per_pos=[0] * 4)
    backoff, req = DraftBackoff(0.25, stats), Req()
    # Every draft rejected: 3 drafted steps bring the estimate (prior 1.0, halved by each) below 0.25, then probes
    # after pauses of 1, 2, 4, ... steps, capped at 32.
    drafted = drive_backoff(backoff, req, lambda i: 0, 106)
    pauses = [b - a - 1 for a, b in zip(drafted, drafted[1:])]
    assert pauses == [0, 0, 1, 2, 4, 8, 16, 32, 32], drafted
    assert stats.num_paused_steps == 106 - len(drafted)
    # A probe that accepts a draft lifts the estimate back over the threshold: drafting resumes every step while
    # drafts are accepted, and the next pause starts again from 1 step.
    while backoff.allows(req) is False:
        pass
    backoff.record(req, 1)
    assert drive_backoff(backoff, req, lambda i: 1, 10) == list(range(10))
    drafted = drive_backoff(backoff, req, lambda i: 0, 16)
    pauses = [b - a - 1 for a, b in zip(drafted, drafted[1:])]
    assert drafted[:2] == [0, 1] and [p for p in pauses if p] == [1, 2, 4], drafted
    # Partial acceptance above the threshold never pauses.
    req2 = Req()
    assert drive_backoff(backoff, req2, lambda i: i % 2, 50) == list(range(50))


@pytest.mark.slow
def test_backoff_keeps_greedy_outputs_where_drafts_fail():
    """The demo model (random weights: it does not continue the text it quotes) with n-grams from 1, so drafts are
    proposed in most steps and nearly all rejected: with adaptive drafting on, the outputs equal plain greedy's
    and speculation's without it, drafting pauses (far fewer draft tokens), and the counters add up."""
    from kvgate.bench.engine import make_quote_workload

    prompts = [{"prompt_token_ids": p} for p in make_quote_workload(8, 96, 160, 256, 0)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    want = [o.outputs[0].token_ids for o in LLM("demo", max_model_len=256).generate(prompts, params)]
    stats = {}
    for threshold in (0.0, 0.25):
        llm = LLM("demo", max_model_len=256, speculative_config=spec, speculative_backoff_threshold=threshold)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want, threshold
        stats[threshold] = s = llm.engine.stats().spec_decode
        assert sum(s.accepted_per_pos) == s.num_accepted_tokens <= s.num_draft_tokens <= 4 * s.num_drafts, s
        assert s.num_accepted_tokens < 0.05 * s.num_draft_tokens, s  # the drafts do fail
    off, on = stats[0.0], stats[0.25]
    assert off.num_paused_steps == 0 and on.num_paused_steps > 0.5 * 8 * 64, on
    assert 0 < on.num_drafts < 0.5 * off.num_drafts, (on, off)  # 74 against 258 when written


@pytest.mark.slow
def test_bench_engine_compares_with_and_without_backoff(tmp_path, capsys):
    import json

    from kvgate.cli import main

    out = tmp_path / "bench.json"
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}'
    assert main(["bench", "engine", "--model", "demo", "--baselines", "none", "--num-requests", "2", "--output-len",
                 "24", "--min-prompt-len", "64", "--max-prompt-len", "96", "--speculative-config", spec,
                 "--compare-no-backoff", "--result-file", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    on, off = results["kvgate_spec"], results["kvgate_spec_no_backoff"]
    assert on["greedy_identical_to_kvgate"] == off["greedy_identical_to_kvgate"] == "2/2"
    assert on["spec_decode"]["num_paused_steps"] > 0 == off["spec_decode"]["num_paused_steps"]
    assert on["spec_decode"]["num_drafts"] < off["spec_decode"]["num_drafts"]
    assert "without adaptive drafting" in capsys.readouterr().out


# -- sampling keeps the distribution ------------------------------------------------------------------------------


def chi_square_p(counts_a: Counter, counts_b: Counter) -> float:
    """Two-sample chi-square test of homogeneity (bins with < 10 draws in all merged into one): the p-value."""
    keys = [k for k in set(counts_a) | set(counts_b) if counts_a[k] + counts_b[k] >= 10]
    rest_a = sum(counts_a.values()) - sum(counts_a[k] for k in keys)
    rest_b = sum(counts_b.values()) - sum(counts_b[k] for k in keys)
    table = torch.tensor([[counts_a[k] for k in keys] + [rest_a], [counts_b[k] for k in keys] + [rest_b]],
                         dtype=torch.float64)
    table = table[:, table.sum(0) > 0]
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    df = table.shape[1] - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_rejection_sampler_draws_the_target_distribution():
    """verify_sampled alone, 40k draws: the first token follows p0 whatever the draft, the second (after an accepted
    draft) follows p1, and the bonus token follows the last row."""
    torch.manual_seed(0)
    p = torch.tensor([[0.5, 0.2, 0.2, 0.1, 0.0], [0.1, 0.6, 0.1, 0.1, 0.1], [0.3, 0.3, 0.2, 0.1, 0.1]])
    first, second, third = Counter(), Counter(), Counter()
    n = 40_000
    for _ in range(n):
        out = verify_sampled(p, [0, 1], None)
        first[out[0]] += 1
        if out[0] == 0:
            second[out[1]] += 1
            if out[1] == 1:
                third[out[2]] += 1
    for counts, row in ((first, p[0]), (second, p[1]), (third, p[2])):
        total = sum(counts.values())
        expected = Counter({t: round(float(row[t]) * total) for t in range(5)})
        assert chi_square_p(counts, expected) > 1e-3, (counts, row)
    assert first[4] == 0  # never a token of probability 0
    assert verify_greedy([3, 4, 5], [3, 9]) == [3, 4] and verify_greedy([3, 4, 5], [3, 4]) == [3, 4, 5]


class FixedDraft(Proposer):
    """A deterministic proposer like ngram (drafts are a function of the tokens: q is one-hot), whose drafts are
    the target's likely tokens, so that acceptance is frequent and a wrong residual would show."""

    def __init__(self, draft):
        self.draft = draft

    def reserve(self, request, limit):
        return self.draft[:limit]


class PausingBackoff(DraftBackoff):
    """Adaptive drafting that acts within 4 tokens: from an estimate of 0, a drafted step that accepts nothing
    pauses the next step, one that accepts a draft does not. So whether a request drafts depends on its earlier
    random draws: a wrong assumption that this keeps the distribution would show in the later positions."""

    PRIOR = 0.0


DISTRIBUTION_DRAWS = 10_000
DISTRIBUTION_SAMPLING = dict(temperature=0.4, max_tokens=4, ignore_eos=True)
DISTRIBUTION_ENGINE = dict(max_model_len=128, max_num_seqs=256, max_num_batched_tokens=1024)


@pytest.fixture(scope="module")
def plain_draws(tiny_model_dir) -> list[list[int]]:
    """The plain-sampling side of the distribution tests, drawn once for all of them: 10k requests of one prompt."""
    folder, _ = tiny_model_dir("qwen2")
    torch.manual_seed(1)
    plain = LLM(str(folder), **DISTRIBUTION_ENGINE)
    prompts = [{"prompt_token_ids": repetitive_prompts()[1]}] * DISTRIBUTION_DRAWS
    return [o.outputs[0].token_ids for o in plain.generate(prompts, SamplingParams(**DISTRIBUTION_SAMPLING))]


@pytest.mark.slow
@pytest.mark.parametrize("adaptive", ["default", "pausing"])
def test_sampling_with_speculation_keeps_the_distribution(adaptive, tiny_model_dir, plain_draws):
    """10k requests each way (20k draws a position), one prompt (prefix-cached), temperature 0.4: the second to
    fourth tokens' distributions with speculation agree with plain sampling (two-sample chi-square), with drafts both
    accepted and rejected; also while adaptive drafting pauses requests after their rejections."""
    folder, _ = tiny_model_dir("qwen2")
    prompt = repetitive_prompts()[1]
    params = SamplingParams(**DISTRIBUTION_SAMPLING)
    n = DISTRIBUTION_DRAWS
    want = plain_draws
    common = Counter(t[1] for t in want).most_common(2)
    spec = LLM(str(folder), **DISTRIBUTION_ENGINE,
               speculative_config={"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 1})
    spec.engine.scheduler.proposer = FixedDraft([common[0][0], Counter(t[2] for t in want).most_common(1)[0][0]])
    if adaptive == "pausing":
        spec.engine.scheduler.draft_backoff = PausingBackoff(0.5, spec.engine.spec_stats)
    got = [o.outputs[0].token_ids for o in spec.generate([{"prompt_token_ids": prompt}] * n, params)]
    stats = spec.engine.stats().spec_decode
    assert (stats.num_paused_steps > 0.1 * n) == (adaptive == "pausing"), stats
    assert stats.num_accepted_tokens > 0.2 * stats.num_draft_tokens, stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens, stats
    for position in (1, 2, 3):
        pvalue = chi_square_p(Counter(t[position] for t in got), Counter(t[position] for t in want))
        print(f"token {position + 1}: chi-square p = {pvalue:.3f} ({stats})")
        assert pvalue > 1e-3, (position, pvalue)
    assert chi_square_p(Counter(t[0] for t in got), Counter(t[0] for t in want)) > 1e-3


@pytest.mark.parametrize("window", [None, 7])
def test_verification_chunks_batched_in_attention_match_the_reference(window):
    """Verification chunks (a decode's token + drafts over a cached context) go through the torch path's batched
    groups, beside decodes and prefills: every query equals float64 attention, padding queries dropped."""
    seqs = [(5, 1), (3, 5), (16, 3), (47, 5), (0, 20), (30, 2), (12, 1), (60, 4), (15, 5)]
    verify = [new > 1 and cached > 0 for cached, new in seqs]
    heads, kv_heads, head_dim, bs = 8, 2, 16, 4
    q, cache, table, lens, starts = random_paged_batch(seqs, heads, kv_heads, head_dim, bs, torch.float32, "cpu")
    meta_seqs = [(c, n, table[i].tolist()) for i, (c, n) in enumerate(seqs)]
    meta = AttentionMetadata.build(meta_seqs, bs, torch.device("cpu"), kv_heads, cache.shape[2] // bs, window,
                                   verify=verify, num_heads=heads)
    assert sum(g.keep.numel() for g in meta.verifies) == sum(n for (_, n), v in zip(seqs, verify) if v)
    assert len(meta.verifies) >= 2 and len(meta.prefills) == 1  # grouped by length; the prefill on its own
    k = cache[0][:, meta.slot_mapping].transpose(0, 1)  # the new tokens' K/V are already in the cache
    v = cache[1][:, meta.slot_mapping].transpose(0, 1)
    got = paged_attention(q, k, v, cache.clone(), meta, head_dim**-0.5)
    want = reference_attention(q, cache, table, lens, starts, head_dim**-0.5, bs, window)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


# -- the proposer and the flag ------------------------------------------------------------------------------------


def test_ngram_proposer_follows_vllm():
    def propose(tokens, lo, hi, k, limit=99, max_model_len=1024):
        return NgramProposer(SpeculativeConfig("ngram", k, lo, hi), max_model_len).propose(tokens, limit)

    assert propose([1, 2, 3, 4, 2, 3], 2, 3, 4) == [4, 2, 3]  # vLLM's docstring example
    assert propose([1, 2, 3, 4, 1, 2, 3], 2, 2, 2) == [4, 1]
    assert propose([5, 9, 1, 2, 3, 7, 2, 3, 8, 1, 2, 3], 2, 3, 2) == [7, 2]  # the longest n-gram wins
    assert propose([2, 3, 4, 2, 3, 5, 2, 3], 2, 2, 1) == [4]  # its earliest occurrence
    assert propose([1, 2, 3, 4], 1, 3, 4) == []  # no match
    assert propose([1, 2, 1, 2, 1, 2], 2, 2, 4, limit=1) == [1]
    assert propose([1, 2, 1, 2], 1, 1, 4, max_model_len=5) == [1]  # never past max_model_len


def brute_force_proposal(tokens, lo, hi, k):
    """The definition: the tokens after the earliest earlier occurrence of the longest suffix n-gram."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for i in range(len(tokens) - n):  # an occurrence ends before the last token
            if tokens[i:i + n] == suffix:
                return tokens[i + n:i + n + k]
    return []


def test_ngram_index_kept_by_the_request_proposes_as_a_fresh_search():
    """The incremental index (extended as a request's tokens grow, one or several at a time, as accepted drafts
    add them) proposes exactly what a search of the whole token list does, at every length."""
    rng = random.Random(7)
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, 1, 4), 10_000)

    class Req:
        spec_state = None
        all_token_ids: list

    for trial in range(20):
        req = Req()
        req.all_token_ids = [rng.randrange(6) for _ in range(rng.randint(1, 12))]
        while len(req.all_token_ids) < 150:
            want = brute_force_proposal(req.all_token_ids, 1, 4, 3)
            assert proposer.reserve(req, 99) == want, (trial, req.all_token_ids)
            req.all_token_ids += [rng.randrange(6) for _ in range(rng.choice((1, 1, 2, 4)))]
        assert want, "drafts were found (a small alphabet repeats)"


@pytest.mark.parametrize("text, error", [
    ("{", "not valid JSON"),
    ('["ngram"]', "JSON object"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be ngram"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs \"model\""),
    ('{"method": "ngram"}', "num_speculative_tokens is required"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "positive integer"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "<="),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "unknown key"),
])
def test_bad_speculative_config_is_a_config_error(text, error):
    with pytest.raises(ConfigError, match=error):
        SpeculativeConfig.from_json(text)


def test_speculative_config_defaults_as_vllm():
    assert SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3}') == \
        SpeculativeConfig("ngram", 3, 5, 5)
    assert SpeculativeConfig.from_dict({"model": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 4}) \
        == SpeculativeConfig("ngram", 3, 4, 4)
    from kvgate.engine.config import EngineConfig

    with pytest.raises(ConfigError, match="torch backend"):
        EngineConfig(model="x", backend="sim", speculative_config=SPEC)
    with pytest.raises(ConfigError, match="async"):
        EngineConfig(model="x", async_scheduling=True, speculative_config=SPEC)
    for bad in (-1, "0.5", True, float("nan")):
        with pytest.raises(ConfigError, match="speculative_backoff_threshold"):
            EngineConfig(model="x", speculative_config=SPEC, speculative_backoff_threshold=bad)


@pytest.mark.slow
def test_speculation_flags_on_the_command_line(tiny_model_dir, capsys, caplog):
    """A bad --speculative-config or --speculative-backoff-threshold is a one-line error; the threshold
    reaches the engine (its start line says which adaptive drafting runs)."""
    from kvgate.cli import main

    folder, _ = tiny_model_dir("llama")
    capsys.readouterr()
    assert main(["generate", str(folder), "--prompt", "x", "--speculative-config", '{"method": "eagle"}']) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "method must be ngram" in err and "Traceback" not in err
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}'
    assert main(["generate", str(folder), "--prompt", "x", "--speculative-config", spec,
                 "--speculative-backoff-threshold", "-1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "speculative_backoff_threshold must be a number >= 0" in err
    with caplog.at_level(logging.INFO, logger="kvgate.engine"):
        assert main(["generate", str(folder), "--prompt", "abcabc", "--max-tokens", "6",
                     "--speculative-config", spec]) == 0
        assert main(["generate", str(folder), "--prompt", "abcabc", "--max-tokens", "6",
                     "--speculative-config", spec, "--speculative-backoff-threshold", "0"]) == 0
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")]
    assert "adaptive drafting below 0.25 accepted drafts per drafted step" in ready[0], ready
    assert "adaptive drafting off" in ready[1], ready


def test_spec_decode_metrics_as_vllm_names_them():
    from kvgate.engine.draft_model import DraftStats
    from kvgate.engine.server.exposition import render
    from kvgate.engine.server.metrics import draft_model_families, spec_decode_families
    from kvgate.engine.spec_decode import SpecDecodeStats

    stats = SpecDecodeStats(accepted_per_pos=[0, 0], num_paused_steps=3)
    stats.record(2, 1)
    stats.record(2, 2)
    text = render([*spec_decode_families(stats, "m"),
                   *draft_model_families(DraftStats(computed_tokens=90, catch_up_tokens=70, reused_tokens=64), "m")])
    for line in ('vllm:spec_decode_num_drafts_total{model_name="m"} 2.0',
                 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 4.0',
                 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 3.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 2.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 1.0',
                 # kvgate's own: adaptive drafting's pauses and a draft model's work
                 'kvgate:spec_decode_num_paused_steps_total{model_name="m"} 3.0',
                 'kvgate:spec_decode_draft_computed_tokens_total{model_name="m"} 90.0',
                 'kvgate:spec_decode_draft_catch_up_tokens_total{model_name="m"} 70.0',
                 'kvgate:spec_decode_draft_reused_tokens_total{model_name="m"} 64.0'):
        assert line in text, text
