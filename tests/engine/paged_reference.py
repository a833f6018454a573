"""A plain-torch reference for paged attention over block tables, and random paged batches to check kernels with
(used by the Triton interpreter tests on CPU and the CUDA tests)."""

from __future__ import annotations

import random

import torch


def reference_attention(q, kv_cache, block_table, seq_lens, query_start_loc, scale, block_size, window=None):
    """float64 attention of each sequence's queries over its cached context (causal, optional sliding window)."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[1]
    group = num_heads // num_kv_heads
    for i in range(seq_lens.shape[0]):
        start, end, length = int(query_start_loc[i]), int(query_start_loc[i + 1]), int(seq_lens[i])
        n = end - start
        if n == 0:
            continue
        pos = torch.arange(length, device=q.device)
        slots = block_table[i][pos // block_size].long() * block_size + pos % block_size
        k = kv_cache[0][:, slots].double().repeat_interleave(group, 0)  # [H, L, D]
        v = kv_cache[1][:, slots].double().repeat_interleave(group, 0)
        scores = q[start:end].double().transpose(0, 1) @ k.transpose(1, 2) * scale
        q_pos = torch.arange(length - n, length, device=q.device)[:, None]
        visible = pos[None, :] <= q_pos
        if window:
            visible &= pos[None, :] > q_pos - window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = (scores.softmax(-1) @ v).transpose(0, 1)
    return out


def random_paged_batch(seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0,
                       padded_tokens=0, padded_seqs=0):
    """seqs: (cached tokens, new tokens) per sequence. Blocks are handed out shuffled, so a sequence's blocks are
    scattered over the cache. Returns q, kv_cache, block_table, seq_lens, query_start_loc (padding rows and
    sequences appended as a captured graph pads them)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = sum(-(-(c + n) // block_size) for c, n in seqs)
    num_blocks = blocks_needed + 8
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    max_blocks = max(-(-(c + n) // block_size) for c, n in seqs) + 2
    table = torch.zeros(len(seqs) + padded_seqs, max_blocks, dtype=torch.int32)
    starts, lens, used = [0], [], 0
    for i, (cached, new) in enumerate(seqs):
        nb = -(-(cached + new) // block_size)
        table[i, :nb] = torch.tensor(order[used:used + nb], dtype=torch.int32)
        used += nb
        starts.append(starts[-1] + new)
        lens.append(cached + new)
    total = starts[-1]
    starts += [total] * padded_seqs
    lens += [0] * padded_seqs
    kv_cache = torch.randn(2, num_kv_heads, num_blocks * block_size, head_dim, generator=gen).to(dtype)
    q = torch.randn(total + padded_tokens, num_heads, head_dim, generator=gen).to(dtype)
    as_int = dict(dtype=torch.int32)
    return (q.to(device), kv_cache.to(device), table.to(device), torch.tensor(lens, **as_int).to(device),
            torch.tensor(starts, **as_int).to(device))


# Every mode the kernel serves in one batch: decodes (short, long, crossing block boundaries), a whole prefill, a
# chunk over a cached prefix, a one-token prompt, a chunk ending exactly on a block boundary.
MIXED_SEQS = [(0, 1), (5, 1), (47, 1), (16, 1), (0, 37), (20, 13), (17, 70), (32, 16), (0, 3)]
DECODE_SEQS = [(c, 1) for c in (1, 5, 15, 16, 17, 31, 64, 90)]


def attend(ta, q, cache, out, table, lens, starts, head_dim, block_size, window, decode_only):
    """The kernel as a step runs it: decode_only True / False in one launch, "split" as a mixed step does (the
    one-token sequences with the decode tile, then the others with the prefill tile)."""
    common = dict(scale=head_dim**-0.5, block_size=block_size, sliding_window=window)
    if decode_only == "split":
        ta.paged_attention(q, cache, out, table, lens, starts, decode_only=True, only=1, **common)
        ta.paged_attention(q, cache, out, table, lens, starts, decode_only=False, only=2, **common)
    else:
        ta.paged_attention(q, cache, out, table, lens, starts, decode_only=decode_only, **common)
