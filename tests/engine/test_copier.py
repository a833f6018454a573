"""The copier model's build (engine/copier.py): its training data, and the folder keyed by its recipe (reused by a
second call, rebuilt for another recipe). The full recipe trains for ~50 s, so the bench alone uses it; these
tests train a few steps."""

import torch

from kvgate.engine import LLM, SamplingParams
from kvgate.engine.copier import COPIER_RECIPE, ensure_copier_model, recipe_key, repeating_batch

TINY_RECIPE = {**COPIER_RECIPE, "shape": dict(COPIER_RECIPE["shape"], max_position_embeddings=64),
               "stages": [(3, 16, 2, 8)]}


def test_training_rows_repeat_with_their_period():
    x, mask = repeating_batch(torch.Generator().manual_seed(0), 40, 6, 12)
    for row, m in zip(x, mask):
        period = int((~m).sum())
        assert 8 <= period <= 12
        assert torch.equal(row[period:], row[:40 - period])  # every masked-in position repeats its period


def test_copier_folder_is_keyed_by_its_recipe_and_reused(tmp_path, monkeypatch):
    first = ensure_copier_model(tmp_path, TINY_RECIPE)
    assert first.name == f"copier-{recipe_key(TINY_RECIPE)}"
    import kvgate.engine.copier as copier

    def fail(*args):
        raise AssertionError("retrained a cached recipe")

    monkeypatch.setattr(copier, "build_copier_model", fail)
    assert ensure_copier_model(tmp_path, TINY_RECIPE) == first
    other = {**TINY_RECIPE, "seed": TINY_RECIPE["seed"] + 1}
    assert recipe_key(other) != recipe_key(TINY_RECIPE)
    llm = LLM(str(first), max_model_len=64)  # an ordinary HF folder the engine loads
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
