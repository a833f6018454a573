"""Quantized checkpoints (engine/quantization): each format's dequantization against the format's own library on
random tensors, the weight stream's grouping, the checks of hostile tensors and configs, and a quantized model's
load (its start line, its weight bytes, --quantization)."""

from __future__ import annotations

import json
import logging
import random

import pytest
import torch

from kvgate.common.errors import ConfigError, ModelLoadError
from kvgate.engine.quantization import QuantSummary, dequantize_weights
from kvgate.engine.quantization.config import parse_quant_config, quant_config_from_hf
from tests.engine.quant_checkpoints import (AWQ_PACK_ORDER, GROUP, ct_qparams, pack_columns, pack_rows,
                                            write_quantized)


def dequantize(qc: dict, tensors: dict[str, torch.Tensor], prefix: str = "model.layers.0.mlp.up_proj"):
    """The dense weight the stream makes of one module's tensors under quantization_config `qc`."""
    config = parse_quant_config(qc)
    named = {f"{prefix}.{k}": v for k, v in tensors.items()}
    out = dict(dequantize_weights(named.items(), config, torch.float32, named))
    return out[f"{prefix}.weight"]


@pytest.fixture(params=["one-chunk", "row-chunks"])
def chunks(request, monkeypatch):
    """Dequantize whole, or a few output rows at a time (the rows sharing a packed word or a scale block)."""
    if request.param == "row-chunks":
        monkeypatch.setattr("kvgate.engine.quantization.scheme.CHUNK_ELEMENTS", 64)


# -- FP8 (transformers' fine-grained FP8) -----------------------------------------------------------------------

@pytest.mark.parametrize("shape,block", [((48, 64), [16, 16]), ((50, 70), [16, 32]), ((40, 24), None)])
def test_fp8_matches_transformers_dequantization(shape, block, chunks):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    torch.manual_seed(0)
    weight = (torch.randn(shape) * 100).to(torch.float8_e4m3fn)
    grid = (1,) if block is None else (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    scale = torch.rand(grid) + 0.01
    ours = dequantize({"quant_method": "fp8", "weight_block_size": block},
                      {"weight": weight, "weight_scale_inv": scale})
    theirs = _dequantize_fp8_weight(weight, scale, block, torch.float32)
    assert torch.equal(ours, theirs)


def test_fp8_quantize_roundtrip_matches_transformers_fp8_dequantize():
    """A weight quantized by transformers' Fp8Quantize op and dequantized by its Fp8Dequantize op (the pair its
    loader runs) gives our dense weight."""
    from types import SimpleNamespace

    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    torch.manual_seed(1)
    config = FineGrainedFP8Config(weight_block_size=[16, 32])
    quantizer = SimpleNamespace(quantization_config=config)
    stored = Fp8Quantize(quantizer).convert({"w.weight": torch.randn(48, 96)})
    ours = dequantize(config.to_dict(), {"weight": stored["w.weight"], "weight_scale_inv": stored["w.weight_scale_inv"]})
    theirs = Fp8Dequantize(quantizer)._dequantize_one(stored["w.weight"], stored["w.weight_scale_inv"],
                                                      torch.float32)
    assert torch.equal(ours, theirs)


def test_fp8_per_tensor_weight_scale_as_vllm_writes_it():
    weight = (torch.randn(16, 32) * 10).to(torch.float8_e4m3fn)
    tensors = {"weight": weight, "weight_scale": torch.tensor(0.25), "input_scale": torch.tensor(0.5)}
    ours = dequantize({"quant_method": "fp8", "activation_scheme": "static"}, tensors)
    assert torch.equal(ours, weight.float() * 0.25)


# -- compressed-tensors --------------------------------------------------------------------------------------------

CT_CASES = {  # name -> (num_bits, type, strategy, symmetric, format, group_size or block_structure)
    "fp8-channel": (8, "float", "channel", True, "float-quantized", None),
    "fp8-tensor": (8, "float", "tensor", True, "float-quantized", None),
    "fp8-block": (8, "float", "block", True, "float-quantized", [16, 32]),  # partial tiles at both edges
    "int8-channel-asym": (8, "int", "channel", False, "int-quantized", None),
    "int4-naive-group": (4, "int", "group", True, "naive-quantized", 16),
    "w4a16-group": (4, "int", "group", True, "pack-quantized", 16),
    "w4a16-group-asym": (4, "int", "group", False, "pack-quantized", 16),
    "w4a16-channel": (4, "int", "channel", True, "pack-quantized", None),
    "w8a16-channel-asym": (8, "int", "channel", False, "pack-quantized", None),
    "w4a16-tensor": (4, "int", "tensor", True, "pack-quantized", None),
}


@pytest.mark.parametrize("case", list(CT_CASES))
def test_compressed_tensors_matches_its_decompression(case, chunks):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme

    bits, kind, strategy, symmetric, fmt, group = CT_CASES[case]
    block = group if strategy == "block" else None
    group = None if strategy == "block" else group
    args = QuantizationArgs(num_bits=bits, type=kind, strategy=strategy, symmetric=symmetric, group_size=group,
                            block_structure=block)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    torch.manual_seed(2)
    weight = torch.randn(36, 80) + 0.3  # 36 outputs: packed zero points pad their last word
    scale, zero = ct_qparams(weight, args)
    compressor = BaseCompressor.get_value_from_registry(fmt)
    stored = compressor.compress({"weight": weight, "weight_scale": scale, "weight_zero_point": zero}, scheme)
    theirs = compressor.decompress(stored, scheme)["weight"]
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt,
                            quantization_status="compressed").model_dump(mode="json")
    qc["quant_method"] = "compressed-tensors"
    assert torch.equal(dequantize(qc, stored), theirs.float())


def test_awq_matches_compressed_tensors_awq_converter(chunks):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.quantization import preset_name_to_scheme

    torch.manual_seed(3)
    k, n = 64, 48
    tensors = {"qweight": torch.randint(-2 ** 31, 2 ** 31 - 1, (k, n // 8), dtype=torch.int32),
               "qzeros": torch.randint(-2 ** 31, 2 ** 31 - 1, (k // GROUP, n // 8), dtype=torch.int32),
               "scales": (torch.rand(k // GROUP, n) + 0.01).half()}
    converted = AutoAWQConverter(bits=4, group_size=GROUP).process({f"m.{k}": v for k, v in tensors.items()})
    local = {key.removeprefix("m."): v for key, v in converted.items()}
    local["weight_scale"] = local["weight_scale"].float()
    scheme = preset_name_to_scheme("W4A16_ASYM", ["Linear"])
    scheme.weights = scheme.weights.model_copy(update={"group_size": GROUP})
    theirs = BaseCompressor.get_value_from_registry("pack-quantized").decompress(local, scheme)["weight"]
    ours = dequantize({"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm",
                       "zero_point": True}, tensors)
    assert torch.equal(ours, theirs)


@pytest.mark.slow  # importing AutoAWQ takes tens of seconds
def test_awq_matches_autoawq(chunks):
    """AutoAWQ's own GEMM packer (WQLinear_GEMM.from_linear, which needs a multiple of 32 outputs) and its
    dequantize_gemm. AutoAWQ (deprecated) installs only without its dependencies (`pip install --no-deps
    --no-build-isolation autoawq`); skipped without it."""
    pytest.importorskip("awq")
    from awq.modules.linear.gemm import WQLinear_GEMM
    from awq.utils.packing_utils import dequantize_gemm

    torch.manual_seed(5)
    linear = torch.nn.Linear(64, 96, bias=False)
    grouped = linear.weight.data.reshape(96, 64 // GROUP, GROUP)
    lo, hi = grouped.amin(-1), grouped.amax(-1)
    scales = ((hi - lo) / 15).half().float()
    zeros = torch.round(-lo / scales).clamp(0, 15)
    packed = WQLinear_GEMM.from_linear(linear, 4, GROUP, scales=scales.t(), zeros=zeros.t())
    tensors = {"qweight": packed.qweight, "qzeros": packed.qzeros, "scales": packed.scales.float()}
    theirs = dequantize_gemm(packed.qweight, packed.qzeros, packed.scales.float(), 4, GROUP).t()  # [K, N] -> [N, K]
    assert torch.equal(dequantize({"quant_method": "awq", "bits": 4, "group_size": GROUP}, tensors), theirs)


def test_awq_unpacks_the_interleaved_order(chunks):
    """A packer written from AutoAWQ's description (outputs [0, 2, 4, 6, 1, 3, 5, 7] in fields 0..7)."""
    q = torch.randint(0, 16, (32, 16), dtype=torch.int32)  # [K, N]
    zeros = torch.randint(0, 16, (2, 16), dtype=torch.int32)
    scales = torch.rand(2, 16) + 0.5
    tensors = {"qweight": pack_columns(q, 4, AWQ_PACK_ORDER), "qzeros": pack_columns(zeros, 4, AWQ_PACK_ORDER),
               "scales": scales}
    expected = ((q - zeros.repeat_interleave(16, 0)).float() * scales.repeat_interleave(16, 0)).t()
    assert torch.equal(dequantize({"quant_method": "awq", "bits": 4, "group_size": 16}, tensors), expected)


# -- GPTQ ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bits,fmt,act_order", [(4, "gptq", True), (8, "gptq", False), (4, "gptq_v2", False)])
def test_gptq_dequantization(bits, fmt, act_order, chunks):
    k, n, group = 64, 32, 16
    torch.manual_seed(4)
    q = torch.randint(0, 2 ** bits, (k, n), dtype=torch.int32)
    zeros = torch.randint(0 if fmt == "gptq_v2" else 1, 2 ** bits, (k // group, n), dtype=torch.int32)
    scales = torch.rand(k // group, n) + 0.01
    g_idx = torch.randperm(k) // group if act_order else torch.arange(k) // group
    stored_zeros = zeros - (1 if fmt == "gptq" else 0)
    tensors = {"qweight": pack_rows(q, bits), "qzeros": pack_columns(stored_zeros, bits), "scales": scales.half()}
    if act_order:
        tensors["g_idx"] = g_idx.to(torch.int32)
    expected = ((q - zeros[g_idx]).float() * scales.half().float()[g_idx]).t()
    qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": False,
          "checkpoint_format": fmt}
    assert torch.equal(dequantize(qc, tensors), expected)


# -- the stream ---------------------------------------------------------------------------------------------------

GPTQ_QC = {"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": False, "sym": True}


def gptq_tensors(k: int = 32, n: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"qweight": torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 8, n), dtype=torch.int32, generator=g),
            "qzeros": torch.randint(-2 ** 31, 2 ** 31 - 1, (k // 16, n // 8), dtype=torch.int32, generator=g),
            "scales": (torch.rand(k // 16, n, generator=g) + 0.01).half()}


def test_stream_groups_tensors_in_any_order_and_passes_the_rest():
    config = parse_quant_config(GPTQ_QC)
    named = {"lm_head.weight": torch.randn(8, 32), "a.bias": torch.randn(16)}
    for layer in range(3):
        named |= {f"l{layer}.proj.{k}": v for k, v in gptq_tensors(seed=layer).items()}
    expected = {f"l{i}.proj.weight": dequantize(GPTQ_QC, gptq_tensors(seed=i), "x") for i in range(3)}
    items = list(named.items())
    random.Random(0).shuffle(items)
    released, summary = [], QuantSummary("gptq")
    out = dict(dequantize_weights(iter(items), config, torch.bfloat16, named, released.append, summary))
    assert set(out) == {"lm_head.weight", "a.bias"} | set(expected)
    for name, weight in expected.items():
        assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], weight.bfloat16())
    assert out["lm_head.weight"] is named["lm_head.weight"]
    assert sorted(released) == sorted(n for n in named if ".proj." in n)
    assert (summary.quantized, summary.dense) == (3, 1)
    assert summary.line() == "gptq (int4 group 16, symmetric): 3 linear weights quantized, 1 dense"


def test_stream_on_meta_yields_the_dense_shape():
    config = parse_quant_config(GPTQ_QC)
    named = {f"p.{k}": torch.empty(v.shape, dtype=v.dtype, device="meta") for k, v in gptq_tensors().items()}
    (name, weight), = dequantize_weights(named.items(), config, torch.float16, named)
    assert name == "p.weight" and weight.device.type == "meta" and weight.shape == (16, 32)


@pytest.mark.parametrize("change,message", [
    (lambda t: t.pop("scales"), "lacks tensor p.scales"),
    (lambda t: t.update(weight=torch.zeros(16, 32)), "p.weight is not read by the gptq scheme"),
])
def test_stream_names_a_missing_or_unread_tensor(change, message):
    tensors = gptq_tensors()
    change(tensors)
    named = {f"p.{k}": v for k, v in tensors.items()}
    with pytest.raises(ModelLoadError, match=message):
        list(dequantize_weights(named.items(), parse_quant_config(GPTQ_QC), torch.float32, named))


def test_stream_names_a_tensor_that_never_arrives():
    named = {f"p.{k}": v for k, v in gptq_tensors().items()}
    stream = [(n, t) for n, t in named.items() if not n.endswith("qzeros")]
    with pytest.raises(ModelLoadError, match="p.qzeros never arrived"):
        list(dequantize_weights(stream, parse_quant_config(GPTQ_QC), torch.float32, named))


def test_quantized_tensors_of_an_ignored_module_are_an_error():
    qc = {"quant_method": "awq", "bits": 4, "group_size": 16, "modules_to_not_convert": ["lm_head"]}
    named = {f"lm_head.{k}": v for k, v in gptq_tensors().items() if k != "g_idx"}
    with pytest.raises(ModelLoadError, match="'lm_head' has quantized tensors, but quantization_config ignores"):
        list(dequantize_weights(named.items(), parse_quant_config(qc), torch.float32, named))


# -- hostile tensors ----------------------------------------------------------------------------------------------

def _fp8_tensors():
    return {"weight": torch.randn(32, 32).to(torch.float8_e4m3fn), "weight_scale_inv": torch.ones(2, 2)}


def _set(tensors, key, value):
    return {**tensors, key: value}


FP8_QC = {"quant_method": "fp8", "weight_block_size": [16, 16]}
W4_QC = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": {
    "targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 16,
                                       "symmetric": True}}}}


def _w4_tensors(k=32):
    return {"weight_packed": torch.zeros(8, k // 8, dtype=torch.int32), "weight_shape": torch.tensor([8, k]),
            "weight_scale": torch.ones(8, k // 16)}


HOSTILE = {
    "nan scale": (FP8_QC, _set(_fp8_tensors(), "weight_scale_inv", torch.tensor([[1.0, float("nan")], [1, 1]])),
                  r"up_proj.weight_scale_inv' has 1 scale\(s\) that are not finite and > 0 \(e.g. nan\)"),
    "inf scale": (GPTQ_QC, _set(gptq_tensors(), "scales", torch.full((2, 16), float("inf")).half()),
                  r"up_proj.scales' has 32 scale\(s\) that are not finite"),
    "negative scale": (W4_QC, _set(_w4_tensors(), "weight_scale", -torch.ones(8, 2)), "not finite and > 0"),
    "zero-sized scale": (FP8_QC, _set(_fp8_tensors(), "weight_scale_inv", torch.ones(0, 2)),
                         r"weight_scale_inv has shape \(0, 2\), expected \(2, 2\)"),
    "fp8 block larger than the weight, scale grid wrong": (
        {"quant_method": "fp8", "weight_block_size": [2 ** 40, 2 ** 40]}, _set(_fp8_tensors(), "weight_scale_inv",
                                                                             torch.ones(2, 2)),
        r"weight_scale_inv has shape \(2, 2\), expected \(1, 1\)"),
    "fp8 weight of another dtype": (FP8_QC, _set(_fp8_tensors(), "weight", torch.zeros(32, 32)),
                                    "up_proj.weight' has dtype float32, expected float8_e4m3fn"),
    "packed of the wrong shape": (W4_QC, _set(_w4_tensors(), "weight_packed", torch.zeros(8, 3, dtype=torch.int32)),
                                  r"weight_packed has shape \(8, 3\), which does not hold a \[8, 32\] weight"),
    "group not dividing K": (W4_QC, _w4_tensors(k=40), "40 input channels, not a multiple of group_size 16"),
    "gptq scales of the wrong shape": (GPTQ_QC, _set(gptq_tensors(), "scales", torch.ones(3, 16).half()),
                                       r"up_proj.scales' has shape \(3, 16\), expected \(2, 16\)"),
    "gptq group not dividing K": ({**GPTQ_QC, "group_size": 24}, gptq_tensors(),
                                  "32 input channels, not a multiple of group_size 24"),
    "g_idx out of range": ({**GPTQ_QC, "desc_act": True},
                           _set(gptq_tensors(), "g_idx", torch.arange(32, dtype=torch.int32)),
                           r"up_proj.g_idx has 30 group indices outside \[0, 2\) \(e.g. 2\)"),
    "g_idx of the wrong length": (GPTQ_QC, _set(gptq_tensors(), "g_idx", torch.zeros(31, dtype=torch.int32)),
                                  r"up_proj.g_idx' has shape \(31,\), expected \(32,\)"),
    "activation-ordered groups": (W4_QC, _set(_w4_tensors(), "weight_g_idx", torch.zeros(32, dtype=torch.int32)),
                                  "up_proj.weight_g_idx is not read by the compressed-tensors scheme"),
    "asymmetric without zero points": (
        {**W4_QC, "config_groups": {"g": {"targets": ["Linear"], "weights": {
            "num_bits": 4, "type": "int", "strategy": "group", "group_size": 16, "symmetric": False}}}},
        _w4_tensors(), "is asymmetric but its checkpoint has no model.layers.0.mlp.up_proj.weight_zero_point"),
    "int4 values out of range": (
        {**W4_QC, "format": "int-quantized"},
        {"weight": torch.full((8, 32), 9, dtype=torch.int8), "weight_scale": torch.ones(8, 2)},
        r"up_proj.weight has values outside the int4 range \[-8, 8\)"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_tensors_are_a_load_error_naming_the_tensor(case):
    qc, tensors, message = HOSTILE[case]
    with pytest.raises(ModelLoadError, match=message):
        dequantize(qc, tensors)


BAD_CONFIGS = {
    "unknown method": ({"quant_method": "bitsandbytes"}, "quantization_config.quant_method is 'bitsandbytes'"),
    "gptq bits 3": ({**GPTQ_QC, "bits": 3}, "quantization_config.bits is 3: supported 4, 8"),
    "gptq dynamic": ({**GPTQ_QC, "dynamic": {"-:.*": {}}}, "quantization_config.dynamic"),
    "awq gemv": ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"},
                 "quantization_config.version is 'gemv'"),
    "fp8 block": ({"quant_method": "fp8", "weight_block_size": [128]}, "quantization_config.weight_block_size"),
    "ct bits 2": ({**W4_QC, "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 2}}}},
                  "config_groups.g.weights.num_bits is 2"),
    "ct format": ({**W4_QC, "format": "marlin-24"}, "quantization_config.format\\) is 'marlin-24'"),
    "ct sparsity": ({**W4_QC, "sparsity_config": {"format": "sparse-bitmask"}}, "quantization_config.sparsity_config"),
    "ct kv cache": ({**W4_QC, "kv_cache_scheme": {"num_bits": 8}}, "quantization_config.kv_cache_scheme"),
}


@pytest.mark.parametrize("case", list(BAD_CONFIGS))
def test_unsupported_configs_are_a_load_error_naming_the_key(case):
    from types import SimpleNamespace

    qc, message = BAD_CONFIGS[case]
    with pytest.raises(ModelLoadError, match=message):
        quant_config_from_hf(SimpleNamespace(quantization_config=qc))


def test_quantization_flag_must_be_the_checkpoints():
    from types import SimpleNamespace

    hf = SimpleNamespace(quantization_config=GPTQ_QC)
    assert quant_config_from_hf(hf, "gptq").method == "gptq"
    with pytest.raises(ConfigError, match="--quantization awq was given, but the checkpoint is quantized with gptq"):
        quant_config_from_hf(hf, "awq")
    with pytest.raises(ConfigError, match="--quantization fp8 was given, but .* no quantization_config"):
        quant_config_from_hf(SimpleNamespace(), "fp8")


# -- a quantized model --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fp8_llama(tiny_model_dir, tmp_path_factory):
    folder, _ = tiny_model_dir("llama")
    out = tmp_path_factory.mktemp("llama-fp8")
    write_quantized(folder, out, "fp8")
    return folder, out


def test_quantized_model_loads_with_its_start_line(fp8_llama, caplog):
    from kvgate.engine import LLM

    _, folder = fp8_llama
    with caplog.at_level(logging.INFO, logger="kvgate.engine.llm_engine"):
        llm = LLM(str(folder), max_model_len=64, dtype="float32", quantization="fp8")
    summary = llm.engine.quantization
    llm.engine.close()
    assert (summary.method, summary.quantized, summary.dense) == ("fp8", 14, 1)
    line = "fp8 (fp8_e4m3 block 16x16): 14 linear weights quantized, 1 dense, dequantized to float32 at load"
    assert any(line in r.getMessage() for r in caplog.records)


def test_quantization_flag_other_than_the_checkpoints_is_a_config_error(fp8_llama):
    from kvgate.engine import LLM

    dense, folder = fp8_llama
    with pytest.raises(ConfigError, match="--quantization gptq was given, but the checkpoint is quantized with fp8"):
        LLM(str(folder), max_model_len=64, quantization="gptq")
    with pytest.raises(ConfigError, match="--quantization fp8 was given, but .* no quantization_config"):
        LLM(str(dense), max_model_len=64, quantization="fp8")


def test_weight_bytes_of_a_quantized_checkpoint(fp8_llama):
    from kvgate.engine.loader import build_model, checkpoint_file_bytes, checkpoint_weight_bytes, load_hf_config

    dense, folder = fp8_llama
    hf = load_hf_config(folder)
    model = build_model(hf, torch.device("meta"), torch.float32, 64)
    held = checkpoint_weight_bytes(model, folder, quant_config_from_hf(hf))
    assert held == checkpoint_weight_bytes(model, dense)  # dense after dequantization, the same tensors
    stored, dense_bytes = checkpoint_file_bytes(folder), checkpoint_file_bytes(dense)
    assert stored < dense_bytes / 2  # the projections at one byte instead of four (plus their scales)


def test_serve_flag_parses():
    import argparse

    from kvgate.engine.cli_args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args("m", parser.parse_args(["--quantization", "awq"])).quantization == "awq"
    assert engine_config_from_args("m", parser.parse_args([])).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "bitsandbytes"])
    with pytest.raises(ConfigError, match="quantization must be one of"):
        from kvgate.engine.config import EngineConfig

        EngineConfig(model="m", quantization="int3")


def test_serve_stops_at_start_on_another_quantization(fp8_llama, capsys):
    """`kvgate serve --quantization` other than the checkpoint's: exit 2 before the server or the engine starts."""
    from kvgate.cli import main

    _, folder = fp8_llama
    assert main(["serve", str(folder), "--quantization", "awq", "--port", "0"]) == 2
    assert "--quantization awq was given, but the checkpoint is quantized with fp8" in capsys.readouterr().err


def test_quantized_tensors_split_across_shards_load_the_same(fp8_llama, tmp_path):
    """Every weight in one shard and every scale in another, the scales' shard read last: each module waits for
    its scale, and the model holds the same weights as from the single file."""
    import shutil

    from safetensors.torch import save_file

    from kvgate.engine import LLM
    from tests.engine.quant_checkpoints import read_checkpoint

    _, folder = fp8_llama
    sharded = tmp_path / "sharded"
    shutil.copytree(folder, sharded)
    (sharded / "model.safetensors").unlink()
    tensors = read_checkpoint(folder)
    shards = {"model-00001-of-00002.safetensors": {n: t for n, t in tensors.items() if "scale" not in n},
              "model-00002-of-00002.safetensors": {n: t for n, t in tensors.items() if "scale" in n}}
    for file, part in shards.items():
        save_file(part, str(sharded / file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    states = []
    for path in (folder, sharded):
        engine = LLM(str(path), max_model_len=64, dtype="float32").engine
        states.append(engine.runner.model.state_dict())
        engine.close()
    whole, split = states
    assert whole.keys() == split.keys() and all(torch.equal(whole[k], split[k]) for k in whole)


@pytest.mark.processes  # the result file records the commit (git)
def test_bench_engine_reports_held_and_stored_weight_bytes(fp8_llama, tmp_path, capsys):
    from kvgate.cli import main

    _, folder = fp8_llama
    result = tmp_path / "bench.json"
    assert main(["bench", "engine", "--model", str(folder), "--baselines", "none", "--num-requests", "2",
                 "--output-len", "3", "--min-prompt-len", "8", "--max-prompt-len", "16", "--dtype", "float32",
                 "--result-file", str(result)]) == 0
    run = json.loads(result.read_text())["results"]["kvgate"]
    assert run["weight_bytes_checkpoint"] < run["weight_bytes_held"] / 2
    assert run["quantization"].startswith("fp8 (fp8_e4m3 block 16x16): 14 linear weights quantized")
    assert 0 < run["decode"]["mean_bound_stored_weights_ms"] < run["decode"]["mean_bound_ms"]
    out = capsys.readouterr().out
    assert "MiB held by the engine (float32)" in out and "the bound would be" in out
