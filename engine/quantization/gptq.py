"""GPTQ checkpoints (quant_method "gptq", AutoGPTQ / GPTQModel / optimum): per linear `qweight` (int32 [K / p,
N], p = 32 / bits fields per word, input channel k at word k // p, bits [bits * (k % p), ...)), `qzeros` (int32
[groups, N / p], packed the same way along the outputs), `scales` ([groups, N]) and `g_idx` (int32 [K], the group
of each input channel; absent: k // group_size). weight[n, k] = (q[k, n] - zero[g, n]) * scale[g, n] with
g = g_idx[k]. The "gptq" checkpoint format (v1) stores each zero point minus one; "gptq_v2" stores it as is."""

from __future__ import annotations

import torch

from kvgate.common.errors import ModelLoadError
from kvgate.engine.quantization.scheme import (LinearScheme, check_2d, check_bits, check_dtype, check_scales,
                                               check_shape, packed_count, unpack_int32)

SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


class GptqScheme(LinearScheme):
    required = ("qweight", "qzeros", "scales")
    optional = ("g_idx",)

    def __init__(self, bits: int, group_size: int, desc_act: bool, sym: bool, zero_offset: int) -> None:
        self.bits, self.group_size, self.desc_act, self.sym = bits, group_size, desc_act, sym
        self.zero_offset = zero_offset  # 1: v1 stores zero - 1

    def describe(self) -> str:
        group = "per-channel" if self.group_size == -1 else f"group {self.group_size}"
        return (f"int{self.bits} {group}, {'symmetric' if self.sym else 'asymmetric'}"
                + (", act-order" if self.desc_act else ""))

    def groups(self, prefix: str, k: int) -> int:
        if self.group_size == -1:
            return 1
        if k % self.group_size:
            raise ModelLoadError(f"quantized tensor {prefix}.qweight has {k} input channels, not a multiple of "
                                 f"group_size {self.group_size}")
        return k // self.group_size

    def dense_shape(self, prefix, tensors):
        qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
        check_dtype(prefix, "qweight", qweight, (torch.int32,))
        check_dtype(prefix, "qzeros", qzeros, (torch.int32,))
        check_dtype(prefix, "scales", scales, SCALE_DTYPES)
        words, n = check_2d(prefix, "qweight", qweight)
        k = words * (32 // self.bits)
        groups = self.groups(prefix, k)
        check_shape(prefix, "scales", scales, (groups, n), f"{groups} groups x {n} outputs")
        check_shape(prefix, "qzeros", qzeros, (groups, packed_count(n, self.bits)),
                    f"{groups} groups x {n} {self.bits}-bit zero points packed in int32")
        if "g_idx" in tensors:
            check_dtype(prefix, "g_idx", tensors["g_idx"], INDEX_DTYPES)
            check_shape(prefix, "g_idx", tensors["g_idx"], (k,), "one group index per input channel")
        return n, k

    def row_align(self):
        return 32 // self.bits  # outputs sharing a word of qzeros

    def _prepare(self, prefix, tensors):
        k = tensors["qweight"].shape[0] * (32 // self.bits)
        groups = tensors["scales"].shape[0]
        if "g_idx" in tensors:
            g_idx = tensors["g_idx"].long()
            bad = (g_idx < 0) | (g_idx >= groups)
            if bool(bad.any()):
                raise ModelLoadError(f"quantized tensor {prefix}.g_idx has {int(bad.sum())} group indices outside "
                                     f"[0, {groups}) (e.g. {int(g_idx[bad][0])})")
        else:
            g_idx = torch.arange(k) // (k // groups)
        return {"g_idx": g_idx, "scale": check_scales(prefix, "scales", tensors["scales"])}

    def _rows(self, prefix, tensors, state, start, stop):
        per_word, g_idx = 32 // self.bits, state["g_idx"]
        q = unpack_int32(tensors["qweight"][:, start:stop], self.bits, dim=0, count=len(g_idx))  # [K, rows]
        words = tensors["qzeros"][:, start // per_word:-(-stop // per_word)]
        zeros = unpack_int32(words, self.bits, dim=1, count=stop - start) + self.zero_offset  # [groups, rows]
        scale = state["scale"][:, start:stop]
        return ((q - zeros[g_idx]).float() * scale[g_idx]).t()


    def to_kernel_layout(self, prefix, tensors):
        from kvgate.engine.quantization.kernel_layout import NoKernelLayout, int_layout

        n, k = self.dense_shape(prefix, tensors)
        state = self._prepare(prefix, tensors)
        g_idx, groups = state["g_idx"], tensors["scales"].shape[0]
        group = k // groups
        q = unpack_int32(tensors["qweight"], self.bits, dim=0, count=k).t()  # [N, K]
        zeros = unpack_int32(tensors["qzeros"], self.bits, dim=1, count=n) + self.zero_offset  # [groups, N]
        in_order = torch.arange(k) // group
        perm = None
        if not torch.equal(g_idx, in_order):  # act-order: sort the inputs by group, the GEMM permutes x alike
            perm = torch.argsort(g_idx, stable=True)
            if not torch.equal(g_idx[perm], in_order):
                raise NoKernelLayout("act-order groups of unequal sizes")
            q = q[:, perm]
        return int_layout(q, zeros.t(), state["scale"].t(), self.bits, group, perm)


def parse_gptq(qc: dict) -> GptqScheme:
    bits = check_bits("bits", qc.get("bits"))
    group_size = qc.get("group_size", 128)
    if not (isinstance(group_size, int) and not isinstance(group_size, bool) and (group_size > 0
                                                                                   or group_size == -1)):
        raise ModelLoadError(f"quantization_config.group_size is {group_size!r}: expected a positive integer or -1")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"quantization_config.checkpoint_format is {fmt!r}: supported gptq, gptq_v2")
    if qc.get("dynamic"):
        raise ModelLoadError("quantization_config.dynamic (per-module GPTQ settings) is not supported")
    for key in ("desc_act", "sym"):
        if not isinstance(qc.get(key, False if key == "desc_act" else True), bool):
            raise ModelLoadError(f"quantization_config.{key} is {qc[key]!r}: expected true or false")
    return GptqScheme(bits, group_size, qc.get("desc_act", False), qc.get("sym", True),
                      zero_offset=1 if fmt == "gptq" else 0)
