"""Paged attention in Triton: one kernel stores a step's K/V into the cache, one kernel attends for every query
token of the step — decodes, whole prefills and chunks over a cached prefix alike — reading each sequence's
block table inside the kernel (no gathered copies, no per-length groups).

The cache layout is attention.py's: per layer [2 (K, V), num_kv_heads, num_blocks * block_size, head_dim], token
`p` of a sequence in slot `block_table[p // block_size] * block_size + p % block_size`.

The attention kernel's grid is (query blocks, KV heads). A program takes BLOCK_Q query tokens of one sequence and
the G = H / Hkv query heads that share its KV head, as BLOCK_M = BLOCK_Q * G rows of one tile, so a KV tile read
from memory serves every query head of its group (GQA costs no extra reads). Sequence `i`'s query blocks start at
index `query_start_loc[i] // BLOCK_Q + i`, an upper bound on the blocks before it that needs no prefix sum over
the batch; a program finds its sequence by binary search over query_start_loc, and programs past a sequence's last
query block exit at once. The grid therefore depends only on the number of tokens and of sequences, both fixed by
the padded shapes of a captured CUDA graph, so the same launch serves any mix of decodes and prefills in a graph.

Softmax is online (FlashAttention's running max and sum) in float32; float32 inputs use IEEE products (tf32 would
break token parity with HF in float32).

A quantized cache (kv_quant.py: int8 or fp8 values, a float32 scale per token and KV head) is quantized by its own
store kernel and dequantized inside the attention kernel as each K/V tile is loaded (QUANT), never copied out.

On CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported), which is how
the test suite checks them against the SDPA path without a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvgate.engine.kv_quant import QuantizedKVCache

try:
    import triton
    import triton.language as tl
except ImportError:  # the SDPA path (attention.py) serves without Triton
    triton = None
    tl = None

HAS_TRITON = triton is not None


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def query_tile(num_queries_per_kv: int, decode_only: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): rows of one program's query tile and the query tokens they hold. Decodes have one query
    token a sequence, so the tile is as small as a tensor-core product allows; prefills take 64-row tiles."""
    g = next_power_of_2(num_queries_per_kv)
    block_m = max(16, g) if decode_only else max(64, g)
    return block_m, block_m // g


# Launch settings. Decode: the fastest of the tiles, warps and stages `python -m tests.engine.gpu_profile attention`
# sweeps (bf16, 16 heads / 8 KV heads, head_dim 128, 256 sequences of mixed length); one stage leaves the gathers
# without overlap, and more warps or smaller tiles were slower.
DECODE_LAUNCH = {"tile": 128, "num_warps": 4, "num_stages": 3}
# Prefill tiles (64 query rows) were not swept yet: 64 keys a tile, 8 warps, 2 stages.
PREFILL_LAUNCH = {"tile": 64, "num_warps": 8, "num_stages": 2}


@functools.lru_cache(maxsize=None)
def _shared_memory_limit(device: torch.device) -> int:
    if device.type != "cuda":
        return 1 << 30  # the interpreter has no such limit
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", 0) or 96 * 1024


def fit_shared_memory(tile: int, stages: int, block_d: int, elem: int, device: torch.device) -> tuple[int, int]:
    """The largest (tile, stages) up to the asked ones whose pipelined K and V tiles fit the device's shared memory
    (float32 or head_dim 256 would not fit the bf16 decode setting), keeping 16 KiB for the rest of the kernel."""
    return fit_tiles(tile, stages, block_d, elem, _shared_memory_limit(device))


def fit_tiles(tile: int, stages: int, block_d: int, elem: int, shared_memory: int) -> tuple[int, int]:
    """fit_shared_memory for a given shared memory a block (bytes): what the compile check uses per architecture."""
    limit = shared_memory - 16 * 1024
    while stages * 2 * tile * block_d * elem > limit and (tile > 32 or stages > 1):
        if tile > 32:
            tile //= 2
        else:
            stages -= 1
    return tile, stages


def grid_size(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Query-block programs for a step: enough for any split of num_tokens into num_seqs sequences."""
    return num_tokens // block_q + num_seqs


if HAS_TRITON:

    @triton.jit
    def _store_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cache_kv, stride_cache_h, stride_cache_s,
                         D: tl.constexpr, BLOCK_D: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)  # see below: cache strides can pass 2**31
        slot = tl.load(slot_ptr + t)
        if slot < 0:  # a padding token of a captured graph
            return
        offs = tl.arange(0, BLOCK_D)
        ok = offs < D
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs, mask=ok)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs, mask=ok)
        dst = cache_ptr + h * stride_cache_h + slot * stride_cache_s + offs
        tl.store(dst, k, mask=ok)
        tl.store(dst + stride_cache_kv, v, mask=ok)

    @triton.jit
    def _round_half_even(x):
        # 1.5 * 2**23: adding it leaves no fraction bits, so the add rounds to an integer (to even) for |x| < 2**22;
        # libdevice's rint is not available under the interpreter.
        return (x + 12582912.0) - 12582912.0

    @triton.jit
    def _quantize(x, dtype: tl.constexpr, QMAX: tl.constexpr, FP8_MANTISSA: tl.constexpr, FP8_EMIN: tl.constexpr):
        """One head vector x [BLOCK_D] float32 (masked lanes 0) -> (values in dtype, float32 scale), kv_quant.py's
        arithmetic: IEEE divisions, round half to even."""
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 0), 1e-12), QMAX)
        y = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -QMAX), QMAX)
        if FP8_MANTISSA == 0:  # int8
            return _round_half_even(y).to(dtype), scale
        # fp8: round to the fp8 grid in float32 first (the spacing at |y|'s exponent, subnormals below the smallest
        # normal exponent), so the conversion is exact: the interpreter's float32 -> fp8 conversion rounds wrongly
        # when rounding carries into the exponent.
        a = tl.abs(y)
        e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, FP8_EMIN)
        inv_ulp = ((127 + FP8_MANTISSA - e) << 23).to(tl.float32, bitcast=True)  # 2**(mantissa - e), exact
        ulp = ((127 - FP8_MANTISSA + e) << 23).to(tl.float32, bitcast=True)
        r = _round_half_even(a * inv_ulp) * ulp
        return tl.where(y < 0, -r, r).to(dtype), scale

    @triton.jit
    def _store_kv_quant_kernel(k_ptr, v_ptr, cache_ptr, scales_ptr, slot_ptr, stride_kt, stride_kh, stride_vt,
                               stride_vh, stride_cache_kv, stride_cache_h, stride_cache_s, stride_scale_kv,
                               stride_scale_h, D: tl.constexpr, BLOCK_D: tl.constexpr, QMAX: tl.constexpr,
                               FP8_MANTISSA: tl.constexpr, FP8_EMIN: tl.constexpr):
        """_store_kv_kernel for a quantized cache (kv_quant.py): each head vector with its own scale."""
        t = tl.program_id(0)
        h = tl.program_id(1).to(tl.int64)
        slot = tl.load(slot_ptr + t)
        if slot < 0:
            return
        offs = tl.arange(0, BLOCK_D)
        ok = offs < D
        dtype = cache_ptr.dtype.element_ty
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + offs, mask=ok, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + offs, mask=ok, other=0.0).to(tl.float32)
        kq, ks = _quantize(k, dtype, QMAX, FP8_MANTISSA, FP8_EMIN)
        vq, vs = _quantize(v, dtype, QMAX, FP8_MANTISSA, FP8_EMIN)
        dst = cache_ptr + h * stride_cache_h + slot * stride_cache_s + offs
        tl.store(dst, kq, mask=ok)
        tl.store(dst + stride_cache_kv, vq, mask=ok)
        scale_dst = scales_ptr + h * stride_scale_h + slot
        tl.store(scale_dst, ks)
        tl.store(scale_dst + stride_scale_kv, vs)

    @triton.jit(do_not_specialize=["num_seqs"])
    def _paged_attention_kernel(
        q_ptr, o_ptr, cache_ptr, scales_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr, scale, num_seqs,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cache_kv, stride_cache_h, stride_cache_s,
        stride_scale_kv, stride_scale_h, stride_bt,
        G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, WINDOW: tl.constexpr, IEEE: tl.constexpr,
        ONLY: tl.constexpr, QUANT: tl.constexpr,
    ):
        qb = tl.program_id(0)
        # int64: a cache stride between 2**31 and 2**32 reaches the kernel as uint32 (Triton types arguments by
        # value), and a product of it in 32 bits wraps — an illegal address once the cache passes 4 GiB a head.
        kvh = tl.program_id(1).to(tl.int64)
        # The sequence whose query blocks hold qb: the last i with query_start[i] // BLOCK_Q + i <= qb.
        lo: tl.int32 = 0
        hi: tl.int32 = num_seqs
        while lo < hi:
            mid = (lo + hi) // 2
            if tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= qb:
                lo = mid + 1
            else:
                hi = mid
        seq = lo - 1
        q_start = tl.load(query_start_ptr + seq)
        q_len = tl.load(query_start_ptr + seq + 1) - q_start
        local = qb - (q_start // BLOCK_Q + seq)
        if local * BLOCK_Q >= q_len:
            return
        if ONLY == 1:  # this launch serves the one-token sequences (decode tile)
            if q_len != 1:
                return
        if ONLY == 2:  # this launch serves the multi-token sequences (prefill tile)
            if q_len == 1:
                return
        seq_len = tl.load(seq_lens_ptr + seq)
        cached = seq_len - q_len  # tokens before this step's chunk

        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        q_idx = local * BLOCK_Q + offs_m // G
        head = kvh * G + offs_m % G
        row_ok = (q_idx < q_len) & (offs_m < BLOCK_Q * G)
        d_ok = offs_d < D
        q = tl.load(q_ptr + (q_start + q_idx)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        q_pos = cached + q_idx

        # Keys this tile of queries can see: causal up to its last query, from the window's start.
        kv_end = cached + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len)
        kv_begin = 0
        if WINDOW > 0:
            kv_begin = tl.maximum(cached + local * BLOCK_Q - WINDOW + 1, 0) // TILE * TILE

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = cache_ptr + kvh * stride_cache_h
        v_base = k_base + stride_cache_kv
        ks_base = scales_ptr + kvh * stride_scale_h  # QUANT only: a float32 scale per slot
        vs_base = ks_base + stride_scale_kv
        for start in range(kv_begin, kv_end, TILE):
            offs_n = start + tl.arange(0, TILE)
            n_ok = offs_n < kv_end
            block = tl.load(block_table_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_ok, other=0)
            slot = block.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
            k = tl.load(k_base + slot[None, :] * stride_cache_s + offs_d[:, None],
                        mask=n_ok[None, :] & d_ok[:, None], other=0.0)  # [BLOCK_D, TILE]
            if QUANT:  # dequantized in registers, in the query's dtype for the dot
                k_scale = tl.load(ks_base + slot, mask=n_ok, other=0.0)
                k = (k.to(tl.float32) * k_scale[None, :]).to(q_ptr.dtype.element_ty)
            if IEEE:
                s = tl.dot(q, k, input_precision="ieee")
            else:
                s = tl.dot(q, k)
            s = s * scale
            visible = n_ok[None, :] & (offs_n[None, :] <= q_pos[:, None])
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - WINDOW)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
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
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(o_ptr + (q_start + q_idx)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 acc.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def store_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache,
             slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D] (last dim contiguous) -> the cache at slot_mapping[t]; slots < 0 are skipped."""
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    if isinstance(kv_cache, QuantizedKVCache):
        spec, data, scales = kv_cache.spec, kv_cache.values(), kv_cache.scales
        _store_kv_quant_kernel[(num_tokens, num_kv_heads)](
            k, v, data, scales, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            data.stride(0), data.stride(1), data.stride(2), scales.stride(0), scales.stride(1),
            D=head_dim, BLOCK_D=next_power_of_2(head_dim), QMAX=spec.qmax, FP8_MANTISSA=spec.mantissa_bits,
            FP8_EMIN=spec.min_exponent)
        return
    _store_kv_kernel[(num_tokens, num_kv_heads)](
        k, v, kv_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        D=head_dim, BLOCK_D=next_power_of_2(head_dim))


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor | QuantizedKVCache,  # [2, Hkv, num_slots, D]
    out: torch.Tensor,  # [T, H, D]
    block_table: torch.Tensor,  # [S, max_blocks] int32
    seq_lens: torch.Tensor,  # [S] int32: tokens in the cache after this step
    query_start_loc: torch.Tensor,  # [S + 1] int32: each sequence's first row of q (padding seqs: query length 0)
    *,
    scale: float,
    block_size: int,
    decode_only: bool,
    sliding_window: int | None = None,
    only: int = 0,
    tile: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """decode_only: the small query tile (one token a sequence). only: 0 every sequence, 1 the one-token ones, 2
    the others (a mixed step runs 1 with the decode tile, then 2 with the prefill tile). tile / num_warps /
    num_stages: launch settings (None: DECODE_LAUNCH or PREFILL_LAUNCH)."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[1]
    g = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    block_m, block_q = query_tile(g, decode_only)
    block_d = max(16, next_power_of_2(head_dim))
    launch = DECODE_LAUNCH if decode_only else PREFILL_LAUNCH
    tile, num_stages = fit_shared_memory(tile or launch["tile"], num_stages or launch["num_stages"], block_d,
                                         q.element_size(), q.device)
    grid = (grid_size(num_tokens, min(num_seqs, num_tokens), block_q), num_kv_heads)
    quant = isinstance(kv_cache, QuantizedKVCache)
    data, scales = (kv_cache.values(), kv_cache.scales) if quant else (kv_cache, kv_cache)  # unread if not quant
    _paged_attention_kernel[grid](
        q, out, data, scales, block_table, seq_lens, query_start_loc, scale, num_seqs,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        data.stride(0), data.stride(1), data.stride(2), scales.stride(0), scales.stride(1), block_table.stride(0),
        G=g, D=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_Q=block_q,
        BLOCK_SIZE=block_size, TILE=tile, WINDOW=sliding_window or 0, IEEE=q.dtype == torch.float32, ONLY=only,
        QUANT=quant,
        num_warps=num_warps or launch["num_warps"], num_stages=num_stages,
    )
    return out


@dataclass
class TritonAttentionMetadata:
    """The attention inputs of one step (views of the runner's persistent buffers; see step_inputs.py)."""

    slot_mapping: torch.Tensor  # [T] int64, -1 for padding tokens
    block_table: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    block_size: int
    decode_only: bool
    # decode-only steps: > 1 runs triton_split_decode.py's kernels with this many splits (plan_splits), 1 this
    # module's kernel
    num_splits: int = 1

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache,
               scale: float, window: int | None = None) -> torch.Tensor:
        """One layer's attention; window: that layer's sliding window (None: full attention), a constant of the
        kernel launch, so a captured graph holds each layer's."""
        store_kv(k, v, kv_cache, self.slot_mapping)
        out = torch.empty_like(q)
        args = (q, kv_cache, out, self.block_table, self.seq_lens, self.query_start_loc)
        common = dict(scale=scale, block_size=self.block_size, sliding_window=window)
        if self.decode_only and self.num_splits > 1:
            from kvgate.engine.triton_split_decode import split_decode_attention

            return split_decode_attention(*args, num_splits=self.num_splits, **common)
        if self.decode_only:
            return paged_attention(*args, decode_only=True, **common)
        # A mixed step: the decodes with the small tile (a 64-row tile would hold 2 useful rows of 64), then the
        # prefill chunks with the large one; each launch skips the other's sequences, and both fit a graph.
        paged_attention(*args, decode_only=True, only=1, **common)
        return paged_attention(*args, decode_only=False, only=2, **common)
