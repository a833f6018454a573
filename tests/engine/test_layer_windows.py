"""Per-layer sliding windows: each layer's window read from the config as transformers reads it (Qwen2/Qwen3's
use_sliding_window + max_window_layers, layer_types, Mistral's window on every layer), bad values refused in one line,
greedy generation token-identical to HF with sliding layers among full-attention ones, and the KV blocks that every
layer's window has passed freed while a request runs."""

from __future__ import annotations

import random

import pytest

from kvgate.common.errors import ModelLoadError
from kvgate.engine import LLM, SamplingParams
from kvgate.engine.kv_cache_manager import cdiv
from kvgate.engine.models.layer_windows import freeable_window, layer_windows
from tests.engine.tiny_models import build_tiny_model, hf_greedy, make_config, sliding_qwen_config

WINDOW = 20
MAX_NEW = 12


def qwen_config(family: str, **overrides):
    return sliding_qwen_config(family, WINDOW, **overrides)


def test_qwen_max_window_layers_splits_the_layers_as_transformers_does():
    for family in ("qwen2", "qwen3"):
        config = qwen_config(family)
        assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]  # transformers'
        assert layer_windows(config) == [None, WINDOW, WINDOW]
        assert layer_windows(config, max_positions=WINDOW) == [None] * 3  # a window over every position
        assert layer_windows(qwen_config(family, use_sliding_window=False)) == [None] * 3
        assert layer_windows(qwen_config(family, max_window_layers=0)) == [WINDOW] * 3
        assert layer_windows(qwen_config(family, max_window_layers=3)) == [None] * 3
    mistral = make_config("mistral")
    mistral.sliding_window = 8
    assert layer_windows(mistral) == [8, 8]
    assert freeable_window([8, 8]) == 8 and freeable_window([None, 8]) is None and freeable_window([4, 8]) == 8


@pytest.mark.parametrize("overrides,message", [
    (dict(sliding_window=0), "sliding_window must be a positive integer, got 0"),
    (dict(sliding_window=-4), "sliding_window must be a positive integer, got -4"),
    (dict(max_window_layers=4), r"max_window_layers must be an integer in 0..num_hidden_layers \(3\), got 4"),
    (dict(max_window_layers=-1), r"max_window_layers must be an integer in 0..num_hidden_layers \(3\), got -1"),
])
def test_bad_window_settings_are_one_line_load_errors(overrides, message):
    config = qwen_config("qwen2")
    for name, value in overrides.items():  # after the config's own init (it would build layer_types from them)
        setattr(config, name, value)
    with pytest.raises(ModelLoadError, match=message) as err:
        layer_windows(config)
    assert "\n" not in str(err.value)


def test_bad_layer_types_are_one_line_load_errors():
    config = qwen_config("qwen2")
    config.layer_types = ["full_attention", "sliding_attention"]
    with pytest.raises(ModelLoadError, match=r"layer_types must list one type per layer \(3\)"):
        layer_windows(config)
    config.layer_types = ["full_attention", "chunked_attention", "sliding_attention"]
    with pytest.raises(ModelLoadError, match="layer_types .'chunked_attention'. are not supported"):
        layer_windows(config)


def test_a_bad_window_in_config_json_fails_the_load(tmp_path):
    config = qwen_config("qwen2")
    build_tiny_model("qwen2", tmp_path, config=config)
    text = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(text.replace(f'"sliding_window": {WINDOW}', '"sliding_window": 0'))
    with pytest.raises(ModelLoadError, match="sliding_window must be a positive integer, got 0"):
        LLM(str(tmp_path), max_model_len=128)


def window_prompts() -> list[list[int]]:
    """Prompts shorter and (mostly) longer than the window, two sharing a 32-token prefix."""
    rng = random.Random(57)
    shared = [rng.randrange(256) for _ in range(32)]
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (7, 23, 45, 70)]
    return prompts + [shared + prompts[2][:10], shared + prompts[3][:4]]


MODES = {
    "chunked-prefill": dict(max_num_batched_tokens=16, enable_prefix_caching=True),
    "async-preemption": dict(num_gpu_blocks_override=10, max_num_seqs=8, async_scheduling=True),
}


@pytest.mark.slow
def test_sliding_layers_among_full_ones_match_hf(tmp_path):
    """Layer 0 attends to everything, layers 1-2 to the last WINDOW tokens: prompts and generations past the window
    give HF's greedy tokens exactly (the SDPA path, in each mode), and nothing is freed early (a full layer reads
    all). Qwen3 reads its windows by the same rule (test above) into the same attention."""
    family = "qwen2"
    model = build_tiny_model(family, tmp_path, seed=5, config=qwen_config(family))
    prompts = window_prompts()
    expected = hf_greedy(model, prompts, MAX_NEW)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    no_window = qwen_config(family, max_window_layers=3)  # every layer full attention
    full = hf_greedy(build_tiny_model(family, tmp_path / "full", seed=5, config=no_window), prompts, MAX_NEW)
    assert full != expected, "the window should change some outputs (else this test could not fail)"
    for mode, args in MODES.items():
        llm = LLM(str(tmp_path), max_model_len=128, **args)
        assert llm.engine.runner.layer_windows == [None, WINDOW, WINDOW]
        assert llm.engine.kv_cache_manager.sliding_window is None
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        for i, (g, e) in enumerate(zip(got, expected)):
            assert g == e, f"{family}/{mode}: prompt {i} (len {len(prompts[i])}) diverges from HF"
        if mode == "async-preemption":
            assert llm.engine.stats().num_preemptions > 0


@pytest.mark.slow
def test_blocks_outside_every_window_are_freed_while_requests_run(tmp_path):
    """Every layer slides (Qwen2 with max_window_layers 0), async scheduling: a request holds at most the blocks its
    window spans (plus the one being filled), outputs still match HF, and with prefix caching the second pass (hits
    on freed blocks that kept their hashes) is still exact."""
    model = build_tiny_model("qwen2", tmp_path, seed=5, config=qwen_config("qwen2", max_window_layers=0))
    prompts = window_prompts()[2:]
    expected = hf_greedy(model, prompts, MAX_NEW)
    # 16 blocks of 8: the four requests need 30 at their ends without freeing, 4 or 5 each with it
    llm = LLM(str(tmp_path), max_model_len=96, max_num_batched_tokens=16, block_size=8, async_scheduling=True,
              num_gpu_blocks_override=16)
    engine, kv = llm.engine, llm.engine.kv_cache_manager
    assert engine.runner.kv_window == kv.sliding_window == WINDOW
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outputs, freed, steps = {}, 0, 0
    while engine.has_unfinished_requests() and steps < 1000:
        steps += 1
        for o in engine.step():
            if o.finished:
                outputs[int(o.request_id)] = o.outputs[0].token_ids
        for r in engine.scheduler.running:
            ids = kv.get_block_ids(r.request_id)
            held = kv.num_held_blocks(r.request_id)
            # the window of the next query, the block that query writes into, and one block of alignment slack
            assert held <= cdiv(WINDOW, 8) + 2, (r.request_id, r.num_computed_tokens, ids)
            freed = max(freed, ids.count(None))
            assert all(b is None for b in ids[:ids.count(None)]), "freed blocks are the leading ones"
    assert [outputs[i] for i in range(len(prompts))] == expected
    assert engine.stats().num_preemptions == 0, "freeing behind the window should have left room for all four"
    # the 70-token prompt's last step computes from position 80: blocks wholly before 80 - WINDOW + 1 = 61 go
    assert freed == (70 + MAX_NEW - 2 - WINDOW + 1) // 8, "the long prompt should have let its early blocks go"
    assert kv.pool.num_free_blocks == kv.num_blocks  # every block back, none freed twice (the pool asserts that)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in again] == expected
