"""AWQ checkpoints (quant_method "awq", AutoAWQ's GEMM version): per linear `qweight` (int32 [K, N / 8]: eight
4-bit outputs per word, word j's field i holding output 8 * j + ORDER[i]), `qzeros` (int32 [K / group_size,
N / 8], packed the same way) and `scales` ([K / group_size, N]). weight[n, k] = (q[k, n] - zero[g, n]) *
scale[g, n] with g = k // group_size."""

from __future__ import annotations

import torch

from kvgate.common.errors import ModelLoadError
from kvgate.engine.quantization.scheme import (LinearScheme, check_2d, check_bits, check_dtype, check_scales,
                                               check_shape, unpack_int32)

# AutoAWQ packs outputs 8j + [0, 2, 4, 6, 1, 3, 5, 7] into fields 0..7 of word j; UNDO_ORDER[c] is the field of
# output 8j + c.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
UNDO_ORDER = tuple(AWQ_ORDER.index(c) for c in range(8))
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C / 8] in AWQ's interleaved order -> int32 [R, C] in [0, 16)."""
    fields = unpack_int32(packed, 4, dim=1, count=packed.shape[1] * 8)
    return fields.view(packed.shape[0], -1, 8)[..., list(UNDO_ORDER)].reshape(packed.shape[0], -1)


class AwqScheme(LinearScheme):
    required = ("qweight", "qzeros", "scales")
    bits = 4

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    def describe(self) -> str:
        return f"int4 group {self.group_size}, asymmetric (GEMM packing)"

    def dense_shape(self, prefix, tensors):
        qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
        check_dtype(prefix, "qweight", qweight, (torch.int32,))
        check_dtype(prefix, "qzeros", qzeros, (torch.int32,))
        check_dtype(prefix, "scales", scales, SCALE_DTYPES)
        k, words = check_2d(prefix, "qweight", qweight)
        n = words * 8
        if k % self.group_size:
            raise ModelLoadError(f"quantized tensor {prefix}.qweight has {k} input channels, not a multiple of "
                                 f"group_size {self.group_size}")
        groups = k // self.group_size
        check_shape(prefix, "scales", scales, (groups, n), f"{groups} groups x {n} outputs")
        check_shape(prefix, "qzeros", qzeros, (groups, words), f"{groups} groups x {n} 4-bit zero points packed "
                                                               "in int32")
        return n, k

    def row_align(self):
        return 8  # outputs sharing a word

    def _prepare(self, prefix, tensors):
        return {"scale": check_scales(prefix, "scales", tensors["scales"])}

    def _rows(self, prefix, tensors, state, start, stop):
        words = slice(start // 8, stop // 8)  # n is a multiple of 8: so is every chunk's end
        q = unpack_awq(tensors["qweight"][:, words])  # [K, rows]
        zeros = unpack_awq(tensors["qzeros"][:, words])  # [groups, rows]
        scale = state["scale"][:, start:stop]
        groups = torch.arange(q.shape[0]) // self.group_size
        return ((q - zeros[groups]).float() * scale[groups]).t()


    def to_kernel_layout(self, prefix, tensors):
        from kvgate.engine.quantization.kernel_layout import int_layout

        self.dense_shape(prefix, tensors)
        state = self._prepare(prefix, tensors)
        q = unpack_awq(tensors["qweight"]).t()  # [N, K]
        zeros = unpack_awq(tensors["qzeros"]).t()  # [N, groups]
        return int_layout(q, zeros, state["scale"].t(), 4, self.group_size)


def parse_awq(qc: dict) -> tuple[AwqScheme, tuple[str, ...]]:
    check_bits("bits", qc.get("bits", qc.get("w_bit")), (4,))
    group_size = qc.get("group_size", qc.get("q_group_size", 128))
    if not (isinstance(group_size, int) and not isinstance(group_size, bool) and group_size > 0):
        raise ModelLoadError(f"quantization_config.group_size is {group_size!r}: expected a positive integer")
    version = qc.get("version", "gemm")
    if not isinstance(version, str) or version.lower() != "gemm":
        raise ModelLoadError(f"quantization_config.version is {version!r}: only AWQ's GEMM packing is supported")
    if qc.get("zero_point", True) is not True:
        raise ModelLoadError(f"quantization_config.zero_point is {qc['zero_point']!r}: only AWQ with zero points "
                             "(true) is supported")
    skip = qc.get("modules_to_not_convert") or []
    if not (isinstance(skip, list) and all(isinstance(s, str) for s in skip)):
        raise ModelLoadError(f"quantization_config.modules_to_not_convert must be a list of names, got {skip!r:.80}")
    return AwqScheme(group_size), tuple(skip)
