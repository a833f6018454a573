"""The fused MoE kernels (engine/triton_moe.py) on CPU under Triton's interpreter, against torch_experts (the CPU
path, itself checked against HF in test_moe.py): fp32 to round-off, bf16/fp16 to rounding, over routings with idle
experts, one token, no tokens, top-k 1/2/8, expert counts that are not powers of two and widths that are not
multiples of the blocks; the expert alignment's invariants; the wiring by use_fused_kernels. The `cuda` tests run
the same kernels compiled (skipped without CUDA)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the kernels' module below)
pytest.importorskip("triton")

from kvgate.engine import triton_moe as tm  # noqa: E402
from kvgate.engine.models.moe import select_experts, torch_experts  # noqa: E402

if not _CUDA and "Interpreted" not in type(tm._moe_gate_up_kernel).__name__:  # decorated before the variable was set
    importlib.reload(tm)

interpreted = pytest.mark.skipif(_CUDA, reason="CUDA is present: the cuda tests check the compiled kernels")


def _problem(tokens, experts, top_k, hidden, inter, dtype, device="cpu", seed=0, idle=()):
    """Random x, stacked weights and routing (softmax top-k of random logits; `idle` experts never chosen)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=g) / inter**0.5
    logits = torch.randn(tokens, experts, generator=g) * 3
    if idle:
        logits[:, list(idle)] = float("-inf")
    weights, ids = select_experts(logits.to(dtype), top_k, renormalize=True, weights_in_fp32=False)
    to = dict(device=device, dtype=dtype)
    return x.to(**to), w13.to(**to), w2.to(**to), weights.to(device), ids.to(device)


def _check(args, dtype):
    expected = torch_experts(*args)
    got = tm.triton_experts(*args)
    assert got.shape == expected.shape and got.dtype == expected.dtype
    if not expected.numel():
        return
    assert torch.isfinite(got).all()
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # rounding of the model dtype: a few units in the last place of the outputs' scale
        err = ((got.double() - expected.double()).norm() / expected.double().norm()).item()
        assert err < (5e-3 if dtype == torch.bfloat16 else 1e-3), err


@interpreted
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter,idle", [
    (1, 8, 2, 64, 32, ()),  # decode of one sequence (16-row blocks)
    (37, 6, 1, 96, 80, (1, 4)),  # top-1; six experts, two idle; widths not multiples of the blocks
    (150, 5, 2, 72, 40, (3,)),  # two 64-row blocks for each busy expert
    (30, 40, 8, 48, 24, tuple(range(8, 40))),  # top-8 of forty, 32 idle: two 16-row blocks for each busy expert
    (20, 12, 8, 48, 24, ()),  # top-8 of twelve: every token in most experts
    (5, 3, 3, 130, 100, ()),  # hidden wider than two K tiles; every expert busy
])
def test_matches_torch_experts_fp32(tokens, experts, top_k, hidden, inter, idle):
    _check(_problem(tokens, experts, top_k, hidden, inter, torch.float32, seed=tokens, idle=idle), torch.float32)


@interpreted
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,top_k", [(1, 8), (29, 2)])
def test_matches_torch_experts_half(dtype, tokens, top_k):
    _check(_problem(tokens, 10, top_k, 80, 48, dtype, seed=tokens + top_k, idle=(7,)), dtype)


@interpreted
def test_no_tokens_and_mixtral_weights_in_fp32():
    x, w13, w2, weights, ids = _problem(0, 4, 2, 32, 16, torch.float32)
    out = tm.triton_experts(x, w13, w2, weights, ids)
    assert out.shape == (0, 32)
    x, w13, w2, _, ids = _problem(9, 4, 2, 32, 16, torch.bfloat16, seed=3)
    logits = torch.randn(9, 4, generator=torch.Generator().manual_seed(4)).bfloat16()
    weights, ids = select_experts(logits, 2, renormalize=True, weights_in_fp32=True)  # Mixtral keeps fp32
    _check((x, w13, w2, weights, ids), torch.bfloat16)


def test_align_by_expert_places_every_pair_once():
    ids = torch.tensor([[2, 0], [2, 4], [0, 2], [4, 4]])  # experts 1 and 3 idle, pairs 6 and 7 both expert 4
    pairs, block_expert, num_padded = tm.align_by_expert(ids, num_experts=5, block_m=4)
    used = int(num_padded)
    assert used == 12  # experts 0, 2, 4 each one block of 4 rows
    assert (pairs[used:] == 8).all()
    real = pairs[:used][pairs[:used] < 8]
    assert sorted(real.tolist()) == list(range(8))
    flat = ids.reshape(-1)
    for b in range(used // 4):
        rows = pairs[4 * b:4 * b + 4]
        rows = rows[rows < 8]
        assert (flat[rows.long()] == block_expert[b]).all()
    assert pairs.numel() == block_expert.numel() * 4 >= 8 + 4 * 3  # the bound: every pair, padding of 4 experts


@interpreted
def test_use_fused_kernels_switches_the_experts():
    from kvgate.engine.models.layers import use_fused_kernels
    from kvgate.engine.models.moe import FusedMoE

    layer = torch.nn.ModuleDict({"moe": FusedMoE(4, 2, 16, 8, renormalize=True, weights_in_fp32=False)})
    assert layer["moe"].experts_fn is torch_experts
    use_fused_kernels(layer)
    assert layer["moe"].experts_fn.__name__ == "triton_experts"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", [
    (1, 128, 8, 2048, 768),  # a Qwen3-30B-A3B layer at decode
    (300, 60, 4, 1000, 136),  # prefill; sizes off the blocks
    (0, 8, 2, 64, 32),
])
@pytest.mark.cuda
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
def test_compiled_matches_torch_experts(dtype, tokens, experts, top_k, hidden, inter):
    args = _problem(tokens, experts, top_k, hidden, inter, dtype, device="cuda", seed=tokens)
    _check(args, dtype)
    graph_args = [a.clone() for a in args]  # captured into a CUDA graph: nothing reads back to the host
    tm.triton_experts(*graph_args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tm.triton_experts(*graph_args)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, tm.triton_experts(*args))


@interpreted
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_engine_on_triton_path_matches_hf(family, tiny_model_dir):
    """The engine's Triton path (padded graph shapes, fused kernels) on a tiny MoE model: HF's greedy tokens."""
    from kvgate.engine import LLM, SamplingParams
    from kvgate.engine.models.moe import FusedMoE
    from tests.engine.tiny_models import hf_greedy, random_tokens

    folder, model = tiny_model_dir(family)
    prompts = [random_tokens(n, seed=n) for n in (1, 5, 17, 40)]
    expected = hf_greedy(model, prompts, 6)
    llm = LLM(str(folder), max_model_len=128, attention_backend="triton", max_num_seqs=4)
    experts = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert experts and all(m.experts_fn is tm.triton_experts for m in experts)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == expected


def test_bench_moe_preset_builds_a_loadable_checkpoint(tmp_path, monkeypatch):
    """`kvgate bench engine --model qwen3-moe-tiny`'s builder, scaled down: HF writes the per-expert checkpoint
    the loader reads, and --compare-moe-reference's switch puts every layer back on torch_experts."""
    from kvgate.bench import engine as bench
    from kvgate.engine import LLM
    from kvgate.engine.models.moe import FusedMoE

    cls, kwargs = bench.RANDOM_MODELS["qwen3-moe-tiny"]
    small = dict(kwargs, vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                 num_experts=6, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    monkeypatch.setitem(bench.RANDOM_MODELS, "qwen3-moe-tiny", (cls, small))
    bench._build_random_model("qwen3-moe-tiny", tmp_path, torch.float32)
    llm = LLM(str(tmp_path), max_model_len=64, max_num_seqs=2)
    layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 2 and layers[0].w13_weight.shape == (6, 64, 64)
    assert bench._moe_experts(llm.engine.runner) == "torch_experts"  # the CPU path
    for layer in layers:
        layer.experts_fn = lambda *a: None
    assert bench._use_torch_experts(llm.engine) == 2 and all(m.experts_fn is torch_experts for m in layers)
