"""The Triton paged-attention kernels on CPU, under Triton's interpreter: against a float64 reference on every
mode of the step (decode, prefill, chunk over a cached prefix, GQA, non-power-of-two head groups, sliding window,
block boundaries, graph padding), and the whole engine on the Triton path — padded to captured-graph shapes over
the persistent step buffers, and eager — token-identical with HF transformers. The CUDA tests (test_cuda.py) run
the same kernels compiled."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if torch.cuda.is_available():  # the interpreter would take over the compiled kernels of a GPU run
    pytest.skip("CUDA is present: test_cuda.py checks the compiled kernels", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the kernels' module below)
pytest.importorskip("triton")

from kvgate.engine import LLM, SamplingParams  # noqa: E402
from kvgate.engine import triton_attention as ta  # noqa: E402
from kvgate.engine.cuda_graphs import decode_sizes, mixed_sizes, pick_size  # noqa: E402
from tests.engine.paged_reference import (  # noqa: E402
    DECODE_SEQS, MIXED_SEQS, attend as _attend, random_paged_batch, reference_attention)

if "Interpreted" not in type(ta._paged_attention_kernel).__name__:  # decorated before the variable was set
    importlib.reload(ta)
assert "Interpreted" in type(ta._paged_attention_kernel).__name__


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window,dtype", [
    (4, 2, 32, 16, None, torch.float32),  # GQA
    (4, 4, 16, 4, None, torch.float32),  # MHA, small blocks: many blocks per tile
    (6, 2, 24, 16, 5, torch.float32),  # three query heads a KV head, head_dim not a power of two, window
    (8, 1, 64, 8, 40, torch.float16),  # MQA, half precision, a window wider than some contexts
])
@pytest.mark.parametrize("seqs,decode_only", [(MIXED_SEQS, False), (MIXED_SEQS, "split"), (DECODE_SEQS, True),
                                              (DECODE_SEQS, False)])
def test_kernel_matches_reference(heads, kv_heads, head_dim, block_size, window, dtype, seqs, decode_only):
    q, cache, table, lens, starts = random_paged_batch(seqs, heads, kv_heads, head_dim, block_size, dtype, "cpu",
                                                       seed=heads + block_size, padded_tokens=5, padded_seqs=3)
    total = int(starts[len(seqs)])
    out = torch.full_like(q, float("nan"))  # every real row must be written
    _attend(ta, q, cache, out, table, lens, starts, head_dim, block_size, window, decode_only)
    ref = reference_attention(q, cache, table, lens, starts, head_dim**-0.5, block_size, window)
    got = out[:total].double()
    assert not got.isnan().any()
    err = ((got - ref[:total]).norm() / ref[:total].norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 2e-3), err


def test_store_skips_padding_slots():
    k, v = torch.randn(5, 2, 32), torch.randn(5, 2, 32)
    cache = torch.zeros(2, 2, 64, 32)
    slots = torch.tensor([3, -1, 10, 63, 0])
    ta.store_kv(k, v, cache, slots)
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            assert torch.equal(cache[0][:, s], k[i]) and torch.equal(cache[1][:, s], v[i])
    written = cache.abs().sum(dim=(0, 1, 3)).nonzero().flatten().tolist()
    assert written == [0, 3, 10, 63]


KV_SPECS = ["int8", "fp8_e4m3", "fp8_e5m2"]


def _quantized(cache: torch.Tensor, name: str):
    """A float cache [2, Hkv, S, D] quantized with kv_quant.py's torch arithmetic, and what it dequantizes to."""
    from kvgate.engine.kv_quant import QuantizedKVCache, dequantize, kv_quant_spec, quantize

    spec = kv_quant_spec(name)
    values, scales = quantize(cache, spec)
    return QuantizedKVCache(values, scales, spec), dequantize(values, scales, spec, torch.float32)


@pytest.mark.parametrize("name", KV_SPECS)
def test_quantized_store_matches_torch(name):
    """The store kernel's quantization is kv_quant.quantize's, value for value and scale for scale, across
    magnitudes (fp8 subnormals and roundings that carry into the exponent included), head_dim not a power of 2."""
    from kvgate.engine.kv_quant import QuantizedKVCache, kv_quant_spec

    gen = torch.Generator().manual_seed(7)
    k = torch.randn(40, 2, 24, generator=gen) * torch.logspace(-4, 4, 40)[:, None, None]
    v = torch.randn(40, 2, 24, generator=gen)
    k[3] = 0.0
    slots = torch.randperm(64, generator=gen)[:40]
    slots[5] = -1  # a graph's padding token: nothing written
    spec = kv_quant_spec(name)
    cache = QuantizedKVCache.allocate((2, 2, 64, 24), spec, torch.device("cpu"))
    ta.store_kv(k, v, cache, slots)
    want, _ = _quantized(torch.stack([k, v]).transpose(1, 2), name)  # [2, Hkv, T, D]: token t at column t
    ok = slots >= 0
    for i in range(2):
        assert torch.equal(cache.scales[i][:, slots[ok]], want.scales[i][:, ok])
        got = cache.values()[i][:, slots[ok]].float()
        assert torch.equal(got, want.values()[i][:, ok].float())  # as values: fp8 has two zeros
    written = (cache.scales[0] != 0).any(0).nonzero().flatten().sort().values
    assert torch.equal(written, slots[ok].sort().values)


@pytest.mark.parametrize("name", KV_SPECS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,window,dtype", [
    (4, 2, 32, 16, None, torch.float32),
    (6, 2, 24, 16, 5, torch.float32),
    (8, 1, 64, 8, 40, torch.float16),
])
@pytest.mark.parametrize("seqs,decode_only", [(MIXED_SEQS, "split"), (DECODE_SEQS, True)])
def test_kernel_dequantizes_inside(name, heads, kv_heads, head_dim, block_size, window, dtype, seqs, decode_only):
    """The attention kernel over a quantized cache equals the float64 reference over what that cache
    dequantizes to: the kernel loads int8/fp8 values and scales and dequantizes them as it reads."""
    q, cache, table, lens, starts = random_paged_batch(seqs, heads, kv_heads, head_dim, block_size, torch.float32,
                                                       "cpu", seed=heads + block_size, padded_tokens=5, padded_seqs=3)
    q = q.to(dtype)
    quantized, dequantized = _quantized(cache * 3.0, name)
    total = int(starts[len(seqs)])
    out = torch.full_like(q, float("nan"))
    _attend(ta, q, quantized, out, table, lens, starts, head_dim, block_size, window, decode_only)
    ref = reference_attention(q, dequantized.to(dtype), table, lens, starts, head_dim**-0.5, block_size, window)
    got = out[:total].double()
    assert not got.isnan().any()
    err = ((got - ref[:total]).norm() / ref[:total].norm()).item()
    assert err < (1e-6 if dtype == torch.float32 else 2e-3), err


@pytest.mark.slow
def test_engine_triton_int8_matches_torch_int8(tiny_model_dir):
    """The whole engine with an int8 cache: the Triton path (store kernel, graph-padded steps, prefix-cache hits
    read through the block tables) gives the SDPA path's tokens, and logprobs within float32 rounding. (fp8 runs
    the same code with another QMAX and rounding, checked above at the kernel level: its engine run takes 23 s.)"""
    folder, _ = tiny_model_dir("llama")
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    short = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, logprobs=0)
    runs = {}
    for backend in ("sdpa", "triton"):
        llm = LLM(str(folder), max_model_len=128, attention_backend=backend, kv_cache_dtype="int8", max_num_seqs=10)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], short)  # chunks over cached prefixes
        assert sum(o.num_cached_tokens for o in again) > 0
        runs[backend] = [[(t, lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                         for o in outs + again]
    for sdpa, triton_ in zip(runs["sdpa"], runs["triton"]):
        assert [t for t, _ in sdpa] == [t for t, _ in triton_]
        assert max(abs(a - b) for (_, a), (_, b) in zip(sdpa, triton_)) < 1e-4


def test_graph_sizes():
    assert decode_sizes(256)[:5] == [1, 2, 4, 8, 16] and decode_sizes(256)[-1] == 256
    assert decode_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert mixed_sizes(1024)[-1] == 1024 and 512 in mixed_sizes(1024) and mixed_sizes(16) == [16]
    assert pick_size([1, 2, 4, 8], 3) == 4 and pick_size([1, 2], 3) is None


PROMPT_LENGTHS = [3, 7, 15, 16, 17, 33, 48, 5, 40]
# max_num_seqs 10 (more than the prompts): the padded grids stay small, which the interpreter runs one by one.
CASES = {  # name -> (family, engine arguments)
    "llama-prefix-caching": ("llama", dict(max_num_seqs=10)),
    "qwen3-chunked-prefill": ("qwen3", dict(max_num_batched_tokens=16, max_num_seqs=10)),
    "qwen2-preemption": ("qwen2", dict(num_gpu_blocks_override=12, max_num_seqs=10)),
    "qwen3-eager": ("qwen3", dict(enforce_eager=True, max_num_seqs=10)),
    # the transformers fallback (HF modules calling the kernels through its attention function), padded shapes
    "phi3-fallback": ("phi3", dict(max_num_seqs=10)),
}


def _prompts():
    from tests.engine.tiny_models import random_tokens

    shared = random_tokens(32, seed=99)  # two prompts share a two-block prefix: a chunk over a cached prefix
    prompts = [random_tokens(n, seed=n) for n in PROMPT_LENGTHS]
    prompts[6] = shared + prompts[6][:16]
    prompts[8] = shared + prompts[8][:8]
    return prompts


def _hf_greedy(model, prompts, n):
    from tests.engine.tiny_models import hf_greedy

    return hf_greedy(model, prompts, n)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_engine_on_triton_path_matches_hf(case, tiny_model_dir):
    family, engine_args = CASES[case]
    folder, model = tiny_model_dir(family)
    prompts = _prompts()
    expected = _hf_greedy(model, prompts, 8)
    llm = LLM(str(folder), max_model_len=128, attention_backend="triton", **engine_args)
    runner = llm.engine.runner
    assert runner.attention_backend == "triton"
    assert (runner.shapes is None) == bool(engine_args.get("enforce_eager"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == expected
    if case == "llama-prefix-caching":  # the second pass reads the cached prefixes through the block tables
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        assert [o.outputs[0].token_ids for o in again] == expected
        assert sum(o.num_cached_tokens for o in again) > 0
    if case == "qwen2-preemption":
        assert llm.engine.stats().num_preemptions > 0


@pytest.mark.slow
def test_per_layer_windows_on_triton_path_match_hf(tmp_path):
    """Sliding windows on the Triton path: Qwen2 with max_window_layers 1 (layer 0 full attention, layers 1-2 a
    20-token window), each layer's window a constant of its own kernel launch (the padded graph-shape path), over
    prompts longer than the window, in chunks over a cached prefix (Mistral's one window for all layers reads into
    the same per-layer windows: test_hf_parity.py)."""
    from tests.engine.tiny_models import build_tiny_model, sliding_qwen_config

    model = build_tiny_model("qwen2", tmp_path, seed=5, config=sliding_qwen_config("qwen2", 20))
    prompts = [p for p in _prompts() if len(p) > 20][:2] + [_prompts()[0]]
    expected = _hf_greedy(model, prompts, 6)
    llm = LLM(str(tmp_path), max_model_len=128, attention_backend="triton", max_num_batched_tokens=32,
              max_num_seqs=8)
    assert llm.engine.runner.layer_windows == [None, 20, 20] and llm.engine.runner.shapes is not None
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert got == expected


@pytest.mark.slow
def test_triton_on_cpu_needs_the_interpreter(monkeypatch, tiny_model_dir):
    from kvgate.common.errors import ConfigError

    monkeypatch.delenv("TRITON_INTERPRET")
    folder, _ = tiny_model_dir("llama")
    with pytest.raises(ConfigError, match="TRITON_INTERPRET"):
        LLM(str(folder), max_model_len=128, attention_backend="triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_ops_match_the_torch_layers(dtype):
    """triton_ops against layers.py's torch ops (HF's arithmetic), rounding step for step."""
    from transformers import LlamaConfig

    from kvgate.engine import triton_ops
    from kvgate.engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding

    torch.manual_seed(0)
    tol = 1e-6 if dtype == torch.float32 else 1e-3  # fp32: sums in another order
    norm = RMSNorm(48, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(7, 48).to(dtype)
    torch.testing.assert_close(triton_ops.rms_norm(x, norm.weight, 1e-6), norm(x), atol=tol, rtol=tol)
    heads = torch.randn(5, 96 + 16).to(dtype)[:, :96].view(5, 3, 32)  # a strided per-head view, as q_norm gets
    head_norm = RMSNorm(32, 1e-5).to(dtype)
    torch.testing.assert_close(triton_ops.rms_norm(heads, head_norm.weight, 1e-5), head_norm(heads), atol=tol,
                               rtol=tol)
    for partial in (1.0, 0.5):
        config = LlamaConfig(hidden_size=128, num_attention_heads=4, partial_rotary_factor=partial,
                             rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                              "original_max_position_embeddings": 64})
        rotary = RotaryEmbedding(config, 32, 256)
        q = torch.randn(6, 4 * 32 + 64).to(dtype)[:, :128].view(6, 4, 32)
        k = torch.randn(6, 2, 32).to(dtype)
        pos = torch.tensor([0, 1, 5, 63, 64, 255])
        want_q, want_k = rotary(pos, q, k)
        got_q, got_k = triton_ops.rope(pos, q, k, rotary.cos, rotary.sin, rotary.rotary_dim)
        torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
        torch.testing.assert_close(got_k, want_k, atol=tol, rtol=tol)
    mlp = GatedMLP(16, 40)
    gate_up = torch.randn(3, 80).to(dtype)
    gate, up = gate_up.split(40, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(triton_ops.silu_and_mul(gate_up), want, atol=tol, rtol=tol)
    assert mlp.fused is False


@pytest.mark.slow
def test_speculation_on_triton_path_keeps_greedy_tokens(tiny_model_dir):
    """Speculative decoding through the graph path's padded shapes and static buffers (verification chunks of
    1 + K positions in mixed-step shapes; the CUDA run is test_cuda.py's): n-grams with every step drafting, and the
    target as its own draft (every draft accepted; the draft's forwards through draft_graphs.py's buffers), give HF's
    greedy tokens."""
    from tests.engine.tiny_models import random_tokens

    folder, model = tiny_model_dir("llama")
    prompts = [t + t[:9] for t in (random_tokens(n, seed=n) for n in (40, 61))]
    expected = _hf_greedy(model, prompts, 10)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # 1-grams: a random model's own tokens rarely continue a longer n-gram of the prompt, and drafts must be made
    for name, spec in {"ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                 "prompt_lookup_max": 3},
                       "self-draft": {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3}
                       }.items():
        llm = LLM(str(folder), max_model_len=128, attention_backend="triton", max_num_seqs=2,
                  speculative_config=spec, speculative_backoff_threshold=0.0)
        runner = llm.engine.runner
        assert runner.shapes is not None
        assert name == "ngram" or runner.draft.triton is not None  # the draft through the same kernels and buffers
        got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
        stats = llm.engine.stats().spec_decode
        assert got == expected, name
        assert stats.num_drafts > 0, name
        if name == "self-draft":
            assert stats.num_accepted_tokens == stats.num_draft_tokens > 0


def test_draft_path_padded_decodes_match_hf(tiny_model_dir):
    """draft_graphs.py's buffers: chunks of prompts, then one decode token each — eagerly at the batch's own size,
    and padded to a graph's size as a replay runs it (padding rows store nothing, padding sequences attend nothing)
    — give HF's logits for every row."""
    from kvgate.engine.draft_graphs import DraftTritonPath
    from kvgate.engine.kv_quant import allocate_kv_caches
    from kvgate.engine.loader import load_hf_config, load_model
    from tests.engine.tiny_models import random_tokens

    folder, hf = tiny_model_dir("qwen3")
    config = load_hf_config(folder)
    model = load_model(config, folder, torch.device("cpu"), torch.float32, 128)
    block_size = 16
    kv = allocate_kv_caches(model, config.num_hidden_layers, 12, block_size, torch.float32, None, torch.device("cpu"))
    path = DraftTritonPath(model, 4, 64, 8, block_size, torch.device("cpu"), capture=False)
    prompts = [random_tokens(n, seed=n) for n in (5, 17, 33)]
    tables = [[0], [1, 2], [3, 4, 5]]
    hidden = path.forward([(0, len(p), t) for p, t in zip(prompts, tables)], sum(prompts, []), kv)
    nxt = [7, 8, 9]
    seqs = [(len(p), 1, t) for p, t in zip(prompts, tables)]
    eager = path.forward(seqs, nxt, kv)
    path._fill(seqs, nxt, 4, 4)  # what a replay of the size-4 graph reads
    padded = path._forward_static(4, 4, True, kv)[:3]
    with torch.no_grad():
        want = [hf(torch.tensor([p + [t]])).logits[0, -2:] for p, t in zip(prompts, nxt)]
    ends = torch.tensor([len(p) - 1 for p in prompts]).cumsum(0) + torch.arange(3)
    for i in range(3):
        assert torch.allclose(model.compute_logits(hidden[ends[i]:ends[i] + 1])[0], want[i][0], atol=1e-4)
        for rows in (eager, padded):
            assert torch.allclose(model.compute_logits(rows[i:i + 1])[0], want[i][1], atol=1e-4)
