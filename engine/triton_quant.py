"""GEMMs over quantized weights for the GPU path: int4/int8 weight-only (GPTQ, AWQ, compressed-tensors W4A16/W8A16
repacked at load into the layout below) and FP8 (float8_e4m3fn) weights with per-tensor, per-channel or block-wise
scales. The weights stay quantized in GPU memory; each kernel dequantizes its tiles in registers and multiplies them
with the activations in the activations' dtype, accumulating in fp32.

The canonical int layout (what loaders repack into):
  qweight  bits 8: uint8 [N, K] (int8 tensors are read as their uint8 bit pattern);
           bits 4: uint8 [N, K // 2], two values a byte, the low nibble the even k (pack_int4)
  scales   [N, K // group_size] in the activations' dtype
  zeros    [N, K // group_size] integers (int8 read as uint8, as qweight), or None: symmetric, 2**(bits - 1)
  w[n, k] = (q[n, k] - zero[n, k // group_size]) * scale[n, k // group_size]
The FP8 layout: w_fp8 [N, K] float8_e4m3fn; w_scale a scalar (per tensor), [N] (per channel), or, with block_size
(bn, bk), [ceil(N / bn), ceil(K / bk)] (DeepSeek-V3's and Qwen3-FP8's weight_scale_inv); w[n, k] = w_fp8[n, k] *
scale. On devices of compute capability 8.9 and newer a per-tensor or per-channel FP8 weight runs through
torch._scaled_mm instead, the activations quantized to FP8 per token on the fly (fp8_scaled_mm).

Dequantized weights round as the torch references (dequantize_int_weight, dequantize_fp8_weight) round them: the
product of the integer (or FP8 value) and its scale in fp32, rounded once to the activations' dtype.
"""

from __future__ import annotations

import torch

from kvgate.engine.triton_attention import HAS_TRITON
from kvgate.engine.triton_moe import interpreted_bf16

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value

# the weight formats the kernel decodes
_INT8, _INT4, _FP8, _FP8_BITS = 0, 1, 2, 3

if HAS_TRITON:
    import triton
    import triton.language as tl

    from kvgate.engine.triton_moe import dot, round_to

    @triton.jit
    def _decode_e4m3(byte):
        """float8_e4m3fn bit patterns (uint8) -> fp32, in integer arithmetic: for devices whose Triton has no
        fp8e4nv conversion (compute capability below 8.9)."""
        u = byte.to(tl.int32)
        exponent = (u >> 3) & 15
        mantissa = (u & 7).to(tl.float32)
        normal = (8.0 + mantissa) * tl.exp2(exponent.to(tl.float32) - 10.0)  # (1 + m/8) * 2**(e - 7)
        value = tl.where(exponent == 0, mantissa * 0.001953125, normal)  # subnormals: m/8 * 2**-6
        value = tl.where((u & 127) == 127, float("nan"), value)
        return tl.where((u & 128) != 0, -value, value)

    @triton.jit
    def _weight_gemm_kernel(x_ptr, w_ptr, scale_ptr, zero_ptr, out_ptr, M, N, K, stride_xm, stride_wn,
                            stride_sn, stride_sk, stride_zn, stride_zk, stride_om, GROUP_N, GROUP_K,
                            FORMAT: tl.constexpr, HAS_ZEROS: tl.constexpr, ZERO: tl.constexpr,
                            SCALE_PER_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                            BLOCK_K: tl.constexpr, IEEE: tl.constexpr, INTERPRETED_BF16: tl.constexpr):
        """out = x @ dequant(w)^T, one [BLOCK_M, BLOCK_N] tile of out a program. Scales are indexed
        [n // GROUP_N, k // GROUP_K] through their strides (0 for a broadcast axis); SCALE_PER_TILE: a K tile lies in
        one scale group, so one scale row serves the whole tile."""
        offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok, n_ok = offs_m < M, offs_n < N
        n64 = offs_n.to(tl.int64)
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
        w_cols = w_ptr + n64[None, :] * stride_wn
        scale_cols = scale_ptr + (n64 // GROUP_N)[None, :] * stride_sn
        dtype = x_ptr.dtype.element_ty
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < K
            w_ok = k_ok[:, None] & n_ok[None, :]
            a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            if FORMAT == 1:  # int4: byte k // 2, the low nibble for even k
                byte = tl.load(w_cols + (k // 2)[:, None], mask=w_ok, other=0).to(tl.int32)
                q = (byte >> ((k % 2) * 4)[:, None]) & 15
            elif FORMAT == 0:
                q = tl.load(w_cols + k[:, None], mask=w_ok, other=0).to(tl.int32)
            elif FORMAT == 2:
                q = tl.load(w_cols + k[:, None], mask=w_ok, other=0.0).to(tl.float32)
            else:
                q = _decode_e4m3(tl.load(w_cols + k[:, None], mask=w_ok, other=0))
            group = k // GROUP_K
            if SCALE_PER_TILE:
                s_ok = n_ok[None, :]
                s_idx = (k0 // GROUP_K) * stride_sk
                z_idx = (k0 // GROUP_K) * stride_zk
            else:
                s_ok = w_ok
                s_idx = group[:, None] * stride_sk
                z_idx = group[:, None] * stride_zk
            scale = tl.load(scale_cols + s_idx, mask=s_ok, other=0.0).to(tl.float32)
            if FORMAT < 2:
                if HAS_ZEROS:
                    zero = tl.load(zero_ptr + n64[None, :] * stride_zn + z_idx, mask=s_ok, other=0).to(tl.int32)
                    q = q - zero
                else:
                    q = q - ZERO
            w = round_to(q.to(tl.float32) * scale, dtype, INTERPRETED_BF16)
            if INTERPRETED_BF16:
                a = a.to(tl.float32)
            else:
                w = w.to(dtype)
            acc = dot(a, w, acc, IEEE)
        out = round_to(acc, dtype, INTERPRETED_BF16).to(dtype)
        tl.store(out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :], out,
                 mask=m_ok[:, None] & n_ok[None, :])


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] of values 0..15 (K even) -> uint8 [N, K // 2], the low nibble the even k."""
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4: K ({q.shape[-1]}) must be even")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4's inverse: uint8 [N, K // 2] -> uint8 [N, K]."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).flatten(-2)


def _int_values(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 4:
        return unpack_int4(qweight.view(torch.uint8))
    return qweight.view(torch.uint8)


def dequantize_int_weight(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
                          group_size: int) -> torch.Tensor:
    """The torch reference: [N, K] weights in scales' dtype, (q - zero) * scale per group of group_size along K."""
    q = _int_values(qweight, bits).to(torch.int32)
    if zeros is not None and zeros.dtype == torch.int8:
        zeros = zeros.view(torch.uint8)
    zero = torch.full_like(scales, 2 ** (bits - 1), dtype=torch.int32) if zeros is None else zeros.to(torch.int32)
    expand = lambda t: t.repeat_interleave(group_size, dim=1)  # noqa: E731 - [N, K // g] -> [N, K]
    return ((q - expand(zero)).float() * expand(scales).float()).to(scales.dtype)


def fp8_scale_grid(w_scale: torch.Tensor, shape: tuple[int, int],
                   block_size: tuple[int, int] | None) -> tuple[torch.Tensor, int, int, int, int]:
    """w_scale as (fp32 tensor, stride over n groups, stride over k groups, group_n, group_k): per tensor,
    per channel or block-wise (scale[n // bn, k // bk]); a clear error for any other shape."""
    n, k = shape
    scale = w_scale.float().contiguous()
    if block_size is not None:
        bn, bk = block_size
        grid = (-(-n // bn), -(-k // bk))
        if tuple(scale.shape) != grid:
            raise ValueError(f"fp8 block-wise scale: expected {list(grid)} for weight {[n, k]} and block "
                             f"{[bn, bk]}, got {list(scale.shape)}")
        return scale, scale.stride(0), scale.stride(1), bn, bk
    if scale.numel() == 1:
        return scale.reshape(1), 0, 0, 1, 1
    if scale.numel() == n and (scale.dim() == 1 or scale.shape[-1] == 1):
        return scale.reshape(n), 1, 0, 1, 1
    raise ValueError(f"fp8 weight scale of shape {list(w_scale.shape)} is neither per tensor, per channel [{n}] "
                     f"nor block-wise (no block_size) for weight {[n, k]}")


def dequantize_fp8_weight(w_fp8: torch.Tensor, w_scale: torch.Tensor, block_size: tuple[int, int] | None,
                          dtype: torch.dtype) -> torch.Tensor:
    """The torch reference: [N, K] weights in dtype, the FP8 values times their scales in fp32, rounded once."""
    n, k = w_fp8.shape
    scale, _, _, bn, bk = fp8_scale_grid(w_scale, (n, k), block_size)
    if block_size is not None:
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    else:
        full = scale.reshape(-1, 1)
    return (w_fp8.float() * full).to(dtype)


def _block_sizes(m: int, group_k: int | None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K): the fewest rows that hold M (decode: 16), K tiles inside one scale group."""
    block_m = 16 if m <= 16 else 32 if m <= 32 else 64
    block_k = 64
    if group_k is not None and group_k % 64:
        block_k = 32 if group_k % 32 == 0 else 16 if group_k % 16 == 0 else 64
    return block_m, 64, block_k


def _launch(x, w, fmt, scale, stride_sn, stride_sk, group_n, group_k, zeros, zero, n, k, scale_per_tile=None):
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"quantized GEMM: x {list(x.shape)} does not fit a weight of {k} input features")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"quantized GEMM: activations in {x.dtype}; expected float16, bfloat16 or float32")
    x = x if x.stride(-1) == 1 else x.contiguous()
    m = x.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_m, block_n, block_k = _block_sizes(m, group_k if stride_sk else None)
    if scale_per_tile is None:
        scale_per_tile = stride_sk == 0 or group_k % block_k == 0
    zero_t = zeros if zeros is not None else scale
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _weight_gemm_kernel[grid](
        x, w, scale, zero_t, out, m, n, k, x.stride(0), w.stride(0), stride_sn, stride_sk,
        zero_t.stride(0) if zeros is not None else 0, zero_t.stride(1) if zeros is not None else 0, out.stride(0),
        group_n, group_k, FORMAT=fmt, HAS_ZEROS=zeros is not None, ZERO=zero, SCALE_PER_TILE=scale_per_tile,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=x.dtype == torch.float32,
        INTERPRETED_BF16=interpreted_bf16(x), num_warps=4)
    return out


def int_weight_gemm(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    bits: int, group_size: int) -> torch.Tensor:
    """x [M, K] @ dequantize_int_weight(...)^T -> [M, N] in x's dtype, the weights dequantized in the kernel."""
    if bits not in (4, 8):
        raise ValueError(f"int weight GEMM: bits must be 4 or 8, got {bits}")
    n = qweight.shape[0]
    k = qweight.shape[1] * (2 if bits == 4 else 1)
    if qweight.dtype not in (torch.uint8, torch.int8):
        raise ValueError(f"int weight GEMM: qweight must be uint8 (or int8), got {qweight.dtype}")
    if group_size <= 0 or k % group_size or tuple(scales.shape) != (n, k // group_size):
        raise ValueError(f"int weight GEMM: scales {list(scales.shape)} do not fit weight [{n}, {k}] in groups "
                         f"of {group_size}")
    if zeros is not None and tuple(zeros.shape) != tuple(scales.shape):
        raise ValueError(f"int weight GEMM: zeros {list(zeros.shape)} differ from scales {list(scales.shape)}")
    w = qweight.view(torch.uint8)
    if zeros is not None and zeros.dtype == torch.int8:
        zeros = zeros.view(torch.uint8)  # 8-bit zero points up to 255 in int8 storage
    if w.stride(-1) != 1:
        w = w.contiguous()
    return _launch(x, w, _INT4 if bits == 4 else _INT8, scales, scales.stride(0), scales.stride(1), 1, group_size,
                   zeros, 2 ** (bits - 1), n, k)


def fp8_weight_gemm(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                    block_size: tuple[int, int] | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize_fp8_weight(...)^T -> [M, N] in x's dtype: torch._scaled_mm on devices that have it
    for per-tensor/per-channel scales (fp8_scaled_mm), else the Triton kernel (weight-only)."""
    if w_fp8.dtype != torch.float8_e4m3fn or w_fp8.dim() != 2:
        raise ValueError(f"fp8 weight GEMM: expected a 2-D float8_e4m3fn weight, got {w_fp8.dtype} "
                         f"{list(w_fp8.shape)}")
    if block_size is None and scaled_mm_supported(x, w_fp8):
        return fp8_scaled_mm(x, w_fp8, w_scale)
    return fp8_triton_gemm(x, w_fp8, w_scale, block_size)


def fp8_triton_gemm(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                    block_size: tuple[int, int] | None = None, decode_bits: bool | None = None) -> torch.Tensor:
    """The Triton kernel of fp8_weight_gemm. decode_bits: decode the FP8 bit patterns in integer arithmetic
    instead of Triton's fp8e4nv conversion (default: where the device lacks it, compute capability below 8.9)."""
    n, k = w_fp8.shape
    scale, stride_sn, stride_sk, group_n, group_k = fp8_scale_grid(w_scale.to(x.device), (n, k), block_size)
    if decode_bits is None:
        decode_bits = x.is_cuda and torch.cuda.get_device_capability(x.device) < (8, 9)
    w = w_fp8.view(torch.uint8) if decode_bits else w_fp8
    if w.stride(-1) != 1:
        w = w.contiguous()
    return _launch(x, w, _FP8_BITS if decode_bits else _FP8, scale, stride_sn, stride_sk, group_n, group_k, None, 0,
                   n, k)


def scaled_mm_supported(x: torch.Tensor, w_fp8: torch.Tensor) -> bool:
    """torch._scaled_mm with per-token activation scales (rowwise): CUDA devices of compute capability 9.0 and up,
    bf16 outputs, both GEMM sizes multiples of 16. (8.9 devices have FP8 tensor cores but torch's rowwise-scaled
    FP8 GEMM needs 9.0; tensor-wise activation scales on 8.9 would quantize every token by the batch's largest.)"""
    return (x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and x.shape[1] % 16 == 0 and w_fp8.shape[0] % 16 == 0 and hasattr(torch, "_scaled_mm"))


def fp8_scaled_mm(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x quantized to FP8 per token (its row's largest magnitude to FP8_MAX), then one FP8 GEMM with both scales
    applied to the fp32 accumulator: x @ (w_fp8 * w_scale)^T up to the activations' FP8 rounding."""
    n = w_fp8.shape[0]
    x_scale = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp_(min=1e-12)
    x_fp8 = (x.float() / x_scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    w_scale_row = w_scale.float().reshape(-1).expand(n).reshape(1, n).contiguous()
    return torch._scaled_mm(x_fp8, w_fp8.t(), scale_a=x_scale, scale_b=w_scale_row, out_dtype=x.dtype)
