"""Sampling: reproducible seeds, top_k=1 == greedy, processors against reference formulas, stop strings."""

import math
import re

import numpy as np
import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.detokenizer import IncrementalDetokenizer
from kvgate.common.errors import InvalidRequestError
from kvgate.engine.request import Request
from tests.engine.tiny_models import random_tokens as tokens
from kvgate.engine.sampler import (Sampler, SamplingBatch, apply_logit_bias, apply_min_p, apply_penalties,
                                   apply_top_k_top_p)


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    folder, _ = tiny_model_dir("qwen2")
    return LLM(str(folder), max_model_len=256)


def gen(llm, prompts, params):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.slow
def test_seeded_sampling_reproducible_across_runs_and_batches(llm, tiny_model_dir):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=1234, ignore_eos=True)
    prompt = tokens(20, 1)
    alone = gen(llm, [prompt], params)[0]
    others = [tokens(5 + 7 * i, 10 + i) for i in range(5)]
    unseeded = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    batched = llm.generate([{"prompt_token_ids": p} for p in [*others[:2], prompt, *others[2:]]],
                           [unseeded, unseeded, params, unseeded, unseeded, unseeded])
    assert batched[2].outputs[0].token_ids == alone
    folder, _ = tiny_model_dir("qwen2")
    fresh = LLM(str(folder), max_model_len=256, max_num_batched_tokens=8)  # another engine, chunked prefill
    assert gen(fresh, [prompt], params)[0] == alone
    # and a different seed gives a different sequence
    assert gen(llm, [prompt], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=99,
                                             ignore_eos=True))[0] != alone


def test_n_children_use_consecutive_seeds(llm):
    prompt = tokens(12, 2)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=12, seed=50, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    for i, c in enumerate(out.outputs):
        single = SamplingParams(temperature=1.0, max_tokens=12, seed=50 + i, ignore_eos=True)
        assert c.token_ids == gen(llm, [prompt], single)[0]


def test_top_k_1_equals_greedy(llm):
    prompts = [tokens(n, 3 + n) for n in (4, 17, 33)]
    greedy = gen(llm, prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    topk1 = gen(llm, prompts, SamplingParams(temperature=1.3, top_k=1, max_tokens=16, ignore_eos=True))
    assert topk1 == greedy


# -- processors on fixed logits against reference formulas ----------------------------------------

LOGITS = np.array([[2.0, 1.0, 0.5, -1.0, 0.0, 3.0], [0.1, 0.2, 0.3, 0.4, -0.5, -2.0]], dtype=np.float32)


def softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def test_penalties_match_reference():
    prompt_ids = [[0, 3], [1]]
    output_ids = [[5, 5, 2], [1, 4]]
    rep, pres, freq = [1.3, 2.0], [0.5, 0.0], [0.25, 1.0]
    expected = LOGITS.copy()
    for row in range(2):
        seen = set(prompt_ids[row]) | set(output_ids[row])
        for t in seen:  # CTRL / HF repetition penalty
            v = expected[row, t]
            expected[row, t] = v / rep[row] if v > 0 else v * rep[row]
        for t in set(output_ids[row]):  # OpenAI presence / frequency
            expected[row, t] -= freq[row] * output_ids[row].count(t) + pres[row]
    prompt_mask = torch.zeros(2, 6, dtype=torch.bool)
    counts = torch.zeros(2, 6)
    for row in range(2):
        prompt_mask[row, prompt_ids[row]] = True
        for t in output_ids[row]:
            counts[row, t] += 1
    got = apply_penalties(torch.tensor(LOGITS), prompt_mask, counts, torch.tensor(rep), torch.tensor(pres),
                          torch.tensor(freq))
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6)


def test_min_p_matches_reference():
    min_p = [0.3, 0.9]
    probs = softmax(LOGITS)
    expected_keep = probs >= np.array(min_p)[:, None] * probs.max(axis=-1, keepdims=True)
    got = apply_min_p(torch.tensor(LOGITS), torch.tensor(min_p))
    assert (torch.isfinite(got).numpy() == expected_keep).all()


@pytest.mark.parametrize("top_k,top_p", [(3, 1.0), (0, 0.7), (4, 0.8), (0, 0.05)])
def test_top_k_top_p_match_reference(top_k, top_p):
    expected_keep = np.zeros_like(LOGITS, dtype=bool)
    for row in range(2):
        order = np.argsort(-LOGITS[row], kind="stable")
        keep = order[:top_k] if top_k else order
        p = softmax(LOGITS[row][keep])
        # smallest prefix (in probability order) whose mass reaches top_p
        cum, chosen = 0.0, []
        for idx, pi in zip(keep, p):
            chosen.append(idx)
            cum += pi
            if cum >= top_p - 1e-7:
                break
        expected_keep[row, chosen] = True
    got = apply_top_k_top_p(torch.tensor(LOGITS), torch.tensor([top_k] * 2), torch.tensor([top_p] * 2))
    assert (torch.isfinite(got).numpy() == expected_keep).all()


def make_batch(params_list, generators=None):
    reqs = [Request(f"r{i}", [0], p) for i, p in enumerate(params_list)]
    for r in reqs:
        r.generator = (generators or {}).get(r.request_id)
    return SamplingBatch.build(reqs, LOGITS.shape[1], torch.device("cpu"))


def test_temperature_sampling_distribution():
    """Empirical frequencies of 20k draws match softmax(logits / T) (with top-p) within 4 sigma."""
    torch.manual_seed(0)
    temp, top_p = 0.7, 0.9
    batch = make_batch([SamplingParams(temperature=temp, top_p=top_p)] * 20000)
    logits = torch.tensor(LOGITS[:1]).repeat(20000, 1)
    tokens, _ = Sampler()(logits, batch)
    freq = np.bincount(tokens.numpy(), minlength=6) / 20000
    z = LOGITS[0] / temp
    p = softmax(z)
    order = np.argsort(-p)
    keep, cum = [], 0.0
    for idx in order:
        keep.append(idx)
        cum += p[idx]
        if cum >= top_p:
            break
    expected = np.zeros(6)
    expected[keep] = p[keep] / p[keep].sum()
    sigma = np.sqrt(expected * (1 - expected) / 20000) + 1e-9
    assert (np.abs(freq - expected) <= 4 * sigma + 1e-4).all(), (freq, expected)


def test_logprobs_are_raw_model_logprobs():
    batch = make_batch([SamplingParams(temperature=0.0, logprobs=3), SamplingParams(temperature=0.0)])
    tokens, device_logprobs = Sampler()(torch.tensor(LOGITS), batch)
    logprobs = device_logprobs.entries()  # read back on the host (the runner copies them with the tokens)
    ref = np.log(softmax(LOGITS[0]))
    assert tokens.tolist() == [5, 3]
    entry = logprobs[0]
    assert set(entry) == {5, 0, 1}
    assert entry[5].rank == 1 and math.isclose(entry[5].logprob, ref[5], rel_tol=1e-5)
    assert entry[0].rank == 2 and math.isclose(entry[0].logprob, ref[0], rel_tol=1e-5)
    assert logprobs[1] is None


def test_min_tokens_masks_eos():
    p = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    p.eos_token_ids = (5,)
    tokens, _ = Sampler()(torch.tensor(LOGITS), make_batch([p, p]))
    assert tokens.tolist() == [0, 2]  # 5 (EOS) and 3 (stop id) are banned while under min_tokens


def test_logit_bias_moves_only_its_own_row():
    """A batch of mixed requests: the biased rows get their biases added to exactly their tokens' logits; the
    unbiased greedy and seeded rows sample what they sample in a batch without any bias; logprobs stay raw."""
    plain, seeded = SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=1.0, seed=3)
    biased = SamplingParams(temperature=0.0, logprobs=1, logit_bias={3: 10.0, 5: -100.0})
    bias_only = SamplingParams(temperature=0.0, logit_bias={2: 2.4})
    logits = torch.tensor(np.concatenate([LOGITS, LOGITS[:1], LOGITS[:1]]))

    def run(params):
        gens = {f"r{i}": torch.Generator().manual_seed(3) for i, p in enumerate(params) if p.seed is not None}
        tokens, device_logprobs = Sampler()(logits.clone(), make_batch(params, gens))
        return tokens, device_logprobs.entries()

    mixed_tokens, mixed_logprobs = run([biased, plain, seeded, bias_only])
    alone_tokens, alone_logprobs = run([plain, plain, seeded, plain])
    assert mixed_tokens.tolist()[1:3] == alone_tokens.tolist()[1:3]  # the rows without a bias
    assert mixed_tokens[0] == 3  # 2.0 + 10 beats 3.0 - 100 and the rest
    assert mixed_tokens[3] == 5  # 0.5 + 2.4 < 3.0: a bias that does not win leaves the argmax
    raw = np.log(softmax(LOGITS[0]))
    assert math.isclose(mixed_logprobs[0][3].logprob, raw[3], rel_tol=1e-5)  # the model's, not the biased
    assert mixed_logprobs[1] == alone_logprobs[1]
    batch = make_batch([biased, plain])
    biased_logits = torch.tensor(LOGITS)
    apply_logit_bias(biased_logits, batch.logit_bias)
    expected = LOGITS.copy()
    expected[0, 3] += 10.0
    expected[0, 5] -= 100.0
    np.testing.assert_array_equal(biased_logits.numpy(), expected)
    assert make_batch([plain, seeded]).logit_bias is None  # nobody biased: nothing built, nothing applied


def test_logit_bias_offline_and_checked(llm):
    prompt = tokens(9, 4)
    base = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = gen(llm, [prompt], base)[0]
    target = next(t for t in range(5, 100) if t not in plain)
    biased = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logit_bias={target: 100.0})
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, [biased, base])
    assert outs[0].outputs[0].token_ids == [target] * 8 and outs[1].outputs[0].token_ids == plain
    for bias, says in (({10**9: 1.0}, "outside the vocabulary"), ({target: 100.5}, "[-100, 100]"),
                       ({target: float("nan")}, "[-100, 100]"), ({"7": 1.0}, "token ids")):
        with pytest.raises(InvalidRequestError, match=re.escape(says)) as info:
            llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, logit_bias=bias))
        assert info.value.param == "logit_bias"
    assert SamplingParams(logit_bias={}).logit_bias is None


# -- stop strings --------------------------------------------------------------------------------


def test_stop_string_spanning_tokens_stops_and_is_excluded(llm):
    prompt = tokens(10, 8)
    base = llm.generate([{"prompt_token_ids": prompt}],
                        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    text = base.text
    assert len(text) >= 12, text
    stop = text[6:9]  # three characters = three byte tokens: the match spans token boundaries
    first = text.find(stop)
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[:first]
    assert len(out.token_ids) < len(base.token_ids)
    inc = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop],
                                      include_stop_str_in_output=True))[0].outputs[0]
    assert inc.text == text[: first + len(stop)]


def test_detokenizer_multibyte_and_held_back_deltas(llm):
    tok = llm.tokenizer
    ids = tok.encode("ab€cd-STOP-ef")
    det = IncrementalDetokenizer(tok, SamplingParams(stop=["-STOP-"]), prompt_token_ids=[1, 2])
    deltas, stop = [], None
    for t in ids:
        stop = det.add_token(t)
        deltas.append(det.next_delta(finished=stop is not None))
        if stop:
            break
    assert stop == "-STOP-"
    assert "".join(deltas) == "ab€cd" == det.output_text
    assert "\ufffd" not in "".join(deltas)  # the 3-byte € was never split into replacement characters
