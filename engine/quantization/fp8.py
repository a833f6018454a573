"""FP8 checkpoints as HF transformers writes them (quant_method "fp8", its fine-grained FP8 integration): each
quantized linear's `weight` in float8_e4m3fn and its `weight_scale_inv` (vLLM's per-tensor FP8 checkpoints: `weight_scale`), the factor that multiplies the stored
values back to the weight: one per [block_n, block_k] tile of the weight (shape [ceil(N / block_n),
ceil(K / block_k)], the last tiles partial) with `weight_block_size`, one for the whole tensor without it. A
static activation scheme adds `activation_scale` (or `input_scale`), not needed to dequantize."""

from __future__ import annotations

import torch

from kvgate.common.errors import ModelLoadError
from kvgate.engine.quantization.scheme import LinearScheme, check_2d, check_dtype, check_scales

FP8_DTYPES = (torch.float8_e4m3fn,)
SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class Fp8BlockScheme(LinearScheme):
    dropped = ("activation_scale", "input_scale")
    bits = 8

    def __init__(self, block: tuple[int, int] | None, scale_suffix: str = "weight_scale_inv") -> None:
        """block: (block_n, block_k); None: one scale per tensor. scale_suffix: weight_scale_inv (transformers),
        or weight_scale (vLLM's per-tensor FP8 checkpoints, the same multiplier under another name)."""
        self.block = block
        self.scale_suffix = scale_suffix
        self.required = ("weight", scale_suffix)

    def describe(self) -> str:
        return f"fp8_e4m3 block {self.block[0]}x{self.block[1]}" if self.block else "fp8_e4m3 per-tensor"

    def dense_shape(self, prefix, tensors):
        weight, scale = tensors["weight"], tensors[self.scale_suffix]
        check_dtype(prefix, "weight", weight, FP8_DTYPES)
        check_dtype(prefix, self.scale_suffix, scale, SCALE_DTYPES)
        n, k = check_2d(prefix, "weight", weight)
        expected = self.scale_shape(n, k)
        if scale.numel() != 1 and tuple(scale.shape) != expected:
            raise ModelLoadError(f"quantized tensor {prefix}.{self.scale_suffix!s} has shape {tuple(scale.shape)}, "
                                 f"expected {expected} for a [{n}, {k}] weight"
                                 + (f" in {self.block[0]}x{self.block[1]} blocks" if self.block else
                                    " (one per-tensor scale)"))
        return n, k

    def scale_shape(self, n: int, k: int) -> tuple[int, ...]:
        if self.block is None:
            return (1,)
        return -(-n // self.block[0]), -(-k // self.block[1])

    def row_align(self):
        return self.block[0] if self.block else 1

    def _prepare(self, prefix, tensors):
        return {"scale": check_scales(prefix, self.scale_suffix, tensors[self.scale_suffix])}

    def _rows(self, prefix, tensors, state, start, stop):
        weight, scale = tensors["weight"][start:stop].float(), state["scale"]
        if scale.numel() != 1:
            scale = scale[start // self.block[0]:-(-stop // self.block[0])]
        return weight * expand_block_scales(scale, weight.shape, self.block)


    def to_kernel_layout(self, prefix, tensors):
        from kvgate.engine.quantization.kernel_layout import fp8_layout

        self.dense_shape(prefix, tensors)
        scale = self._prepare(prefix, tensors)["scale"]
        return fp8_layout(tensors["weight"], scale, self.block if scale.numel() != 1 else None)


def expand_block_scales(scale: torch.Tensor, shape: torch.Size, block: tuple[int, int] | None) -> torch.Tensor:
    """Per-tile scales broadcast to every element of an [N, K] weight (a single scale as a scalar)."""
    if scale.numel() == 1:
        return scale.reshape(())
    n, k = shape  # indexing, not repeat_interleave: the result is [N, K] whatever the (config's) block size
    return scale[torch.arange(n) // block[0]][:, torch.arange(k) // block[1]]


def parse_fp8(qc: dict) -> tuple[list[Fp8BlockScheme], tuple[str, ...]]:
    """(the schemes, modules left dense) of an FP8 quantization_config: transformers' weight_scale_inv, and for
    per-tensor scales also vLLM's weight_scale."""
    block = qc.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ModelLoadError(f"quantization_config.weight_block_size is {block!r}: expected two positive "
                                 "integers [block_n, block_k] or null")
        block = (block[0], block[1])
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ModelLoadError(f"quantization_config.activation_scheme is {scheme!r}: expected dynamic or static")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"quantization_config.fmt is {fmt!r}: only e4m3 FP8 weights are supported")
    scale_fmt = qc.get("scale_fmt")
    if scale_fmt not in (None, "float"):
        raise ModelLoadError(f"quantization_config.scale_fmt is {scale_fmt!r}: only float scales are supported")
    schemes = [Fp8BlockScheme(block)] + ([Fp8BlockScheme(None, "weight_scale")] if block is None else [])
    return schemes, tuple(_names(qc, "modules_to_not_convert") + _names(qc, "ignored_layers"))


def _names(qc: dict, key: str) -> list[str]:
    value = qc.get(key) or []
    if not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
        raise ModelLoadError(f"quantization_config.{key} must be a list of module names, got {value!r:.80}")
    return value
