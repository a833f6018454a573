"""The layout the GPU path's quantized GEMMs read (engine/triton_quant.py), made from a quantized linear's
checkpoint tensors by its scheme's to_kernel_layout: a KernelWeight. Converting is exact: KernelWeight.dequantize
(the kernels' torch references) gives the scheme's own dense weight bit for bit in float32.

int ("int"): qweight uint8 [N, K] (8 bits) or [N, K / 2] (4 bits, pack_int4: the low nibble the even k), scales
float32 [N, K / group_size], zeros unsigned [N, K / group_size] (uint8, int16 where a zero point is 256) or None
(symmetric: 2**(bits - 1)); w[n, k] = (q[n, k] - zero) * scale. Signed formats (compressed-tensors) are shifted by
2**(bits - 1) into that range, zero points with them; a per-tensor or per-channel scale is one group of K inputs.
fp8 ("fp8"): weight float8_e4m3fn [N, K], scales float32 per row [N] (a per-tensor scale repeated: the shards of a
fused projection then concatenate exactly), or per [block_n, block_k] tile.
perm (GPTQ act-order): the kernel's input j is the checkpoint's input perm[j] (inputs sorted by group, so each
group is contiguous); the GEMM reads x[:, perm]."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvgate.common.errors import ModelLoadError


class NoKernelLayout(Exception):
    """A quantized linear whose tensors have no exact kernel layout (the message says why): it is dequantized."""


@dataclass(frozen=True)
class KernelWeight:
    kind: str  # "int" | "fp8"
    weight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bits: int
    group_size: int | None  # int: inputs per scale
    block: tuple[int, int] | None  # fp8: (block_n, block_k) tiles; None: per-row scales
    shape: tuple[int, int]  # the dense [N, K]
    perm: torch.Tensor | None = None  # int64 [K]

    def dequantize(self) -> torch.Tensor:
        """The dense float32 [N, K] weight in the checkpoint's input order, through triton_quant's references."""
        from kvgate.engine.triton_quant import dequantize_fp8_weight, dequantize_int_weight

        if self.kind == "int":
            dense = dequantize_int_weight(self.weight, self.scales, self.zeros, self.bits, self.group_size)
        else:
            dense = dequantize_fp8_weight(self.weight, self.scales, self.block, torch.float32)
        if self.perm is None:
            return dense
        out = torch.empty_like(dense)
        out[:, self.perm] = dense
        return out

    def tensors(self) -> dict[str, torch.Tensor]:
        named = {"weight": self.weight, "scales": self.scales, "zeros": self.zeros, "perm": self.perm}
        return {k: v for k, v in named.items() if v is not None}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def int_layout(q: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor, bits: int, group_size: int,
               perm: torch.Tensor | None = None) -> KernelWeight:
    """q: int32 [N, K] in [0, 2**bits); zeros: integers [N, K / group_size] (None: symmetric) in [0, 2**bits];
    scales: [N, K / group_size] (finite, > 0: the scheme checked them)."""
    from kvgate.engine.triton_quant import pack_int4

    n, k = q.shape
    if bits == 4 and k % 2:
        raise NoKernelLayout(f"int4 with an odd number of inputs ({k})")
    if k % group_size:
        raise NoKernelLayout(f"{k} inputs are not a multiple of the group size {group_size}")
    qweight = pack_int4(q) if bits == 4 else q.to(torch.uint8)
    if zeros is not None:
        zeros = zeros.to(torch.int32)
        if bool((zeros < 0).any()):
            raise NoKernelLayout("zero points below 0 after the shift to unsigned values")
        if bool((zeros == 1 << (bits - 1)).all()):
            zeros = None  # the kernel's symmetric default
        else:
            zeros = zeros.to(torch.uint8 if int(zeros.max()) <= 255 else torch.int16)
    return KernelWeight("int", qweight.contiguous(), scales.float().contiguous(),
                        None if zeros is None else zeros.contiguous(), bits, group_size, None, (n, k), perm)


def fp8_layout(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> KernelWeight:
    """weight float8_e4m3fn [N, K]; scale: one (per tensor), [N] / [N, 1] (per row) or the block grid."""
    n, k = weight.shape
    scale = scale.float()
    if block is None:
        scale = scale.reshape(-1).expand(n) if scale.numel() == 1 else scale.reshape(n)
    return KernelWeight("fp8", weight, scale.contiguous(), None, 8, None, block, (n, k))


def merge_rows(a: KernelWeight, b: KernelWeight) -> KernelWeight | None:
    """a's rows then b's as one KernelWeight (a fused projection's shards), or None where one GEMM cannot read
    both: another format, group or block size, input permutation, or a block-wise FP8 shard whose rows end inside
    a block."""
    if (a.kind, a.bits, a.group_size, a.block, a.shape[1]) != (b.kind, b.bits, b.group_size, b.block, b.shape[1]):
        return None
    if (a.perm is None) != (b.perm is None) or (a.perm is not None and not torch.equal(a.perm, b.perm)):
        return None
    if a.block is not None and a.shape[0] % a.block[0]:
        return None
    zeros = None
    if a.zeros is not None or b.zeros is not None:
        offset = 1 << (a.bits - 1)
        za = a.zeros if a.zeros is not None else torch.full(a.scales.shape, offset, dtype=torch.uint8)
        zb = b.zeros if b.zeros is not None else torch.full(b.scales.shape, offset, dtype=torch.uint8)
        dtype = torch.int16 if torch.int16 in (za.dtype, zb.dtype) else torch.uint8
        zeros = torch.cat((za.to(dtype), zb.to(dtype)))
    return replace(a, weight=torch.cat((a.weight, b.weight)), scales=torch.cat((a.scales, b.scales)), zeros=zeros,
                   shape=(a.shape[0] + b.shape[0], a.shape[1]))


def check_int_range(prefix: str, q: torch.Tensor, bits: int) -> None:
    """Signed stored values of `bits` < 8 bits must lie in [-2**(bits-1), 2**(bits-1)) (as dequantize checks)."""
    offset = 1 << (bits - 1)
    if bits < 8 and bool(((q < -offset) | (q >= offset)).any()):
        raise ModelLoadError(f"quantized tensor {prefix}.weight has values outside the int{bits} range "
                             f"[{-offset}, {offset})")
