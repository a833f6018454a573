"""Paged attention in plain torch (CPU and CUDA).

Cache layout per layer: [2 (K, V), num_kv_heads, num_blocks * block_size, head_dim]. Every token's K/V
is written into its slot (`block_id * block_size + offset`); queries then attend over their sequence's
blocks, gathered block-wise: the cache is viewed as rows of one (KV head, block) each and one
index_select along dim 0 copies whole rows, which on CPU is several times faster than gathering single
slots or indexing along an inner dimension.

- Decodes (one query token each) are batched in groups of similar length (padding to the longest of a
  group costs gather and attention work; a group spans at most a 1.5x range of block counts): their
  blocks are gathered into [Hkv, B, L, D] and one SDPA call runs with the KV heads as SDPA's batch and the
  sequences as its heads, the G = H / Hkv query heads sharing a KV head acting as G query positions.
  Everything stays contiguous, and GQA needs no copies.
- Multi-token chunks (prefills) run one SDPA call each: plain causal when the chunk is the whole context,
  else a mask offset by the cached prefix.
- Speculative decoding's verification chunks (a decode's token and its K drafts) are batched like decodes, in
  groups of similar length, with their K + 1 queries a sequence (padded to the group's longest) each masked
  causally: one SDPA call a group instead of one a chunk, which saves the per-call overhead that dominates
  small chunks.
The gather indices and masks are built once per step and shared by all layers. Masks depend on a layer's sliding
window: a model whose layers have different windows (Qwen2/Qwen3's max_window_layers, Gemma's layer_types) gets one
set per distinct window, and each layer attends with its own (`attend`'s window).

A quantized cache (kv_quant.py) is quantized as it is written and its gathered rows dequantized as they are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvgate.engine.kv_quant import QuantizedKVCache


@dataclass
class PrefillSeq:
    query_start: int
    query_len: int
    context_len: int  # tokens in the cache after this step (cached prefix + this chunk)
    rows: torch.Tensor | None  # (head, block) cache rows holding the context; None when the chunk is all of it
    mask: torch.Tensor | None  # [query_len, context_len] bool; None means plain causal


@dataclass
class DecodeGroup:
    token_idx: torch.Tensor  # [B] rows of the flat batch
    rows: torch.Tensor  # [Hkv * B * max_blocks] (head, block) cache rows, see block_rows()
    mask: torch.Tensor  # [1, B, 1, max_blocks * block_size] bool


@dataclass
class VerifyGroup:
    """Short chunks after a cached context (speculative decoding's last token + drafts), Q queries a sequence."""
    token_idx: torch.Tensor  # [B * Q] rows of the flat batch, a sequence's last repeated where it has fewer than Q
    rows: torch.Tensor  # [Hkv * B * max_blocks] (head, block) cache rows, see block_rows()
    mask: torch.Tensor  # [1, B, Q * G, max_blocks * block_size] bool, G = query heads per KV head
    queries: int  # Q
    keep: torch.Tensor  # [num real queries] positions in token_idx that are not padding
    keep_idx: torch.Tensor  # [num real queries] their rows of the flat batch


# A decode group's longest block table is at most this many times its shortest.
DECODE_GROUP_SPREAD = 1.5


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each token's K/V is written
    block_size: int
    decodes: list[DecodeGroup]
    prefills: list[PrefillSeq]
    verifies: list[VerifyGroup] = field(default_factory=list)
    window: int | None = None  # the sliding window these masks apply
    # the same step's metadata for the other windows among the model's layers, by window
    others: dict[int | None, "AttentionMetadata"] = field(default_factory=dict)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor | QuantizedKVCache,
               scale: float, window: int | None = None) -> torch.Tensor:
        """One layer's attention; window: that layer's sliding window (None: full attention)."""
        meta = self if window == self.window else self.others.get(window)
        if meta is None:
            raise RuntimeError(f"attention with sliding window {window}: the step's metadata was built for windows "
                               f"{sorted([self.window, *self.others], key=str)}")
        return paged_attention(q, k, v.contiguous(), kv_cache, meta, scale)

    @classmethod
    def for_windows(cls, windows, seqs: list[tuple[int, int, list[int]]], block_size: int, device: torch.device,
                    num_kv_heads: int, num_cache_blocks: int, **kwargs) -> "AttentionMetadata":
        """build() for each distinct window of `windows` (the model's layers'), the first holding the others."""
        distinct = list(dict.fromkeys(windows)) or [None]
        meta = cls.build(seqs, block_size, device, num_kv_heads, num_cache_blocks, distinct[0], **kwargs)
        kwargs["slot_mapping"] = meta.slot_mapping
        for w in distinct[1:]:
            meta.others[w] = cls.build(seqs, block_size, device, num_kv_heads, num_cache_blocks, w, **kwargs)
        return meta

    @classmethod
    def build(
        cls,
        seqs: list[tuple[int, int, list[int]]],
        block_size: int,
        device: torch.device,
        num_kv_heads: int,
        num_cache_blocks: int,
        sliding_window: int | None = None,
        slot_mapping: torch.Tensor | None = None,
        verify: list[bool] | None = None,
        num_heads: int | None = None,
    ) -> "AttentionMetadata":
        """seqs: (num_computed_tokens, num_new_tokens, block_ids) per sequence, in batch order; slot_mapping: the
        step's slots when the caller has them already (step_inputs.py), else computed here. verify: per sequence,
        whether its chunk is a speculative verification (batched in VerifyGroups; needs num_heads)."""
        slots: list[int] = []
        decode_idx: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        verifying: list[tuple[int, int, int, list[int]]] = []  # (start, computed, new, block ids)
        start = 0
        for i, (computed, new, block_ids) in enumerate(seqs):
            ctx = computed + new
            if slot_mapping is None:
                slots.extend(block_ids[p // block_size] * block_size + p % block_size for p in range(computed, ctx))
            num_blocks = -(-ctx // block_size)
            if new == 1 and computed > 0:
                decode_idx.append(start)
                decode_tables.append(block_ids[:num_blocks])
                decode_lens.append(ctx)
            elif verify is not None and verify[i] and computed > 0:
                verifying.append((start, computed, new, block_ids[:num_blocks]))
            else:
                mask = None
                if computed > 0 or (sliding_window is not None and ctx > sliding_window):
                    mask = _chunk_mask(computed, new, sliding_window, device)
                rows = None
                if computed:
                    blocks = torch.tensor(block_ids[:num_blocks], dtype=torch.long, device=device)
                    rows = block_rows(blocks, num_kv_heads, num_cache_blocks)
                prefills.append(PrefillSeq(start, new, ctx, rows, mask))
            start += new

        decodes = []
        order = sorted(range(len(decode_idx)), key=lambda i: len(decode_tables[i]))
        while order:
            limit = len(decode_tables[order[0]]) * DECODE_GROUP_SPREAD
            cut = next((j for j, i in enumerate(order) if len(decode_tables[i]) > limit), len(order))
            group, order = order[:cut], order[cut:]
            decodes.append(_decode_group([decode_idx[i] for i in group], [decode_tables[i] for i in group],
                                         [decode_lens[i] for i in group], block_size, device, num_kv_heads,
                                         num_cache_blocks, sliding_window))
        verifies = []
        verifying.sort(key=lambda v: len(v[3]))
        while verifying:
            limit = len(verifying[0][3]) * DECODE_GROUP_SPREAD
            cut = next((j for j, v in enumerate(verifying) if len(v[3]) > limit), len(verifying))
            verifies.append(_verify_group(verifying[:cut], block_size, device, num_kv_heads, num_heads,
                                          num_cache_blocks, sliding_window))
            verifying = verifying[cut:]
        if slot_mapping is None:
            slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        return cls(slot_mapping, block_size, decodes, prefills, verifies, sliding_window)


def _decode_group(token_idx, tables, lens, block_size, device, num_kv_heads, num_cache_blocks,
                  sliding_window) -> DecodeGroup:
    max_blocks = max(len(t) for t in tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    blocks = torch.tensor(padded, dtype=torch.long, device=device).view(-1)
    lens_t = torch.tensor(lens, device=device)
    key_pos = torch.arange(max_blocks * block_size, device=device)[None, :]
    mask = key_pos < lens_t[:, None]
    if sliding_window is not None:
        mask &= key_pos >= (lens_t[:, None] - sliding_window)
    return DecodeGroup(torch.tensor(token_idx, dtype=torch.long, device=device),
                       block_rows(blocks, num_kv_heads, num_cache_blocks), mask[None, :, None, :])


def _verify_group(seqs, block_size, device, num_kv_heads, num_heads, num_cache_blocks, sliding_window) -> VerifyGroup:
    """seqs: (batch start, computed, new, block ids). Query j of a sequence sees keys up to its own position."""
    queries = max(new for _, _, new, _ in seqs)
    max_blocks = max(len(t) for *_, t in seqs)
    blocks = torch.tensor([t + [0] * (max_blocks - len(t)) for *_, t in seqs], dtype=torch.long, device=device)
    token_idx, lens, keep, keep_idx = [], [], [], []
    for b, (start, computed, new, _) in enumerate(seqs):
        for j in range(queries):
            token_idx.append(start + min(j, new - 1))  # padding repeats the last query (its output is dropped)
            lens.append(computed + min(j, new - 1) + 1)
            if j < new:
                keep.append(b * queries + j)
                keep_idx.append(start + j)
    lens_t = torch.tensor(lens, device=device)[:, None]
    key_pos = torch.arange(max_blocks * block_size, device=device)[None, :]
    mask = key_pos < lens_t
    if sliding_window is not None:
        mask &= key_pos >= lens_t - sliding_window
    group = num_heads // num_kv_heads
    mask = mask.view(len(seqs), queries, 1, -1).expand(-1, -1, group, -1).reshape(1, len(seqs), queries * group, -1)
    as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    return VerifyGroup(as_tensor(token_idx), block_rows(blocks.view(-1), num_kv_heads, num_cache_blocks), mask,
                       queries, as_tensor(keep), as_tensor(keep_idx))


def block_rows(block_ids: torch.Tensor, num_kv_heads: int, num_cache_blocks: int) -> torch.Tensor:
    """Rows of the cache viewed as [Hkv * num_blocks, block_size * D]: head-major, then the given blocks."""
    heads = torch.arange(num_kv_heads, device=block_ids.device)[:, None] * num_cache_blocks
    return (heads + block_ids[None, :]).view(-1)


def _chunk_mask(computed: int, new: int, sliding_window: int | None, device: torch.device) -> torch.Tensor:
    q_pos = torch.arange(computed, computed + new, device=device)[:, None]
    k_pos = torch.arange(computed + new, device=device)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    return mask


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]
    v: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor | QuantizedKVCache,  # [2, Hkv, num_slots, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    bs = meta.block_size
    if isinstance(kv_cache, QuantizedKVCache):
        # Fresh K/V come back dequantized: a prefill attends to the values its later reads will see.
        k, v = kv_cache.store(k, v, meta.slot_mapping)

        def gather(i: int, rows: torch.Tensor) -> torch.Tensor:
            return kv_cache.gather(i, rows, bs, q.dtype)
    else:
        kv_cache[0].index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        kv_cache[1].index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

        def gather(i: int, rows: torch.Tensor) -> torch.Tensor:
            return _gather_blocks(kv_cache[i], rows, bs)
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    out = torch.empty_like(q)

    for p in meta.prefills:
        rows = slice(p.query_start, p.query_start + p.query_len)
        qs = q[rows].transpose(0, 1)  # [H, Lq, D]
        if p.rows is None:
            ks, vs = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [Hkv, Lk, D]
        else:
            ks = gather(0, p.rows)[:, : p.context_len]
            vs = gather(1, p.rows)[:, : p.context_len]
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=p.mask, is_causal=p.mask is None, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
        out[rows] = o.transpose(0, 1)

    group_size = num_heads // num_kv_heads
    for g in meta.decodes:
        batch = g.token_idx.shape[0]
        kd = gather(0, g.rows).view(num_kv_heads, batch, -1, head_dim)
        vd = gather(1, g.rows).view(num_kv_heads, batch, -1, head_dim)
        qd = q[g.token_idx].view(batch, num_kv_heads, group_size, head_dim).transpose(0, 1)  # [Hkv, B, G, D]
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=g.mask, scale=scale)
        out[g.token_idx] = o.transpose(0, 1).reshape(batch, num_heads, head_dim)

    for g in meta.verifies:
        batch, nq = g.mask.shape[1], g.queries
        kd = gather(0, g.rows).view(num_kv_heads, batch, -1, head_dim)
        vd = gather(1, g.rows).view(num_kv_heads, batch, -1, head_dim)
        qv = q[g.token_idx].view(batch, nq, num_kv_heads, group_size, head_dim).permute(2, 0, 1, 3, 4)
        o = F.scaled_dot_product_attention(qv.reshape(num_kv_heads, batch, nq * group_size, head_dim), kd, vd,
                                           attn_mask=g.mask, scale=scale)  # [Hkv, B, Q * G, D]
        o = o.view(num_kv_heads, batch, nq, group_size, head_dim).permute(1, 2, 0, 3, 4)
        out[g.keep_idx] = o.reshape(batch * nq, num_heads, head_dim)[g.keep]
    return out


def _gather_blocks(cache: torch.Tensor, rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """[Hkv, num_slots, D] -> [Hkv, blocks * block_size, D] for the (head, block) rows of block_rows()."""
    hkv, num_slots, d = cache.shape
    return cache.view(hkv * num_slots // block_size, block_size * d).index_select(0, rows).view(hkv, -1, d)
