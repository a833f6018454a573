"""Split-KV decode (flash-decoding): one-token-a-sequence attention over long contexts with the context cut into
splits, so that a small batch still fills the GPU.

triton_attention.py's kernel gives each (sequence, KV head) one program that walks the whole context serially: at
batch 1 with 8 KV heads that is 8 programs on a GPU of 132 SMs, and a 32k-token context is read by 8 SMs. Here the
grid is (sequences, KV heads, splits): a program attends its query heads (the G = H / Hkv heads of its KV head, as
rows of one tile, as triton_attention.py does) over one contiguous range of the context and writes the range's
softmax-normalised output with its log-sum-exp; a second kernel merges a sequence's splits exactly:
out = sum_s exp(lse_s - M) * o_s / sum_s exp(lse_s - M), M = max_s lse_s.

The split count of a launch is fixed (plan_splits: from the batch size, the KV heads and the SM count, so a
captured CUDA graph keeps one grid); each sequence cuts its own visible context (its sliding window's start to its
end) into at most that many ranges of at least min_split_tokens, whole tiles each, and the programs of splits it
does not use exit at once. A sequence that uses one split writes its output directly and the merge skips it, so
short contexts cost the merge kernel's launch and nothing else.

Features are triton_attention.py's decode kernel's: GQA/MQA (any group size), a sliding window, float32 inputs
with IEEE products, and the quantized cache (int8/fp8 values with a float32 scale per token and KV head,
dequantized as each tile is loaded). Steps with prefill chunks use triton_attention.py's kernels.
"""

from __future__ import annotations

import torch

from kvgate.engine.kv_quant import QuantizedKVCache
from kvgate.engine.triton_attention import DECODE_LAUNCH, HAS_TRITON, fit_shared_memory, next_power_of_2, query_tile

if HAS_TRITON:
    import triton
    import triton.language as tl

# plan_splits: programs to aim for per SM (two resident programs hide one's memory latency behind the other's), the
# most splits of one sequence, and the shortest range a split takes (shorter ones would spend more on the merge's
# partial outputs than they save).
PROGRAMS_PER_SM = 2
MAX_SPLITS = 32
MIN_SPLIT_TOKENS = 512
# The interpreter has no SMs; a count of 2 keeps CPU runs (the tests) on the split path at batch 1 (2 splits of a
# model with 2 KV heads) without idle programs the interpreter would run one by one.
CPU_SM_COUNT = 2


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return CPU_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def plan_splits(num_seqs: int, num_kv_heads: int, num_sms: int, max_splits: int = MAX_SPLITS) -> int:
    """Splits of a decode launch: enough (sequence, KV head, split) programs for PROGRAMS_PER_SM on every SM,
    ceil(target / (num_seqs * num_kv_heads)) clamped to [1, max_splits]. 1: the batch fills the GPU alone, and
    the step runs triton_attention.py's kernel. Depends on no sequence length (a captured graph's grid is fixed):
    each sequence's length decides how many of these splits it uses (split_ranges)."""
    if num_seqs < 1 or num_kv_heads < 1 or num_sms < 1 or max_splits < 1:
        raise ValueError(f"plan_splits needs positive counts, got {num_seqs=} {num_kv_heads=} {num_sms=} "
                         f"{max_splits=}")
    target = PROGRAMS_PER_SM * num_sms
    return max(1, min(max_splits, -(-target // (num_seqs * num_kv_heads))))


def split_ranges(seq_len: int, window: int | None, tile: int, num_splits: int,
                 min_split_tokens: int) -> list[tuple[int, int]]:
    """The [start, end) key ranges a sequence of seq_len tokens (its query the last) splits into: the kernels'
    arithmetic (_split_plan) in Python, for the tests and the docs."""
    begin = max(seq_len - window, 0) if window else 0
    aligned = begin // tile * tile
    tiles = -(-(seq_len - aligned) // tile)
    per = max(-(-tiles // num_splits), -(-min_split_tokens // tile), 1)
    used = -(-tiles // per)
    return [(max(aligned + s * per * tile, begin), min(aligned + (s + 1) * per * tile, seq_len)) for s in range(used)]


if HAS_TRITON:

    @triton.jit
    def _split_plan(seq_len, TILE: tl.constexpr, WINDOW: tl.constexpr, NUM_SPLITS: tl.constexpr,
                    MIN_SPLIT_TILES: tl.constexpr):
        """(first visible key, first key of split 0 (tile-aligned), keys a split, splits used) of a sequence."""
        begin = seq_len * 0
        if WINDOW > 0:
            begin = tl.maximum(seq_len - WINDOW, 0)
        aligned = begin // TILE * TILE
        tiles = (seq_len - aligned + TILE - 1) // TILE
        per = tl.maximum((tiles + NUM_SPLITS - 1) // NUM_SPLITS, MIN_SPLIT_TILES)
        used = (tiles + per - 1) // per
        return begin, aligned, per * TILE, used

    @triton.jit
    def _split_decode_kernel(
        q_ptr, o_ptr, part_o_ptr, part_lse_ptr, cache_ptr, scales_ptr, block_table_ptr, seq_lens_ptr,
        query_start_ptr, scale,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_po_s, stride_po_h, stride_po_k, stride_pl_s,
        stride_pl_h, stride_cache_kv, stride_cache_h, stride_cache_s, stride_scale_kv, stride_scale_h, stride_bt,
        G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr, QUANT: tl.constexpr,
        NUM_SPLITS: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr,
    ):
        seq = tl.program_id(0)
        kvh = tl.program_id(1).to(tl.int64)  # int64: cache strides can pass 2**31 (see triton_attention.py)
        split = tl.program_id(2)
        q_start = tl.load(query_start_ptr + seq)
        if tl.load(query_start_ptr + seq + 1) - q_start != 1:  # a graph's padding sequence (no query)
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        begin, aligned, per, used = _split_plan(seq_len, TILE, WINDOW, NUM_SPLITS, MIN_SPLIT_TILES)
        if split >= used:
            return
        kv_start = aligned + split * per
        kv_end = tl.minimum(kv_start + per, seq_len)

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        head = kvh * G + offs_m
        row_ok = offs_m < G
        d_ok = offs_d < D
        q = tl.load(q_ptr + q_start * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = cache_ptr + kvh * stride_cache_h
        v_base = k_base + stride_cache_kv
        ks_base = scales_ptr + kvh * stride_scale_h  # QUANT only: a float32 scale per slot
        vs_base = ks_base + stride_scale_kv
        for start in range(kv_start, kv_end, TILE):
            offs_n = start + tl.arange(0, TILE)
            n_ok = offs_n < kv_end
            block = tl.load(block_table_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
            k = tl.load(k_base + slot[None, :] * stride_cache_s + offs_d[:, None],
                        mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, TILE]
            if QUANT:
                k_scale = tl.load(ks_base + slot, mask=n_ok, other=0.0)
                k = (k.to(tl.float32) * k_scale[None, :]).to(q_ptr.dtype.element_ty)
            if IEEE:
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            s = s * scale
            visible = n_ok & (offs_n >= begin)  # the query is the last token: every key before it is causal
            s = tl.where(visible[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_base + slot[:, None] * stride_cache_s + offs_d[None, :],
                        mask=n_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE, BLOCK_D]
            if QUANT:
                v_scale = tl.load(vs_base + slot, mask=n_ok, other=0.0)
                v = (v.to(tl.float32) * v_scale[:, None]).to(q_ptr.dtype.element_ty)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        acc = acc / l_safe[:, None]
        ok = row_ok[:, None] & d_ok[None, :]
        if used == 1:  # the whole context in this program: the output itself, and the merge skips the sequence
            tl.store(o_ptr + q_start * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     acc.to(o_ptr.dtype.element_ty), mask=ok)
        else:
            tl.store(part_o_ptr + seq * stride_po_s + head[:, None] * stride_po_h + split * stride_po_k
                     + offs_d[None, :], acc, mask=ok)
            tl.store(part_lse_ptr + seq * stride_pl_s + head * stride_pl_h + split, m_i + tl.log(l_safe),
                     mask=row_ok)

    @triton.jit
    def _split_merge_kernel(
        o_ptr, part_o_ptr, part_lse_ptr, seq_lens_ptr, query_start_ptr,
        stride_ot, stride_oh, stride_po_s, stride_po_h, stride_po_k, stride_pl_s, stride_pl_h,
        D: tl.constexpr, BLOCK_D: tl.constexpr, TILE: tl.constexpr, WINDOW: tl.constexpr,
        NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, MIN_SPLIT_TILES: tl.constexpr,
    ):
        seq = tl.program_id(0)
        head = tl.program_id(1)
        q_start = tl.load(query_start_ptr + seq)
        if tl.load(query_start_ptr + seq + 1) - q_start != 1:
            return
        seq_len = tl.load(seq_lens_ptr + seq)
        begin, aligned, per, used = _split_plan(seq_len, TILE, WINDOW, NUM_SPLITS, MIN_SPLIT_TILES)
        if used <= 1:  # written by its only split
            return
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < used
        d_ok = offs_d < D
        lse = tl.load(part_lse_ptr + seq * stride_pl_s + head * stride_pl_h + offs_s, mask=s_ok,
                      other=float("-inf"))
        weight = tl.exp(lse - tl.max(lse, 0))  # every used split has seen a key: its lse is finite
        o = tl.load(part_o_ptr + seq * stride_po_s + head * stride_po_h + offs_s[:, None] * stride_po_k
                    + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :], other=0.0)
        out = tl.sum(o * weight[:, None], 0) / tl.sum(weight, 0)
        tl.store(o_ptr + q_start * stride_ot + head * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def split_decode_attention(
    q: torch.Tensor,  # [T, H, D]: row query_start_loc[i] is sequence i's one query token
    kv_cache: torch.Tensor | QuantizedKVCache,  # [2, Hkv, num_slots, D]
    out: torch.Tensor,  # [T, H, D]
    block_table: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32: tokens in the cache after this step, the query's included
    query_start_loc: torch.Tensor,  # [S + 1] int32 (padding sequences: query length 0)
    *,
    scale: float,
    block_size: int,
    num_splits: int,
    sliding_window: int | None = None,
    min_split_tokens: int | None = None,
    tile: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Decode attention of every one-token sequence of a step (sequences of other query lengths are skipped, as
    triton_attention.paged_attention's only=1 skips them), the context of each cut into up to num_splits ranges
    of at least min_split_tokens (None: MIN_SPLIT_TOKENS; rounded up to whole tiles). tile / num_warps /
    num_stages: launch settings (None: triton_attention.DECODE_LAUNCH)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[1]
    g = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m, _ = query_tile(g, decode_only=True)
    block_d = max(16, next_power_of_2(head_dim))
    tile, num_stages = fit_shared_memory(tile or DECODE_LAUNCH["tile"], num_stages or DECODE_LAUNCH["num_stages"],
                                         block_d, q.element_size(), q.device)
    min_split_tiles = max(1, -(-(min_split_tokens or MIN_SPLIT_TOKENS) // tile))
    # float32 partials: one output row and one log-sum-exp per (sequence, head, split)
    part_o = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    quant = isinstance(kv_cache, QuantizedKVCache)
    data, scales = (kv_cache.values(), kv_cache.scales) if quant else (kv_cache, kv_cache)  # unread if not quant
    window = sliding_window or 0
    _split_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, out, part_o, part_lse, data, scales, block_table, seq_lens, query_start_loc, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), part_o.stride(0), part_o.stride(1), part_o.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        data.stride(0), data.stride(1), data.stride(2), scales.stride(0), scales.stride(1), block_table.stride(0),
        G=g, D=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_SIZE=block_size, TILE=tile, WINDOW=window,
        IEEE=q.dtype == torch.float32, QUANT=quant, NUM_SPLITS=num_splits, MIN_SPLIT_TILES=min_split_tiles,
        num_warps=num_warps or DECODE_LAUNCH["num_warps"], num_stages=num_stages,
    )
    if num_splits > 1:
        _split_merge_kernel[(num_seqs, num_heads)](
            out, part_o, part_lse, seq_lens, query_start_loc, out.stride(0), out.stride(1),
            part_o.stride(0), part_o.stride(1), part_o.stride(2), part_lse.stride(0), part_lse.stride(1),
            D=head_dim, BLOCK_D=block_d, TILE=tile, WINDOW=window, NUM_SPLITS=num_splits,
            BLOCK_S=next_power_of_2(num_splits), MIN_SPLIT_TILES=min_split_tiles, num_warps=1)
    return out
