"""Quantized copies of the tiny test models (tests/engine/tiny_models.py), written with each format's own tools
where they run here, and the dense weights each format's own dequantization gives back (the parity reference).

- fp8: transformers' fine-grained FP8 quantizer op (Fp8Quantize) writes `weight` + `weight_scale_inv`; the
  reference is transformers' own from_pretrained of the quantized folder (on CPU it dequantizes at load).
- ct-*: compressed-tensors' own qparams (calculate_qparams) and compressors (the ones llm-compressor saves with)
  write the tensors, its ModelCompressor writes config.json's quantization_config; the reference is the same
  compressors' decompress.
- awq: AutoAWQ's GEMM layout packed here from the format's description (qweight [K, N / 8], outputs interleaved
  [0, 2, 4, 6, 1, 3, 5, 7] in each word); the reference is compressed-tensors' AutoAWQ converter (AWQ ->
  pack-quantized) followed by compressed-tensors' decompress, an implementation of the unpacking other than ours.
- gptq: GPTQ's layout (qweight [K / 8, N] packed along the inputs, qzeros stored minus one, g_idx a permutation of
  the groups: act-order; symmetric, the common case: the v1 format cannot store a zero point of 0) packed here from the format's description; GPTQModel (the format's library) does not
  install against this torch, so the reference is the integer values and scales the packer started from.

Quantized: every projection of the decoder layers (attention, MLP, MoE experts); the embeddings, LM head and MoE
router stay dense (in the config's ignore lists where the format has one).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from types import SimpleNamespace

import torch

QUANT_FORMATS = ("fp8", "ct-fp8-channel", "ct-w4a16", "ct-w8a16-asym", "awq", "gptq")
GROUP = 16  # divides every input width of the tiny models (64, 128, 160, 48)
_PROJECTION = re.compile(r"(_proj|\.w[123])\.weight$")


def is_projection(name: str) -> bool:
    return bool(_PROJECTION.search(name))


def read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def write_quantized(dense: Path, out: Path, fmt: str) -> dict[str, torch.Tensor]:
    """Write `dense`'s model quantized with `fmt` to `out` (config, tokenizer, model.safetensors); returns the
    dense weight of each quantized projection as the format's own dequantization gives it (fp8: empty, the
    reference is transformers' loader of `out`)."""
    from safetensors.torch import save_file

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(dense, out)
    state = read_checkpoint(dense)
    writer = {"fp8": _fp8, "awq": _awq, "gptq": _gptq}.get(fmt, _compressed_tensors)
    tensors, qconfig, reference = writer(state, fmt, out)
    (out / "model.safetensors").unlink()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if qconfig is not None:
        config = json.loads((out / "config.json").read_text())
        config["quantization_config"] = qconfig
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return reference


def _fp8(state, fmt, out):
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    config = FineGrainedFP8Config(weight_block_size=[GROUP, GROUP], modules_to_not_convert=["lm_head", "gate"])
    op = Fp8Quantize(SimpleNamespace(quantization_config=config))
    tensors = {}
    for name, value in state.items():
        tensors.update(op.convert({name: value}) if is_projection(name) else {name: value})
    return tensors, config.to_dict(), {}


# format name -> (compressed-tensors preset, compression format, its weight args changed)
CT_SCHEMES = {
    "ct-fp8-channel": ("FP8_DYNAMIC", "float-quantized", {}),
    "ct-w4a16": ("W4A16", "pack-quantized", {"group_size": GROUP}),
    "ct-w8a16-asym": ("W8A16", "pack-quantized", {"strategy": "channel", "group_size": None, "symmetric": False}),
}


def ct_scheme(fmt: str):
    from compressed_tensors.quantization import preset_name_to_scheme

    preset, compression, changes = CT_SCHEMES[fmt]
    scheme = preset_name_to_scheme(preset, ["Linear"])
    scheme.weights = scheme.weights.model_copy(update=changes)
    return scheme, compression


def ct_qparams(weight: torch.Tensor, args):
    """compressed-tensors' scale and zero point of a weight: its min/max per tensor, output channel or group, as
    llm-compressor's min-max observer takes them, through compressed-tensors' calculate_qparams."""
    from compressed_tensors.quantization.utils import calculate_qparams

    strategy = args.strategy.value if hasattr(args.strategy, "value") else args.strategy
    if strategy == "tensor":
        lo, hi = weight.amin().reshape(1), weight.amax().reshape(1)
    elif strategy == "channel":
        lo, hi = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
    elif strategy == "block":  # per [bn, bk] tile, the last ones partial
        bn, bk = args.block_structure
        n, k = weight.shape
        tiles = [[weight[i:i + bn, j:j + bk] for j in range(0, k, bk)] for i in range(0, n, bn)]
        lo = torch.tensor([[t.min() for t in row] for row in tiles])
        hi = torch.tensor([[t.max() for t in row] for row in tiles])
    else:
        grouped = weight.unflatten(1, (weight.shape[1] // args.group_size, args.group_size))
        lo, hi = grouped.amin(-1), grouped.amax(-1)
    return calculate_qparams(lo, hi, args)


def _compressed_tensors(state, fmt, out):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.model_compressors.model_compressor import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus

    scheme, compression = ct_scheme(fmt)
    compressor = BaseCompressor.get_value_from_registry(compression)
    tensors, reference = {}, {}
    for name, value in state.items():
        if not is_projection(name):
            tensors[name] = value
            continue
        prefix = name.removesuffix(".weight")
        scale, zero = ct_qparams(value, scheme.weights)
        compressed = compressor.compress({"weight": value, "weight_scale": scale, "weight_zero_point": zero}, scheme)
        tensors.update({f"{prefix}.{k}": v for k, v in compressed.items()})
        reference[name] = compressor.decompress(compressed, scheme)["weight"]
    qconfig = QuantizationConfig(config_groups={"group_0": scheme}, format=compression,
                                 quantization_status=QuantizationStatus.COMPRESSED,
                                 ignore=["lm_head", "re:.*mlp\\.gate$", "re:.*block_sparse_moe\\.gate$"])
    ModelCompressor(quantization_config=qconfig).update_config(str(out))
    return tensors, None, reference


def _int_qparams(weight: torch.Tensor, bits: int, group: int, symmetric: bool = False):
    """Min-max quantization per group of `group` inputs, as GPTQ's and AWQ's quantizers take it: (q [N, K] in
    [0, 2**bits), zeros [N, K / g] in [0, 2**bits), scales [N, K / g], rounded to float16 as they are stored).
    symmetric: the range [-max |w|, max |w|] and the zero point 2**(bits - 1)."""
    top = 2 ** bits - 1
    grouped = weight.unflatten(1, (weight.shape[1] // group, group))
    lo, hi = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    if symmetric:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    scales = ((hi - lo) / top).clamp(min=1e-6).half().float()
    zeros = torch.full_like(scales, (top + 1) // 2) if symmetric else torch.round(-lo / scales).clamp(0, top)
    q = torch.round(grouped / scales.unsqueeze(-1) + zeros.unsqueeze(-1)).clamp(0, top)
    return q.flatten(1).to(torch.int32), zeros.to(torch.int32), scales


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, C] of `bits`-bit fields -> [R / (32 / bits), C]: row r in word r // p, bits (r % p) * bits."""
    per = 32 // bits
    packed = torch.zeros(values.shape[0] // per, values.shape[1], dtype=torch.int64)
    for i in range(per):
        packed |= values[i::per].to(torch.int64) << (bits * i)
    return _as_int32(packed)


def pack_columns(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """int32 [R, C] -> [R, C / p]: column p * j + order[i] in word j's field i (order: identity)."""
    per = 32 // bits
    order = order or range(per)
    packed = torch.zeros(values.shape[0], values.shape[1] // per, dtype=torch.int64)
    for i, column in enumerate(order):
        packed |= values[:, column::per].to(torch.int64) << (bits * i)
    return _as_int32(packed)


def _as_int32(packed: torch.Tensor) -> torch.Tensor:
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _awq(state, fmt, out):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter
    from compressed_tensors.quantization import preset_name_to_scheme

    tensors, packed = {}, {}
    for name, value in state.items():
        if not is_projection(name):
            tensors[name] = value
            continue
        prefix = name.removesuffix(".weight")
        q, zeros, scales = _int_qparams(value, 4, GROUP)  # [N, K], [N, K / g]
        packed[prefix] = {"qweight": pack_columns(q.t().contiguous(), 4, AWQ_PACK_ORDER),
                          "qzeros": pack_columns(zeros.t().contiguous(), 4, AWQ_PACK_ORDER),
                          "scales": scales.t().contiguous().half()}
        tensors.update({f"{prefix}.{k}": v for k, v in packed[prefix].items()})
    # the reference: compressed-tensors' AWQ -> pack-quantized converter, then its decompressor
    converted = AutoAWQConverter(bits=4, group_size=GROUP, zero_point=True).process(
        {f"{p}.{k}": v for p, ts in packed.items() for k, v in ts.items()})
    scheme = preset_name_to_scheme("W4A16_ASYM", ["Linear"])
    scheme.weights = scheme.weights.model_copy(update={"group_size": GROUP})
    compressor = BaseCompressor.get_value_from_registry("pack-quantized")
    reference = {}
    for prefix in packed:
        local = {k.removeprefix(prefix + "."): v for k, v in converted.items() if k.startswith(prefix + ".")}
        local["weight_scale"] = local["weight_scale"].float()  # the arithmetic in float32, as the engine's
        reference[f"{prefix}.weight"] = compressor.decompress(local, scheme)["weight"].float()
    qconfig = {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm",
               "modules_to_not_convert": ["gate"]}
    return tensors, qconfig, reference


def _gptq(state, fmt, out):
    bits, tensors, reference = 4, {}, {}
    generator = torch.Generator().manual_seed(0)
    for name, value in state.items():
        if not is_projection(name):
            tensors[name] = value
            continue
        prefix = name.removesuffix(".weight")
        n, k = value.shape
        # act-order: the inputs are grouped in a random order (g_idx), the groups' scales in input order
        g_idx = torch.randperm(k, generator=generator) // GROUP
        order = torch.argsort(g_idx, stable=True)
        q_sorted, zeros, scales = _int_qparams(value[:, order], bits, GROUP, symmetric=True)  # g_idx order
        q = torch.empty_like(q_sorted)
        q[:, order] = q_sorted
        tensors[f"{prefix}.qweight"] = pack_rows(q.t().contiguous(), bits)  # [K / 8, N]
        tensors[f"{prefix}.qzeros"] = pack_columns((zeros - 1).t().contiguous(), bits)  # v1: zero - 1
        tensors[f"{prefix}.scales"] = scales.t().contiguous().half()
        tensors[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
        reference[name] = ((q - zeros[:, g_idx]).float() * scales[:, g_idx])
    qconfig = {"quant_method": "gptq", "bits": bits, "group_size": GROUP, "desc_act": True, "sym": True,
               "checkpoint_format": "gptq", "damp_percent": 0.01}
    return tensors, qconfig, reference
