"""The GPU path of quantized checkpoints (engine/quantization/linear.py, kernel_layout.py): each format's weights
converted to the Triton kernels' layout give back the format's own dequantization exactly (fp32); a fused
QuantizedLinear (shards of different layouts, act-order permutations, per-tensor FP8 scales per shard, a shard
without a kernel layout) computes x @ W^T + b; and the engine with the kernel path forced on the CPU (the kernels
under Triton's interpreter) generates token-identical greedy outputs to the dequantize-at-load path. The `cuda`
test runs the same comparison with the compiled kernels on a GPU (skipped without CUDA)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

_CUDA = torch.cuda.is_available()
if not _CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (by the kernels' module below)
pytest.importorskip("triton")

from kvgate.engine import triton_moe, triton_quant as tq  # noqa: E402
from kvgate.engine.quantization import dequantize_weights, plan_modules  # noqa: E402
from kvgate.engine.quantization.config import parse_quant_config  # noqa: E402
from kvgate.engine.quantization.kernel_layout import NoKernelLayout  # noqa: E402
from kvgate.engine.quantization.linear import QuantizedLinear  # noqa: E402
from tests.engine.quant_checkpoints import AWQ_PACK_ORDER, GROUP, ct_qparams, pack_columns, pack_rows  # noqa: E402
from tests.engine.test_quantization import CT_CASES  # noqa: E402

if not _CUDA and "Interpreted" not in type(tq._weight_gemm_kernel).__name__:  # decorated before the variable was set
    importlib.reload(triton_moe)
    importlib.reload(tq)

PREFIX = "model.layers.0.mlp.up_proj"


def scheme_of(qc: dict, tensors: dict[str, torch.Tensor], prefix: str = PREFIX):
    named = {f"{prefix}.{k}": v for k, v in tensors.items()}
    return plan_modules(named, parse_quant_config(qc))[prefix].scheme


def assert_layout_exact(qc: dict, tensors: dict[str, torch.Tensor]):
    scheme = scheme_of(qc, tensors)
    layout = scheme.to_kernel_layout(PREFIX, tensors)
    named = {f"{PREFIX}.{k}": v for k, v in tensors.items()}
    dense = dict(dequantize_weights(named.items(), parse_quant_config(qc), torch.float32, named))[f"{PREFIX}.weight"]
    assert torch.equal(layout.dequantize(), dense)
    return layout


# -- the layout conversion: exact, every format and configuration of test_quantization.py ----------------------

def fp8_tensors(shape, block, suffix="weight_scale_inv", seed=0):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(shape, generator=g) * 100).to(torch.float8_e4m3fn)
    grid = (1,) if block is None else (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    return {"weight": weight, suffix: torch.rand(grid, generator=g) + 0.01}


@pytest.mark.parametrize("shape,block", [((48, 64), [16, 16]), ((50, 70), [16, 32]), ((40, 24), None)])
def test_fp8_layout(shape, block):
    layout = assert_layout_exact({"quant_method": "fp8", "weight_block_size": block}, fp8_tensors(shape, block))
    assert (layout.kind, layout.block) == ("fp8", None if block is None else tuple(block))


def test_fp8_per_tensor_weight_scale_as_vllm_writes_it():
    tensors = {"weight": (torch.randn(16, 32) * 10).to(torch.float8_e4m3fn), "weight_scale": torch.tensor(0.25),
               "input_scale": torch.tensor(0.5)}
    layout = assert_layout_exact({"quant_method": "fp8", "activation_scheme": "static"}, tensors)
    assert layout.scales.shape == (16,)  # per row: a fused projection's shards concatenate exactly


def ct_stored(case: str):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    bits, kind, strategy, symmetric, fmt, group = CT_CASES[case]
    block = group if strategy == "block" else None
    group = None if strategy == "block" else group
    args = QuantizationArgs(num_bits=bits, type=kind, strategy=strategy, symmetric=symmetric, group_size=group,
                            block_structure=block)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    torch.manual_seed(2)
    weight = torch.randn(36, 80) + 0.3
    scale, zero = ct_qparams(weight, args)
    stored = BaseCompressor.get_value_from_registry(fmt).compress(
        {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}, scheme)
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt,
                            quantization_status="compressed").model_dump(mode="json")
    qc["quant_method"] = "compressed-tensors"
    return qc, stored


@pytest.mark.parametrize("case", list(CT_CASES))
def test_compressed_tensors_layout(case):
    pytest.importorskip("compressed_tensors")
    assert_layout_exact(*ct_stored(case))


def test_awq_layout():
    q = torch.randint(0, 16, (64, 48), dtype=torch.int32)  # [K, N]
    zeros = torch.randint(0, 16, (64 // GROUP, 48), dtype=torch.int32)
    tensors = {"qweight": pack_columns(q, 4, AWQ_PACK_ORDER), "qzeros": pack_columns(zeros, 4, AWQ_PACK_ORDER),
               "scales": (torch.rand(64 // GROUP, 48) + 0.01).half()}
    layout = assert_layout_exact({"quant_method": "awq", "bits": 4, "group_size": GROUP}, tensors)
    assert (layout.bits, layout.group_size, layout.zeros is not None) == (4, GROUP, True)


def gptq_stored(bits, fmt, act_order, k=64, n=32, group=16, seed=4):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2 ** bits, (k, n), dtype=torch.int32, generator=g)
    zeros = torch.randint(0 if fmt == "gptq_v2" else 1, 2 ** bits, (k // group, n), dtype=torch.int32, generator=g)
    g_idx = torch.randperm(k, generator=g) // group if act_order else torch.arange(k) // group
    tensors = {"qweight": pack_rows(q, bits), "qzeros": pack_columns(zeros - (1 if fmt == "gptq" else 0), bits),
               "scales": (torch.rand(k // group, n, generator=g) + 0.01).half()}
    if act_order:
        tensors["g_idx"] = g_idx.to(torch.int32)
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": False,
          "checkpoint_format": fmt}
    return qc, tensors


@pytest.mark.parametrize("bits,fmt,act_order", [(4, "gptq", True), (8, "gptq", False), (4, "gptq_v2", False)])
def test_gptq_layout(bits, fmt, act_order):
    layout = assert_layout_exact(*gptq_stored(bits, fmt, act_order))
    assert (layout.perm is not None) == act_order


def test_gptq_v1_zero_point_256_is_kept_wide():
    qc, tensors = gptq_stored(8, "gptq", False)
    tensors["qzeros"] = torch.full_like(tensors["qzeros"], -1)  # every stored 255: zero point 256
    assert assert_layout_exact(qc, tensors).zeros.dtype == torch.int16


def test_act_order_groups_of_unequal_sizes_have_no_kernel_layout():
    qc, tensors = gptq_stored(4, "gptq", True)
    g_idx = tensors["g_idx"].clone()
    g_idx[g_idx == 1] = 0  # group 0 twice its size, group 1 empty
    tensors["g_idx"] = g_idx
    with pytest.raises(NoKernelLayout, match="unequal sizes"):
        scheme_of(qc, tensors).to_kernel_layout(PREFIX, tensors)


# -- QuantizedLinear: a fused projection's shards -------------------------------------------------------------

def fused_linear(parts, bias=True):
    """A QuantizedLinear over `parts` [(qc, tensors)] as the stream fills one, and the dense W and b it holds."""
    schemes = [scheme_of(qc, t) for qc, t in parts]
    rows = [s.dense_shape(PREFIX, t)[0] for s, (_, t) in zip(schemes, parts)]
    k = schemes[0].dense_shape(PREFIX, parts[0][1])[1]
    starts = [sum(rows[:i]) for i in range(len(rows))]
    b = torch.nn.Parameter(torch.randn(sum(rows))) if bias else None
    layer = QuantizedLinear(k, sum(rows), [(i, slice(s, s + r)) for i, (s, r) in enumerate(zip(starts, rows))], b,
                            torch.float32, torch.device("cpu"))
    reasons = [layer.set_shard(i, s, PREFIX, t) for i, (s, (_, t)) in enumerate(zip(schemes, parts))]
    dense = torch.cat([s.dequantize(PREFIX, t, torch.float32) for s, (_, t) in zip(schemes, parts)])
    return layer, dense, b, reasons


@pytest.mark.parametrize("case", ["fp8-per-tensor", "fp8-block-partial", "gptq-act-order", "int-block-refused"])
def test_fused_quantized_linear(case):
    fp8 = {"quant_method": "fp8", "weight_block_size": None}
    if case == "fp8-per-tensor":  # each shard its own scale: one GEMM with per-row scales
        parts = [(fp8, fp8_tensors((n, 64), None, seed=n)) for n in (32, 16, 16)]
        kinds = ["fp8"]
    elif case == "fp8-block-partial":  # 40 rows end inside a 16-row block: two GEMMs
        block = {"quant_method": "fp8", "weight_block_size": [16, 32]}
        parts = [(block, fp8_tensors((n, 64), [16, 32], seed=n)) for n in (40, 40)]
        kinds = ["fp8", "fp8"]
    elif case == "gptq-act-order":  # two permutations of the inputs: two GEMMs; the same one's shards merge
        parts = [gptq_stored(4, "gptq", True, seed=s) for s in (1, 2)] + [gptq_stored(4, "gptq", False, seed=3)]
        parts.append(gptq_stored(4, "gptq_v2", False, seed=5))
        kinds = ["int", "int", "int"]
    else:  # int blocks of 32 do not divide 80 inputs: that shard dense, its neighbour on the kernel
        pytest.importorskip("compressed_tensors")
        CT_CASES["int8-block"] = (8, "int", "block", False, "int-quantized", [16, 32])
        try:
            parts = [ct_stored("int8-block"), ct_stored("int8-channel-asym")]
        finally:
            del CT_CASES["int8-block"]
        kinds = ["dense", "int"]
    layer, dense, b, reasons = fused_linear(parts)
    assert [kind for kind, _ in layer.parts] == kinds
    assert reasons.count(None) == len(parts) - kinds.count("dense")
    x = torch.randn(3, 5, dense.shape[1])
    want = F.linear(x, dense, b)
    assert (layer(x) - want).abs().max() <= 1e-5 * want.abs().max()  # fp32, the sums in another order


def test_a_shard_of_the_wrong_shape_is_a_load_error():
    from kvgate.common.errors import ModelLoadError

    qc, tensors = gptq_stored(4, "gptq_v2", False, n=32)
    layer = QuantizedLinear(64, 48, [("q", slice(0, 16)), ("k", slice(16, 48))], None, torch.float32,
                            torch.device("cpu"))
    with pytest.raises(ModelLoadError, match=r"up_proj.weight has shape \(32, 64\), expected \(16, 64\)"):
        layer.set_shard(0, scheme_of(qc, tensors), PREFIX, tensors)


def test_routing_leaves_experts_and_partly_dense_projections_dense(tiny_model_dir, tmp_path):
    """A MoE model's checkpoint: its attention projections routed to QuantizedLinears, its experts dense, and a
    fused projection with one dense shard (k_proj's scale removed: a dense k_proj) left an nn.Linear."""
    from kvgate.engine.loader import build_model, load_hf_config, open_safetensors
    from kvgate.engine.quantization.config import quant_config_from_hf
    from kvgate.engine.quantization.linear import route_kernel_linears
    from tests.engine.quant_checkpoints import write_quantized

    dense, _ = tiny_model_dir("qwen3_moe")
    write_quantized(dense, tmp_path, "fp8")
    hf = load_hf_config(tmp_path)
    names = {n for f in open_safetensors(tmp_path, map_data=False) for n in f.entries}
    names.discard("model.layers.1.self_attn.k_proj.weight_scale_inv")
    plan = plan_modules(names, quant_config_from_hf(hf))
    model = build_model(hf, torch.device("meta"), torch.float32, 64)
    routes, dense_reasons = route_kernel_linears(model, plan, torch.float32, torch.device("cpu"))
    experts = sum(".experts." in p for p in plan)
    assert experts and dense_reasons == {"MoE experts": experts, "a fused projection with dense shards": 2}
    assert len(routes) == len(plan) - experts - 2
    layers = model.model.layers
    assert type(layers[1].self_attn.qkv_proj) is torch.nn.Linear
    assert isinstance(layers[1].self_attn.o_proj, QuantizedLinear)
    assert isinstance(layers[0].self_attn.qkv_proj, QuantizedLinear)
    assert not any(isinstance(m, QuantizedLinear) for m in layers[1].mlp.modules())

# -- the engine: kernel path vs dequantize-at-load --------------------------------------------------------------

ENGINE_FORMATS = ("gptq", "ct-w8a16-asym", "fp8")  # int4 act-order, int8 asymmetric per-channel, FP8 block-wise
ENGINE_MODES = {"no-prefix-caching": dict(enable_prefix_caching=False),
                "chunked-prefill": dict(max_num_batched_tokens=16)}
PROMPTS = [[5, 17, 99, 3, 250, 41, 7], [200, 1, 64, 64, 8, 13, 77, 90, 31, 2, 150, 9, 33, 21, 18, 4, 260, 11]]
MAX_NEW = 6


@pytest.fixture(scope="module")
def quantized_llama(tiny_model_dir, tmp_path_factory):
    from tests.engine.quant_checkpoints import write_quantized

    cache = {}

    def get(fmt: str):
        if fmt not in cache:
            if fmt.startswith("ct-"):
                pytest.importorskip("compressed_tensors")
            dense, _ = tiny_model_dir("llama")
            out = tmp_path_factory.mktemp(f"llama-{fmt}")
            write_quantized(dense, out, fmt)
            cache[fmt] = out
        return cache[fmt]

    return get


def greedy(folder, kernels: bool, monkeypatch, device: str = "cpu", **mode):
    """(token ids per prompt, the engine's QuantSummary, its held weight bytes)."""
    from kvgate.bench.engine_roofline import weight_bytes
    from kvgate.engine import LLM, SamplingParams

    monkeypatch.setattr("kvgate.engine.quantization.linear.FORCE_ON_CPU", kernels)
    extra = {} if device == "cpu" else {"attention_backend": "triton" if kernels else "sdpa", "enforce_eager": True}
    llm = LLM(str(folder), max_model_len=64, dtype="float32", **extra, **mode)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)
        return ([o.outputs[0].token_ids for o in outs], llm.engine.quantization,
                weight_bytes(llm.engine.runner.model).total)
    finally:
        llm.engine.close()


@pytest.mark.slow  # the kernels under Triton's interpreter
@pytest.mark.skipif(_CUDA, reason="CUDA is present: the cuda test checks the compiled kernels")
@pytest.mark.parametrize("mode", list(ENGINE_MODES))
@pytest.mark.parametrize("fmt", ENGINE_FORMATS)
def test_kernel_path_generates_what_the_dequantized_path_does(fmt, mode, quantized_llama, monkeypatch):
    folder = quantized_llama(fmt)
    want, dense_summary, dense_bytes = greedy(folder, False, monkeypatch, **ENGINE_MODES[mode])
    got, summary, held = greedy(folder, True, monkeypatch, **ENGINE_MODES[mode])
    assert got == want
    assert dense_summary.kernels is None
    # 2 layers x 7 projections, all on the kernels (q|k|v and gate|up fused)
    assert (summary.quantized, summary.kernels, summary.dequantized) == (14, 14, {})
    assert "14 on the quantized kernels, 0 dequantized at load" in summary.line()
    assert held < dense_bytes * (0.75 if fmt != "gptq" else 0.6)  # the projections at 1 byte (or half) of 4


@pytest.mark.cuda
@pytest.mark.skipif(not _CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ENGINE_FORMATS)
def test_kernel_path_on_cuda(fmt, quantized_llama, monkeypatch):
    """The compiled kernels (attention_backend triton: the GPU path) against SDPA with dense weights, fp32."""
    folder = quantized_llama(fmt)
    want, _, _ = greedy(folder, False, monkeypatch, device="cuda")
    got, summary, _ = greedy(folder, True, monkeypatch, device="cuda")
    assert summary.kernels == 14
    assert got == want
