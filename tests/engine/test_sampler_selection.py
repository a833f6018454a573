"""Top-k / top-p by partial selection and bisection against the full-vocabulary sort they replace, and penalties
from device-side token counts against counts rebuilt from the host's lists."""

from __future__ import annotations

import pytest
import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.penalty_state import PenaltyState
from kvgate.engine.request import Request
from kvgate.engine.sampler import Sampler, SamplingBatch, apply_top_k_top_p, apply_top_k_top_p_by_sort
from tests.engine.tiny_models import random_tokens

VOCAB = 3000


def random_logits(rows: int, seed: int, scale: float) -> torch.Tensor:
    """Continuous logits (no exact ties), peaked to flat by scale."""
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * scale


ROW_SETTINGS = [(0, 0.9), (50, 1.0), (50, 0.9), (1, 0.5), (0, 0.05), (0, 1.0), (20, 0.99), (0, 0.999), (700, 0.6),
                (0, 0.3)]


@pytest.mark.parametrize("scale", [0.5, 2.0, 6.0])
@pytest.mark.parametrize("seed", range(3))
def test_kept_sets_equal_the_full_sort(seed, scale):
    """Mixed rows (top-k only, top-p only, both, neither) keep exactly the tokens the sort keeps, with the
    sampler's own row split (top_p_only_rows) and with the rows left to the function."""
    logits = random_logits(len(ROW_SETTINGS), seed, scale)
    top_k = torch.tensor([k for k, _ in ROW_SETTINGS])
    top_p = torch.tensor([p for _, p in ROW_SETTINGS])
    expected = torch.isfinite(apply_top_k_top_p_by_sort(logits, top_k, top_p))
    only = torch.tensor([i for i, (k, p) in enumerate(ROW_SETTINGS) if k == 0 and p < 1.0])
    for got in (apply_top_k_top_p(logits, top_k, top_p, int(top_k.max()), only),
                apply_top_k_top_p(logits, top_k, top_p, int(top_k.max()))):
        assert torch.equal(torch.isfinite(got), expected)
        assert torch.equal(got[expected], logits[expected])  # kept logits unchanged
    # top-p alone (no row with top_k)
    got = apply_top_k_top_p(logits, None, top_p)
    assert torch.equal(torch.isfinite(got), torch.isfinite(apply_top_k_top_p_by_sort(logits, None, top_p)))


def test_ties_at_the_kth_logit_are_kept_like_the_sort():
    logits = torch.arange(VOCAB, dtype=torch.float32).repeat(2, 1) / VOCAB
    logits[:, 100:110] = 5.0  # ten tokens tied at the top
    logits[1, 2000:2004] = 4.0  # and four more tied just under them in row 1
    top_k = torch.tensor([3, 12])
    # top-p 0.85 in row 1: the ten tokens at 5.0 hold 0.87 of the kept mass, so the cut-off ends with their group
    # (a cut-off inside a tied group keeps all of it here, an arbitrary part of it in the sort)
    for top_p, kept in ((None, [10, 14]), (torch.tensor([1.0, 0.85]), [10, 10])):
        expected = torch.isfinite(apply_top_k_top_p_by_sort(logits, top_k, top_p))
        got = torch.isfinite(apply_top_k_top_p(logits, top_k, top_p, 12))
        assert torch.equal(got, expected)
        assert got.sum(dim=-1).tolist() == kept  # every tie with the k-th kept


def test_seeded_draws_equal_the_full_sort_sampler(monkeypatch):
    """Same seeds, same draws: the sampler with the partial selection against the same sampler on the sort."""
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=100 + i)
              for i, (t, (k, p)) in enumerate(zip([0.7, 1.0, 1.3, 0.9, 0.5] * 2, ROW_SETTINGS))]
    logits = random_logits(len(params), 7, 3.0)

    def draws(selection) -> list[list[int]]:
        monkeypatch.setattr("kvgate.engine.sampler.apply_top_k_top_p", selection)
        requests = [Request(f"r{i}", [1, 2, 3], p) for i, p in enumerate(params)]
        for r in requests:
            r.generator = torch.Generator().manual_seed(r.sampling_params.seed)
        sampler, out = Sampler(), []
        for _ in range(40):
            tokens, _ = sampler(logits.clone(), SamplingBatch.build(requests, VOCAB, torch.device("cpu")))
            out.append(tokens.tolist())
        return out

    partial = draws(apply_top_k_top_p)
    by_sort = draws(lambda logits, top_k, top_p, *_: apply_top_k_top_p_by_sort(logits, top_k, top_p))
    assert partial == by_sort
    assert len({tuple(step) for step in partial}) > 30  # they are draws, not one token again and again


def test_penalty_counts_follow_the_sampled_tokens():
    """The device counts after several sampler steps equal the counts of the tokens those steps sampled, and a
    finished request's row is reused from a clean start."""
    state = PenaltyState(50, torch.device("cpu"), initial_rows=1)  # grows on the second request
    params = SamplingParams(temperature=1.0, repetition_penalty=1.2, frequency_penalty=0.5, seed=1)
    requests = [Request(f"r{i}", [3, 4, 4], params) for i in range(2)]
    for r in requests:
        r.generator = torch.Generator().manual_seed(1)
    sampled: list[list[int]] = [[], []]
    for step in range(30):
        logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(step))
        tokens, _ = Sampler()(logits, SamplingBatch.build(requests, 50, torch.device("cpu"), penalty_state=state))
        for i, t in enumerate(tokens.tolist()):
            sampled[i].append(t)
    rows = state.rows(requests)
    for i, row in enumerate(rows):
        expected = torch.bincount(torch.tensor(sampled[i]), minlength=50).float()
        assert torch.equal(state.output_counts[row], expected)
        assert state.prompt_seen[row].nonzero().flatten().tolist() == [3, 4]
    requests[0].status = type(requests[0].status).FINISHED_STOPPED
    again = Request("r2", [7], params)
    assert state.rows([again]) == [rows[0]] and state.output_counts[rows[0]].sum() == 0


@pytest.mark.slow
def test_penalized_outputs_equal_counts_rebuilt_from_host_lists(tiny_model_dir):
    """The engine with async scheduling and device counts generates what it generates synchronously with counts
    rebuilt from the host's token lists at every step (the previous sampler's way)."""
    folder, _ = tiny_model_dir("qwen2")
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.6,
                             max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.8, top_k=20, repetition_penalty=1.3, max_tokens=12, ignore_eos=True,
                             seed=9)]
    prompts = [{"prompt_token_ids": random_tokens(12, 3)}, {"prompt_token_ids": random_tokens(9, 4)}]
    llm = LLM(str(folder), max_model_len=128, async_scheduling=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    llm.engine.async_scheduling = False  # the same engine, each step waited for before the next
    runner = llm.engine.runner
    sample = runner._sample

    def sample_with_fresh_counts(*args, **kwargs):
        runner._penalty_state = None  # filled again from the requests' prompt and output lists
        return sample(*args, **kwargs)

    runner._sample = sample_with_fresh_counts
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == expected
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts[:1], SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True))]
    assert plain[0] != got[0]  # the penalties changed the greedy output
