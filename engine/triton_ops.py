"""Fused elementwise kernels for the GPU path: RMSNorm, RoPE on queries and keys, SiLU-and-multiply.

Each replaces a chain of small torch kernels (RMSNorm: upcast, square, mean, rsqrt, two products, downcast; RoPE: two
table lookups, two casts, two half-rotations built with cat and neg, four products, two sums) by one launch. Fewer
launches and fewer round trips through GPU memory cut most of the GPU time outside attention (`python -m
tests.engine.gpu_profile engine` prints it with torch.profiler). Rounding follows HF transformers' torch code step by
step (each torch op's result rounded to the model dtype where torch rounds it), so bf16 outputs stay HF's.

Used only where the Triton attention path runs (model_runner: CUDA, or the interpreter in tests); the CPU path
keeps layers.py's torch ops.
"""

from __future__ import annotations

import torch

from kvgate.engine.triton_attention import HAS_TRITON, next_power_of_2

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_xt, stride_xh, eps, H: tl.constexpr, N: tl.constexpr,
                         BLOCK_H: tl.constexpr, BLOCK: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)  # one token: its H rows of x [T, H, N]; out is contiguous
        h = tl.arange(0, BLOCK_H)[:, None]
        offs = tl.arange(0, BLOCK)[None, :]
        ok = (h < H) & (offs < N)
        x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs, mask=ok, other=0.0).to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(x * x, 1) / N + eps)
        normed = (x * rstd[:, None]).to(out_ptr.dtype.element_ty)  # HF: hidden.to(input_dtype), then weight * it
        w = tl.load(w_ptr + offs, mask=offs < N, other=0.0)
        y = w.to(tl.float32) * normed.to(tl.float32)
        tl.store(out_ptr + t * (H * N) + h * N + offs, y.to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rope_heads(src, dst, stride_h, stride_oh, c1, c2, s1, s2, NH: tl.constexpr, D: tl.constexpr,
                    HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr):
        h = tl.arange(0, BLOCK_H)[:, None]
        i = tl.arange(0, BLOCK_HALF)[None, :]
        ok = (h < NH) & (i < HALF)
        dtype = dst.dtype.element_ty
        x1 = tl.load(src + h * stride_h + i, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(src + h * stride_h + HALF + i, mask=ok, other=0.0).to(tl.float32)
        # neox layout over the rotary part: out1 = x1*cos - x2*sin, out2 = x2*cos + x1*sin, each product and sum
        # rounded to the model dtype as torch rounds `x * cos + rotate_half(x) * sin`.
        a1 = (x1 * c1).to(dtype).to(tl.float32)
        b1 = ((-x2) * s1).to(dtype).to(tl.float32)
        a2 = (x2 * c2).to(dtype).to(tl.float32)
        b2 = (x1 * s2).to(dtype).to(tl.float32)
        tl.store(dst + h * stride_oh + i, (a1 + b1).to(dtype), mask=ok)
        tl.store(dst + h * stride_oh + HALF + i, (a2 + b2).to(dtype), mask=ok)
        if 2 * HALF < D:  # partial rotary: the rest passes through
            j = 2 * HALF + tl.arange(0, BLOCK_REST)[None, :]
            rest = (h < NH) & (j < D)
            tl.store(dst + h * stride_oh + j, tl.load(src + h * stride_h + j, mask=rest), mask=rest)

    @triton.jit
    def _rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, pos_ptr, cos_ptr, sin_ptr,
                     stride_qt, stride_qh, stride_kt, stride_kh, stride_qot, stride_qoh, stride_kot, stride_koh,
                     stride_table, HQ: tl.constexpr, HK: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                     BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     BLOCK_REST: tl.constexpr):
        t = tl.program_id(0).to(tl.int64)  # one token: all its query and key heads
        pos = tl.load(pos_ptr + t)
        dtype = q_out_ptr.dtype.element_ty
        i = tl.arange(0, BLOCK_HALF)[None, :]
        ok = i < HALF
        row = pos * stride_table
        c1 = tl.load(cos_ptr + row + i, mask=ok, other=0.0).to(dtype).to(tl.float32)
        c2 = tl.load(cos_ptr + row + HALF + i, mask=ok, other=0.0).to(dtype).to(tl.float32)
        s1 = tl.load(sin_ptr + row + i, mask=ok, other=0.0).to(dtype).to(tl.float32)
        s2 = tl.load(sin_ptr + row + HALF + i, mask=ok, other=0.0).to(dtype).to(tl.float32)
        _rope_heads(q_ptr + t * stride_qt, q_out_ptr + t * stride_qot, stride_qh, stride_qoh, c1, c2, s1, s2,
                    HQ, D, HALF, BLOCK_HQ, BLOCK_HALF, BLOCK_REST)
        _rope_heads(k_ptr + t * stride_kt, k_out_ptr + t * stride_kot, stride_kh, stride_koh, c1, c2, s1, s2,
                    HK, D, HALF, BLOCK_HK, BLOCK_HALF, BLOCK_REST)

    @triton.jit
    def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_out, N, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        gate = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + N + offs, mask=ok, other=0.0)
        dtype = out_ptr.dtype.element_ty
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # torch's silu, rounded as F.silu's result is
        y = act.to(tl.float32) * up.to(tl.float32)
        tl.store(out_ptr + row * stride_out + offs, y.to(dtype), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x: [T, N] or [T, H, N] (per-head norms over a strided view of the fused qkv
    output: no copy), last dim contiguous. Returns a contiguous tensor of x's shape."""
    x3 = x if x.dim() == 3 else x.view(x.shape[0], 1, x.shape[-1])
    num_tokens, heads, n = x3.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if num_tokens:
        _rms_norm_kernel[(num_tokens,)](x3, weight, out, x3.stride(0), x3.stride(1), eps, H=heads, N=n,
                                        BLOCK_H=next_power_of_2(heads), BLOCK=next_power_of_2(n),
                                        num_warps=4 if heads * n >= 1024 else 1)
    return out


def rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style RoPE of q [T, H, D] and k [T, Hkv, D] at positions [T]; cos/sin: [max_positions, rotary_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                         device=k.device)
    if num_tokens:
        half = rotary_dim // 2
        _rope_kernel[(num_tokens,)](
            q, k, q_out, k_out, positions, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos.stride(0),
            HQ=num_heads, HK=k.shape[1], D=head_dim, HALF=half, BLOCK_HQ=next_power_of_2(num_heads),
            BLOCK_HK=next_power_of_2(k.shape[1]), BLOCK_HALF=next_power_of_2(half),
            BLOCK_REST=next_power_of_2(max(head_dim - rotary_dim, 1)), num_warps=4)
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate, up) -> [T, I] = silu(gate) * up."""
    num_tokens, width = x.shape
    n = width // 2
    out = torch.empty((num_tokens, n), dtype=x.dtype, device=x.device)
    if num_tokens:
        block = min(1024, next_power_of_2(n))
        _silu_and_mul_kernel[(num_tokens, -(-n // block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block,
                                                           num_warps=4)
    return out
