"""Split-KV decode (engine/triton_split_decode.py) on CPU under Triton's interpreter: the split plan, the kernels
against the float64 reference for contexts of many blocks cut into 1..N splits (odd lengths, GQA/MQA, windows,
batch 1 and mixed lengths, graph padding, the quantized cache), and the whole engine on the split path giving HF's
greedy tokens. The compiled kernels: test_triton_compile.py (cubins) and gpu_kernel_bench.py's splitkv part."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if torch.cuda.is_available():  # the interpreter would take over the compiled kernels of a GPU run
    pytest.skip("CUDA is present: the interpreter tests run on CPU hosts", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the kernels' modules below)
pytest.importorskip("triton")

from kvgate.engine import triton_split_decode as sd  # noqa: E402
from tests.engine.paged_reference import random_paged_batch, reference_attention  # noqa: E402

if "Interpreted" not in type(sd._split_decode_kernel).__name__:  # decorated before the variable was set
    importlib.reload(sd)
assert "Interpreted" in type(sd._split_decode_kernel).__name__

TILE = 32  # small tiles and splits: contexts of a few hundred tokens take many splits, and the interpreter is fast


def test_plan_splits_fills_the_gpu_at_small_batches_only():
    assert sd.plan_splits(1, 8, 132) == 32  # ceil(264 / 8) = 33, clamped to MAX_SPLITS
    assert sd.plan_splits(1, 8, 132, max_splits=16) == 16
    assert sd.plan_splits(4, 8, 132) == 9  # ceil(264 / 32)
    assert sd.plan_splits(2, 4, 78) == 20  # ceil(156 / 8)
    assert sd.plan_splits(33, 8, 132) == 1 and sd.plan_splits(256, 8, 132) == 1  # the batch fills the GPU
    assert sd.plan_splits(1, 8, 132, max_splits=1) == 1  # --max-decode-splits 1: off
    for bad in ((0, 8, 132), (1, 0, 132), (1, 8, 0), (1, 8, 132, 0)):
        with pytest.raises(ValueError):
            sd.plan_splits(*bad)


def test_max_decode_splits_is_checked_and_reaches_the_config():
    import argparse

    from kvgate.common.errors import ConfigError
    from kvgate.engine.cli_args import add_engine_args, engine_config_from_args
    from kvgate.engine.config import EngineConfig

    for bad in (0, 257, True, "4", 2.0):
        with pytest.raises(ConfigError, match="max_decode_splits"):
            EngineConfig(model="m", max_decode_splits=bad)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args("m", parser.parse_args(["--max-decode-splits", "1"])).max_decode_splits == 1
    assert engine_config_from_args("m", parser.parse_args([])).max_decode_splits == sd.MAX_SPLITS


@pytest.mark.parametrize("seq_len,window,splits,min_tokens", [
    (1, None, 8, 64), (31, None, 8, 32), (1000, None, 5, 64), (1000, None, 64, 64), (1000, 200, 8, 64),
    (32768, None, 32, 512), (8192, 4096, 32, 512), (100, 300, 4, 32),
])
def test_split_ranges_cover_the_visible_context_once(seq_len, window, splits, min_tokens):
    ranges = sd.split_ranges(seq_len, window, TILE, splits, min_tokens)
    begin = max(seq_len - window, 0) if window else 0
    assert 1 <= len(ranges) <= splits
    assert ranges[0][0] == begin and ranges[-1][1] == seq_len
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, no overlap
    assert all(start % TILE == 0 for start, _ in ranges[1:])  # whole tiles
    if len(ranges) > 1:
        assert all(end - start >= min_tokens for start, end in ranges[1:-1])


# decodes of a few hundred tokens (many blocks), odd lengths, a 1-token context, block boundaries
LONG_DECODES = [(700, 1), (0, 1), (128, 1), (332, 1), (47, 1)]


def _check(seqs, heads, kv_heads, head_dim, block_size, window, dtype, num_splits, quant=None, seed=0):
    q, cache, table, lens, starts = random_paged_batch(seqs, heads, kv_heads, head_dim, block_size, torch.float32,
                                                       "cpu", seed=seed, padded_tokens=2, padded_seqs=2)
    q = q.to(dtype)
    kv, ref_cache = cache.to(dtype), cache.to(dtype)
    if quant is not None:
        from kvgate.engine.kv_quant import QuantizedKVCache, dequantize, kv_quant_spec, quantize

        spec = kv_quant_spec(quant)
        values, scales = quantize(cache * 3.0, spec)
        kv, ref_cache = QuantizedKVCache(values, scales, spec), dequantize(values, scales, spec, torch.float32)
        ref_cache = ref_cache.to(dtype)
    out = torch.full_like(q, float("nan"))  # every real row must be written, and only those
    sd.split_decode_attention(q, kv, out, table, lens, starts, scale=head_dim**-0.5, block_size=block_size,
                              num_splits=num_splits, sliding_window=window, min_split_tokens=TILE, tile=TILE)
    ref = reference_attention(q, ref_cache, table, lens, starts, head_dim**-0.5, block_size, window)
    total = len(seqs)
    got = out[:total].double()
    assert not got.isnan().any()
    assert out[total:].isnan().all()  # padding rows untouched
    err = ((got - ref[:total]).norm() / ref[:total].norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 2e-3), (num_splits, err)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window,dtype", [
    (8, 2, 32, 16, None, torch.float32),  # GQA 4
    (6, 2, 24, 16, 150, torch.float32),  # GQA 3, head_dim not a power of two, a window shorter than some contexts
    (8, 1, 64, 8, None, torch.float16),  # MQA, half precision
    (4, 4, 16, 4, 333, torch.float32),  # MHA, small blocks, a window ending inside a tile
])
@pytest.mark.parametrize("num_splits", [1, 3, 7])
def test_split_kernels_match_reference(heads, kv_heads, head_dim, block_size, window, dtype, num_splits):
    _check(LONG_DECODES, heads, kv_heads, head_dim, block_size, window, dtype, num_splits, seed=heads + num_splits)


def test_batch_one_long_context_many_splits():
    """One sequence of 2000 tokens (125 blocks) cut into 16 splits of 4 tiles: the merge of 16 partial softmaxes."""
    assert len(sd.split_ranges(2000, None, TILE, 16, TILE)) == 16
    _check([(1999, 1)], 8, 2, 32, 16, None, torch.float32, 16, seed=5)


@pytest.mark.parametrize("quant", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_split_kernels_dequantize_inside(quant):
    _check(LONG_DECODES, 6, 2, 24, 16, 150, torch.float32, 5, quant=quant, seed=3)


def test_multi_token_sequences_are_left_to_the_prefill_kernel():
    """A mixed step's chunks (query length > 1) are not the split kernels' to write: their rows stay as they were."""
    seqs = [(300, 1), (20, 13), (0, 1)]
    q, cache, table, lens, starts = random_paged_batch(seqs, 4, 2, 32, 16, torch.float32, "cpu", seed=1)
    out = torch.full_like(q, float("nan"))
    sd.split_decode_attention(q, cache, out, table, lens, starts, scale=32**-0.5, block_size=16, num_splits=4,
                              min_split_tokens=TILE, tile=TILE)
    ref = reference_attention(q, cache, table, lens, starts, 32**-0.5, 16)
    assert out[1:14].isnan().all()
    for row in (0, 14):
        assert torch.allclose(out[row].double(), ref[row], atol=1e-6)


def test_bad_split_count_is_refused():
    q, cache, table, lens, starts = random_paged_batch([(3, 1)], 4, 2, 32, 16, torch.float32, "cpu")
    with pytest.raises(ValueError, match="num_splits"):
        sd.split_decode_attention(q, cache, torch.empty_like(q), table, lens, starts, scale=1.0, block_size=16,
                                  num_splits=0)


@pytest.mark.slow
def test_engine_on_split_path_matches_hf(tiny_model_dir, monkeypatch):
    """The whole engine with decode steps on the split kernels (tiles and splits of 16 tokens, so a 41-token context
    takes both of batch 1's splits; padded to captured-graph shapes) gives HF's greedy tokens: the merge must be
    exact."""
    from kvgate.engine import LLM, SamplingParams
    from tests.engine.tiny_models import hf_greedy, random_tokens

    monkeypatch.setattr(sd, "MIN_SPLIT_TOKENS", 16)
    monkeypatch.setattr(sd, "DECODE_LAUNCH", dict(sd.DECODE_LAUNCH, tile=16))
    folder, model = tiny_model_dir("qwen3")
    prompts = [random_tokens(41, seed=41)]
    expected = hf_greedy(model, prompts, 4)
    llm = LLM(str(folder), max_model_len=128, attention_backend="triton", max_num_seqs=1)
    runner = llm.engine.runner
    assert runner.shapes is not None
    assert len(sd.split_ranges(41, None, 16, runner._decode_splits(1), 16)) == 2
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == expected
