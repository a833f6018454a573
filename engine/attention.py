"""Paged attention in plain torch (CPU and CUDA).

Every token's K/V is written into its slot of the paged cache (`slot = block_id * block_size + offset`);
queries then attend over each sequence's blocks. Sequences with a single query token (decodes) are
gathered into one padded batch; multi-token chunks (prefills) run one SDPA call each, with a causal mask
offset by the cached context. The gather indices and masks are built once per step and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillSeq:
    query_start: int
    query_len: int
    context_len: int  # tokens in the cache after this step (cached prefix + this chunk)
    slots: torch.Tensor | None  # [context_len] cache slots to read; None when the chunk is the whole context
    mask: torch.Tensor | None  # [query_len, context_len] bool; None means plain causal


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each token's K/V is written
    # Decodes: rows [decode_start, decode_start + num_decodes) of the flat batch, one query each.
    decode_token_idx: torch.Tensor | None  # [num_decodes] positions in the flat batch
    decode_slots: torch.Tensor | None  # [num_decodes, max_context] padded with slot 0
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_context] bool
    prefills: list[PrefillSeq]

    @classmethod
    def build(
        cls,
        seqs: list[tuple[int, int, list[int]]],
        block_size: int,
        device: torch.device,
        sliding_window: int | None = None,
    ) -> "AttentionMetadata":
        """seqs: (num_computed_tokens, num_new_tokens, block_ids) per sequence, in batch order."""
        slot_mapping: list[int] = []
        decode_idx: list[int] = []
        decode_slot_rows: list[list[int]] = []
        prefills: list[PrefillSeq] = []
        start = 0
        for computed, new, block_ids in seqs:
            ctx = computed + new
            slots = [block_ids[p // block_size] * block_size + p % block_size for p in range(ctx)]
            slot_mapping.extend(slots[computed:])
            if new == 1 and computed > 0:
                decode_idx.append(start)
                decode_slot_rows.append(slots)
            else:
                mask = None
                if computed > 0 or (sliding_window is not None and ctx > sliding_window):
                    mask = _chunk_mask(computed, new, sliding_window, device)
                prefills.append(
                    PrefillSeq(
                        start, new, ctx,
                        torch.tensor(slots, dtype=torch.long, device=device) if computed > 0 else None,
                        mask,
                    )
                )
            start += new

        decode_token_idx = decode_slots = decode_mask = None
        if decode_idx:
            max_ctx = max(len(r) for r in decode_slot_rows)
            lens = torch.tensor([len(r) for r in decode_slot_rows], device=device)
            padded = [r + [0] * (max_ctx - len(r)) for r in decode_slot_rows]
            decode_token_idx = torch.tensor(decode_idx, dtype=torch.long, device=device)
            decode_slots = torch.tensor(padded, dtype=torch.long, device=device)
            key_pos = torch.arange(max_ctx, device=device)[None, :]
            mask = key_pos < lens[:, None]
            if sliding_window is not None:
                mask &= key_pos >= (lens[:, None] - sliding_window)
            decode_mask = mask[:, None, None, :]
        return cls(
            torch.tensor(slot_mapping, dtype=torch.long, device=device),
            decode_token_idx, decode_slots, decode_mask, prefills,
        )


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
    kv_cache: torch.Tensor,  # [2, num_slots, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)
    gqa = q.shape[1] != k.shape[1]

    for p in meta.prefills:
        qs = q[p.query_start : p.query_start + p.query_len].transpose(0, 1)  # [H, Lq, D]
        if p.slots is None:
            ks = k[p.query_start : p.query_start + p.query_len]
            vs = v[p.query_start : p.query_start + p.query_len]
        else:
            ks, vs = k_cache[p.slots], v_cache[p.slots]
        ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)  # [Hkv, Lk, D]
        o = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=gqa
        )
        out[p.query_start : p.query_start + p.query_len] = o.transpose(0, 1)

    if meta.decode_token_idx is not None:
        qd = q[meta.decode_token_idx].unsqueeze(2)  # [B, H, 1, D]
        kd = k_cache[meta.decode_slots].permute(0, 2, 1, 3)  # [B, Hkv, L, D]
        vd = v_cache[meta.decode_slots].permute(0, 2, 1, 3)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale, enable_gqa=gqa)
        out[meta.decode_token_idx] = o.squeeze(2)
    return out
