"""The fused MoE experts for the GPU path: torch_experts' computation (engine/models/moe.py) in two grouped GEMMs.

The k (token, slot) pairs of each token are sorted by expert and laid out in blocks of BLOCK_M rows, each expert's
rows padded to a whole number of blocks (align_by_expert), so that every block belongs to one expert. The first
kernel runs over those blocks: x's rows of the block's pairs times the expert's gate and up rows (w13), SiLU of the
gate times the up, into a [pairs, I] buffer; the second multiplies that by the expert's w2 and by the pair's routing
weight, into a [pairs, H] buffer whose k rows of a token are then summed. Nothing reads a device value back to the
host (the grid is sized from the shapes, blocks past the last padded row return at once), so a CUDA graph can
capture it. The layout follows vLLM's fused_moe (moe_align_block_size and fused_moe_kernel); the activation is
fused into the first GEMM's epilogue instead of a separate kernel.

Rounding follows torch_experts step by step where it is a rounding of the model dtype: the gate and up products, the
SiLU and the product with the up, the down product, its product with the routing weight. The sums differ in order
(tiles instead of torch's matmul, the k slots summed at once instead of expert by expert), so bf16/fp16 results
agree with torch_experts to rounding, fp32 results to fp32 round-off.
"""

from __future__ import annotations

import torch

from kvgate.engine.triton_attention import HAS_TRITON


def interpreted_bf16(x: torch.Tensor) -> bool:
    """True for bf16 under Triton's interpreter (CPU tensors), whose tl.dot multiplies bf16 operands' bit patterns
    as integers and whose fp32 -> bf16 conversion truncates: the kernels then upcast the dot's operands (the same
    products: a bf16 product is exact in fp32) and round to bf16 themselves (round_to). The compiled kernels keep
    bf16 operands and the hardware conversion."""
    return x.dtype == torch.bfloat16 and x.device.type != "cuda"


if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def round_to(x, dtype: tl.constexpr, INTERPRETED_BF16: tl.constexpr):
        """fp32 x rounded to dtype (to nearest, ties to even), returned as fp32."""
        if INTERPRETED_BF16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        else:
            return x.to(dtype).to(tl.float32)

    @triton.jit
    def dot(a, b, acc, IEEE: tl.constexpr):
        """acc + a @ b; IEEE: fp32 operands multiplied in full fp32 (no TF32 rounding of the inputs)."""
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc)

    @triton.jit
    def _moe_gate_up_kernel(x_ptr, w_ptr, out_ptr, sorted_pairs_ptr, block_expert_ptr, num_padded_ptr, num_pairs,
                            H, I, stride_xt, stride_we, stride_wn, stride_wk, stride_ot, TOP_K: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            IEEE: tl.constexpr, INTERPRETED_BF16: tl.constexpr):
        pid_m = tl.program_id(0)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = pair < num_pairs  # padding rows hold num_pairs
        token = (pair // TOP_K).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < I
        offs_k = tl.arange(0, BLOCK_K)
        w_gate = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
        w_up = w_gate + I * stride_wn
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < H
            a = tl.load(x_ptr + token[:, None] * stride_xt + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w_ok = k_ok[:, None] & n_ok[None, :]
            gate = tl.load(w_gate + k[:, None] * stride_wk, mask=w_ok, other=0.0)
            up = tl.load(w_up + k[:, None] * stride_wk, mask=w_ok, other=0.0)
            if INTERPRETED_BF16:
                a, gate, up = a.to(tl.float32), gate.to(tl.float32), up.to(tl.float32)
            acc_gate = dot(a, gate, acc_gate, IEEE)
            acc_up = dot(a, up, acc_up, IEEE)
        dtype = out_ptr.dtype.element_ty
        gate = round_to(acc_gate, dtype, INTERPRETED_BF16)  # F.linear's result in the model dtype
        up = round_to(acc_up, dtype, INTERPRETED_BF16)
        act = round_to(gate / (1.0 + tl.exp(-gate)), dtype, INTERPRETED_BF16)  # F.silu's, rounded
        out = out_ptr + pair[:, None].to(tl.int64) * stride_ot + offs_n[None, :]
        tl.store(out, round_to(act * up, dtype, INTERPRETED_BF16).to(dtype), mask=row_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _moe_down_kernel(h_ptr, w_ptr, out_ptr, topk_weights_ptr, sorted_pairs_ptr, block_expert_ptr,
                         num_padded_ptr, num_pairs, H, I, stride_ht, stride_we, stride_wn, stride_wk, stride_ot,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         IEEE: tl.constexpr, INTERPRETED_BF16: tl.constexpr):
        pid_m = tl.program_id(0)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pair = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = pair < num_pairs
        rows = pair.to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < H
        offs_k = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < I
            a = tl.load(h_ptr + rows[:, None] * stride_ht + k[None, :], mask=row_ok[:, None] & k_ok[None, :],
                        other=0.0)
            w = tl.load(w_rows + k[:, None] * stride_wk, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if INTERPRETED_BF16:
                a, w = a.to(tl.float32), w.to(tl.float32)
            acc = dot(a, w, acc, IEEE)
        dtype = out_ptr.dtype.element_ty
        weight = tl.load(topk_weights_ptr + rows, mask=row_ok, other=0.0)
        # the expert's output in the model dtype times the routing weight in its own dtype, rounded once
        y = round_to(acc, dtype, INTERPRETED_BF16) * weight.to(tl.float32)[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + offs_n[None, :], round_to(y, dtype, INTERPRETED_BF16).to(dtype),
                 mask=row_ok[:, None] & n_ok[None, :])


def align_by_expert(topk_ids: torch.Tensor, num_experts: int,
                    block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) pairs sorted by expert in blocks of block_m rows, each expert's rows padded to whole
    blocks: (sorted_pairs [max_blocks * block_m] int32 - pair index token * k + slot, padding rows hold the number
    of pairs; block_expert [max_blocks] int32 - each block's expert; num_padded [1] int32 - the padded rows in use).
    max_blocks is the bound for any routing of these shapes, so nothing is read back to the host."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank = torch.arange(num_pairs, device=device) - start[expert_of]
    max_rows = num_pairs + min(num_pairs, num_experts) * (block_m - 1)
    max_blocks = -(-max_rows // block_m)
    sorted_pairs = torch.full((max_blocks * block_m,), num_pairs, dtype=torch.int32, device=device)
    sorted_pairs[padded_end[expert_of] - padded[expert_of] + rank] = order.to(torch.int32)
    block_starts = torch.arange(max_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_end, block_starts, right=True).clamp_(max=num_experts - 1)
    return sorted_pairs, block_expert.to(torch.int32), padded_end[-1:].to(torch.int32)


def _block_sizes(num_tokens: int, num_experts: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K), vLLM's defaults: while the tokens are no more than the experts (decode), short
    blocks, narrow enough that the few blocks still spread over the device; else taller, wider ones."""
    if num_tokens <= num_experts:
        return 16, 32, 64
    return 64, 64, 64


def triton_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                   topk_ids: torch.Tensor) -> torch.Tensor:
    """torch_experts (engine/models/moe.py) in two grouped-GEMM kernels. x: [T, H]; w13: [E, 2I, H] (gate rows, then
    up rows); w2: [E, H, I]; topk_weights/topk_ids: [T, k]. Returns [T, H] in x's dtype."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    if x.shape != (num_tokens, hidden) or w2.shape != (num_experts, hidden, inter) or two_inter != 2 * inter:
        raise ValueError(f"fused MoE: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)} and "
                         f"topk_ids {tuple(topk_ids.shape)} do not fit together")
    if num_tokens == 0:
        return torch.zeros_like(x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    num_pairs = num_tokens * top_k
    block_m, block_n, block_k = _block_sizes(num_tokens, num_experts)
    sorted_pairs, block_expert, num_padded = align_by_expert(topk_ids, num_experts, block_m)
    max_blocks = block_expert.numel()
    ieee = x.dtype == torch.float32  # fp32 models: no TF32 rounding of the inputs
    interpreted = interpreted_bf16(x)
    h = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    _moe_gate_up_kernel[(max_blocks, triton.cdiv(inter, block_n))](
        x, w13, h, sorted_pairs, block_expert, num_padded, num_pairs, hidden, inter, x.stride(0),
        w13.stride(0), w13.stride(1), w13.stride(2), h.stride(0), TOP_K=top_k, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, IEEE=ieee, INTERPRETED_BF16=interpreted, num_warps=4)
    y = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    _moe_down_kernel[(max_blocks, triton.cdiv(hidden, block_n))](
        h, w2, y, topk_weights.reshape(-1), sorted_pairs, block_expert, num_padded, num_pairs, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, IEEE=ieee, INTERPRETED_BF16=interpreted, num_warps=4)
    if top_k == 1:
        return y
    return y.view(num_tokens, top_k, hidden).sum(dim=1)
