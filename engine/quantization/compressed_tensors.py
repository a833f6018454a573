"""compressed-tensors checkpoints (quant_method "compressed-tensors": what llm-compressor writes). The config's
`config_groups` each name the modules they target and their weights' quantization (num_bits, int or float,
symmetric, strategy tensor / channel / group / block); `format` (global or per group) says how the weights are
stored:

- float-quantized, int-quantized, naive-quantized: `weight` holds the quantized values themselves (float8_e4m3fn,
  or int8 for int types of up to 8 bits), with `weight_scale` and, asymmetric, `weight_zero_point` (int8).
- pack-quantized (W4A16 / W8A16): `weight_packed` (int32 [N, ceil(K * bits / 32)], input channel k at word
  k // (32 / bits), bits [bits * (k % (32 / bits)), ...), stored offset by 2**(bits - 1)), `weight_shape` ([N, K]),
  `weight_scale`, and, asymmetric, `weight_zero_point` packed the same way along the outputs.

weight = (q - zero_point) * scale, the scale (and zero point) broadcast per tensor ([1]), per output channel
([N, 1]), per group of `group_size` inputs ([N, K / group_size]) or per [block_n, block_k] tile. An activation
quantization (input_activations: W8A8) adds `input_scale` for static schemes: read and dropped, the CPU path runs
in the model dtype. Modules matching `ignore` stay dense."""

from __future__ import annotations

import torch

from kvgate.common.errors import ModelLoadError
from kvgate.engine.quantization.fp8 import SCALE_DTYPES as FLOAT_SCALE_DTYPES, expand_block_scales
from kvgate.engine.quantization.scheme import (LinearScheme, check_2d, check_bits, check_dtype, check_scales,
                                               check_shape, packed_count, unpack_int32)

STRATEGIES = ("tensor", "channel", "group", "block")
NAIVE_FORMATS = ("float-quantized", "int-quantized", "naive-quantized")
FORMATS = NAIVE_FORMATS + ("pack-quantized",)
ACTIVATION_TENSORS = ("input_scale", "input_zero_point")


class CompressedScheme(LinearScheme):
    """One config group's weight quantization; the format decides the tensors (see the module doc)."""

    dropped = ACTIVATION_TENSORS
    refused = ("weight_g_idx",)  # activation-ordered groups: not supported (the plan names the tensor)

    def __init__(self, fmt: str, bits: int, kind: str, symmetric: bool, strategy: str, group_size: int | None,
                 block: tuple[int, int] | None) -> None:
        self.fmt, self.bits, self.kind, self.symmetric = fmt, bits, kind, symmetric
        self.strategy, self.group_size, self.block = strategy, group_size, block
        packed = fmt == "pack-quantized"
        self.required = ("weight_packed", "weight_shape", "weight_scale") if packed else ("weight", "weight_scale")
        self.optional = ("weight_zero_point",)

    def describe(self) -> str:
        detail = {"group": f"group {self.group_size}", "channel": "per-channel", "tensor": "per-tensor",
                  "block": f"block {self.block[0]}x{self.block[1]}" if self.block else "block"}[self.strategy]
        kind = "fp8_e4m3" if self.kind == "float" else f"int{self.bits}"
        return f"{self.fmt} {kind} {detail}, {'symmetric' if self.symmetric else 'asymmetric'}"

    def scale_shape(self, prefix: str, n: int, k: int) -> tuple[int, ...]:
        if self.strategy == "tensor":
            return (1,)
        if self.strategy == "channel":
            return (n, 1)
        if self.strategy == "group":
            if k % self.group_size:
                raise ModelLoadError(f"quantized module {prefix!r} has {k} input channels, not a multiple of "
                                     f"group_size {self.group_size}")
            return n, k // self.group_size
        return -(-n // self.block[0]), -(-k // self.block[1])

    def dense_shape(self, prefix, tensors):
        if self.fmt == "pack-quantized":
            n, k = self._packed_shape(prefix, tensors)
        else:
            weight = tensors["weight"]
            check_dtype(prefix, "weight", weight, (torch.float8_e4m3fn,) if self.kind == "float" else (torch.int8,))
            n, k = check_2d(prefix, "weight", weight)
        scale = tensors["weight_scale"]
        check_dtype(prefix, "weight_scale", scale, FLOAT_SCALE_DTYPES)
        expected = self.scale_shape(prefix, n, k)
        shape = tuple(scale.shape)
        # a per-tensor scale may be stored as a scalar, a per-channel one as [N]
        if shape != expected and not (self.strategy == "tensor" and scale.numel() == 1) \
                and not (self.strategy == "channel" and shape == (n,)):
            raise ModelLoadError(f"quantized tensor {prefix}.weight_scale has shape {shape}, expected {expected} "
                                 f"({self.strategy} strategy, [{n}, {k}] weight)")
        if "weight_zero_point" in tensors:
            zero = tensors["weight_zero_point"]
            if self.fmt == "pack-quantized" and self.strategy in ("group", "channel"):
                check_dtype(prefix, "weight_zero_point", zero, (torch.int32,))
                rows, cols = scale.shape if scale.dim() == 2 else (scale.shape[0], 1)
                check_shape(prefix, "weight_zero_point", zero, (packed_count(rows, self.bits), cols),
                            f"{self.bits}-bit zero points packed in int32 along the outputs")
            else:
                check_dtype(prefix, "weight_zero_point", zero, (torch.int8, torch.int32) if self.kind == "int"
                            else (torch.float8_e4m3fn, torch.int8))
                if zero.numel() != scale.numel():
                    raise ModelLoadError(f"quantized tensor {prefix}.weight_zero_point has shape "
                                         f"{tuple(zero.shape)}, expected one zero point per scale "
                                         f"{tuple(scale.shape)}")
        elif not self.symmetric:
            raise ModelLoadError(f"quantized module {prefix!r} is asymmetric but its checkpoint has no "
                                 f"{prefix}.weight_zero_point")
        return n, k

    def _packed_shape(self, prefix, tensors) -> tuple[int, int]:
        packed, shape = tensors["weight_packed"], tensors["weight_shape"]
        check_dtype(prefix, "weight_packed", packed, (torch.int32,))
        check_dtype(prefix, "weight_shape", shape, (torch.int64, torch.int32))
        rows, words = check_2d(prefix, "weight_packed", packed)
        check_shape(prefix, "weight_shape", shape, (2,), "the dense [out, in] shape")
        if shape.device.type == "meta":
            raise ModelLoadError(f"quantized tensor {prefix}.weight_shape must be read to size the weight")
        n, k = (int(v) for v in shape.tolist())
        if n != rows or k <= 0 or packed_count(k, self.bits) != words:
            raise ModelLoadError(f"quantized tensor {prefix}.weight_packed has shape {(rows, words)}, which does "
                                 f"not hold a [{n}, {k}] weight (weight_shape) of {self.bits}-bit values")
        return n, k

    def row_align(self):
        if self.strategy == "block":
            return self.block[0]
        return 32 // self.bits if self.fmt == "pack-quantized" else 1  # outputs sharing a packed zero point

    def _packed_zero(self) -> bool:
        return self.fmt == "pack-quantized" and self.strategy in ("group", "channel")

    def _prepare(self, prefix, tensors):
        scale = check_scales(prefix, "weight_scale", tensors["weight_scale"])
        if self.strategy == "channel":
            scale = scale.reshape(-1, 1)
        zero = tensors.get("weight_zero_point")
        if zero is not None and not self._packed_zero():
            zero = zero.float().reshape(scale.shape)
        return {"scale": scale, "zero": zero}

    def _rows(self, prefix, tensors, state, start, stop):
        scale, zero, offset = state["scale"], state["zero"], 1 << (self.bits - 1)
        if self.fmt == "pack-quantized":
            k = int(tensors["weight_shape"][1])
            q = unpack_int32(tensors["weight_packed"][start:stop], self.bits, dim=1, count=k) - offset
        else:
            q = tensors["weight"][start:stop]
            k = q.shape[1]
            if self.kind == "int":
                q = q.to(torch.int32)
                if self.bits < 8 and bool(((q < -offset) | (q >= offset)).any()):
                    raise ModelLoadError(f"quantized tensor {prefix}.weight has values outside the int{self.bits} "
                                         f"range [{-offset}, {offset})")
        rows = stop - start
        if self.strategy in ("channel", "group"):
            scale = scale[start:stop]
            if zero is not None and self._packed_zero():
                per_word = 32 // self.bits
                words = zero[start // per_word:-(-stop // per_word)]
                zero = (unpack_int32(words, self.bits, dim=0, count=rows) - offset).float()
            elif zero is not None:
                zero = zero[start:stop]
        elif self.strategy == "block":
            blocks = slice(start // self.block[0], -(-stop // self.block[0]))
            scale = scale[blocks] if scale.numel() != 1 else scale
            zero = zero[blocks] if zero is not None and zero.numel() != 1 else zero
        return self._apply(q.float(), scale, zero, rows, k)

    def _apply(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, n: int, k: int):
        if self.strategy in ("tensor", "channel"):
            scale = scale.reshape(()) if self.strategy == "tensor" else scale.reshape(n, 1)
            zero = None if zero is None else zero.reshape(scale.shape)
            return (q - zero if zero is not None else q) * scale
        if self.strategy == "group":
            q = q.unflatten(1, (k // self.group_size, self.group_size))
            scale = scale.unsqueeze(-1)
            zero = None if zero is None else zero.reshape(scale.shape)
            return ((q - zero if zero is not None else q) * scale).flatten(1)
        if zero is not None:
            q = q - expand_block_scales(zero, q.shape, self.block)
        return q * expand_block_scales(scale, q.shape, self.block)


    def to_kernel_layout(self, prefix, tensors):
        from kvgate.engine.quantization.kernel_layout import (NoKernelLayout, check_int_range, fp8_layout,
                                                               int_layout)

        n, k = self.dense_shape(prefix, tensors)
        state = self._prepare(prefix, tensors)
        scale, zero, offset = state["scale"], state["zero"], 1 << (self.bits - 1)
        if self.kind == "float":
            if zero is not None and bool((zero != 0).any()):
                raise NoKernelLayout("FP8 weights with non-zero zero points")
            if self.strategy in ("tensor", "channel"):
                return fp8_layout(tensors["weight"], scale, None)
            if self.strategy == "group":  # a [1, group_size] tile per scale
                return fp8_layout(tensors["weight"], scale, (1, self.group_size))
            return fp8_layout(tensors["weight"], scale, self.block)
        if self.fmt == "pack-quantized":  # stored offset by 2**(bits - 1): already the unsigned values
            q = unpack_int32(tensors["weight_packed"], self.bits, dim=1, count=k)
            if zero is not None and self._packed_zero():
                zero = unpack_int32(zero, self.bits, dim=0, count=n)
            elif zero is not None:
                zero = zero.to(torch.int32) + offset
        else:
            q = tensors["weight"].to(torch.int32)
            check_int_range(prefix, q, self.bits)
            q = q + offset
            zero = None if zero is None else zero.to(torch.int32) + offset
        if self.strategy in ("tensor", "channel"):  # one group of all K inputs per row
            scale = scale.reshape(-1, 1).expand(n, 1)
            zero = None if zero is None else zero.reshape(-1, 1).expand(n, 1)
            return int_layout(q, zero, scale, self.bits, k)
        if self.strategy == "group":
            return int_layout(q, zero, scale, self.bits, self.group_size)
        bn, bk = self.block  # block-wise ints: a group of bk inputs per row, each row its block's scale
        if k % bk:
            raise NoKernelLayout(f"int blocks of {bk} inputs do not divide {k} inputs")
        rows = torch.arange(n) // bn
        scale = scale.reshape(-1, 1).expand(n, k // bk) if scale.numel() == 1 else scale[rows]
        if zero is not None:
            zero = zero.reshape(-1, 1).expand(n, k // bk) if zero.numel() == 1 else zero[rows]
        return int_layout(q, zero, scale, self.bits, bk)


def parse_compressed_tensors(qc: dict) -> tuple[list[tuple[tuple[str, ...], CompressedScheme]], tuple[str, ...]]:
    """([(targets, scheme)] of the config groups that quantize weights, the ignore list)."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ModelLoadError(f"quantization_config.quantization_status is {status!r}: only compressed checkpoints "
                             "are supported")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        value = qc.get(key)
        if value and not (key == "sparsity_config" and value.get("format", "dense") == "dense"):
            raise ModelLoadError(f"quantization_config.{key} is set: compressed-tensors {key.split('_')[0]} "
                                 "is not supported")
    global_format = qc.get("format")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ModelLoadError("quantization_config.config_groups must be a non-empty object")
    parsed = []
    for name, group in groups.items():
        key = f"quantization_config.config_groups.{name}"
        if not isinstance(group, dict):
            raise ModelLoadError(f"{key} must be an object")
        targets = group.get("targets")
        if not (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)):
            raise ModelLoadError(f"{key}.targets must be a non-empty list of names")
        if group.get("output_activations"):
            raise ModelLoadError(f"{key}.output_activations: output quantization is not supported")
        weights = group.get("weights")
        if not weights:
            continue  # an activation-only group: no weight to dequantize
        fmt = group.get("format") or global_format
        if fmt not in FORMATS:
            raise ModelLoadError(f"{key}.format (or quantization_config.format) is {fmt!r}: supported "
                                 f"{', '.join(FORMATS)}")
        parsed.append((tuple(targets), _scheme(f"{key}.weights", weights, fmt)))
    ignore = qc.get("ignore") or []
    if not (isinstance(ignore, list) and all(isinstance(i, str) for i in ignore)):
        raise ModelLoadError(f"quantization_config.ignore must be a list of names, got {ignore!r:.80}")
    return parsed, tuple(ignore)


def _scheme(key: str, weights: dict, fmt: str) -> CompressedScheme:
    if not isinstance(weights, dict):
        raise ModelLoadError(f"{key} must be an object")
    kind = weights.get("type", "int")
    if kind not in ("int", "float"):
        raise ModelLoadError(f"{key}.type is {kind!r}: supported int, float")
    bits = check_bits(f"{key.removeprefix('quantization_config.')}.num_bits", weights.get("num_bits"),
                      (8,) if kind == "float" else (4, 8))
    if kind == "float" and fmt == "pack-quantized":
        raise ModelLoadError(f"{key}: float weights are not stored pack-quantized")
    if weights.get("dynamic", False):
        raise ModelLoadError(f"{key}.dynamic is {weights['dynamic']!r}: weights need stored scales")
    strategy = weights.get("strategy", "tensor")
    if strategy not in STRATEGIES:
        raise ModelLoadError(f"{key}.strategy is {strategy!r}: supported {', '.join(STRATEGIES)}")
    symmetric = weights.get("symmetric", True)
    if not isinstance(symmetric, bool):
        raise ModelLoadError(f"{key}.symmetric is {symmetric!r}: expected true or false")
    group_size = block = None
    if strategy == "group":
        group_size = weights.get("group_size")
        if not (isinstance(group_size, int) and not isinstance(group_size, bool) and group_size > 0):
            raise ModelLoadError(f"{key}.group_size is {group_size!r}: expected a positive integer")
    if strategy == "block":
        block = weights.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ModelLoadError(f"{key}.block_structure is {block!r}: expected two positive integers")
        block = (block[0], block[1])
    return CompressedScheme(fmt, bits, kind, symmetric, strategy, group_size, block)
