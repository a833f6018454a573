"""The draft model's forwards on the Triton path (speculative decoding with a draft model; draft_model.py): the same
paged-attention kernels as the target, inputs written into static buffers, and CUDA graphs of the draft's decode
forwards, captured once per batch size.

Why: a draft model is small, so on a GPU its forwards are bound by launches, not by bytes: each drafted step runs it
K times (a catch-up forward, then K - 1 single-token decodes), and eagerly each forward is a few dozen kernel
launches, as many as a large model's (the SDPA path adds gathered copies of the context's K/V for every chunk).
Replaying a captured graph makes a decode forward one launch. The catch-up forwards (a request's context the first
time it drafts, its last one or two tokens after) run eagerly through the same buffers, unless they too are one token
a request (the common steady state: the last token each), which a decode graph serves.

The buffers mirror step_inputs.py's and are laid out by its functions (padding rows store nothing: slot -1; padding
sequences have no queries and length 0). They are filled on the host and copied with a blocking copy: forwards follow
each other within one step without a sync in between, and a pinned host buffer rewritten while an earlier
non-blocking copy of it is in flight would corrupt that copy. On CPU (the Triton interpreter, in tests) the buffers
are the same and nothing is captured, as for the target.
"""

from __future__ import annotations

import numpy as np
import torch

from kvgate.engine.cuda_graphs import GraphSet
from kvgate.engine.step_inputs import write_chunk_layout, write_padding
from kvgate.engine.triton_attention import TritonAttentionMetadata

NAMES = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_table")


class DraftTritonPath:
    def __init__(self, model, max_seqs: int, max_tokens: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, capture: bool) -> None:
        self.model, self.block_size, self.device = model, block_size, device
        pin = device.type == "cuda"
        self._host = {
            "input_ids": torch.zeros(max_tokens, dtype=torch.int64, pin_memory=pin),
            "positions": torch.zeros(max_tokens, dtype=torch.int64, pin_memory=pin),
            "slot_mapping": torch.zeros(max_tokens, dtype=torch.int64, pin_memory=pin),
            "query_start_loc": torch.zeros(max_seqs + 1, dtype=torch.int32, pin_memory=pin),
            "seq_lens": torch.zeros(max_seqs, dtype=torch.int32, pin_memory=pin),
            "block_table": torch.zeros((max_seqs, max_blocks_per_seq), dtype=torch.int32, pin_memory=pin),
        }
        self._np = {name: t.numpy() for name, t in self._host.items()}
        self._arange = np.arange(max_tokens, dtype=np.int64)
        self.dev = self._host if device.type == "cpu" else {
            name: torch.zeros_like(t, device=device) for name, t in self._host.items()}
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        # decode graphs only (batch sizes up to max_seqs); captured by capture() once the KV cache exists
        self.graphs = GraphSet(max_seqs, 0) if capture and device.type == "cuda" else None
        self.replays = 0  # decode forwards served by a graph (tests and the bench read it)

    def _fill(self, seqs: list, ids: list[int], padded_tokens: int, padded_seqs: int) -> None:
        """seqs: (computed, new, block ids) per chunk, its positions computed .. computed + new - 1; the rows past
        len(ids) and sequences past len(seqs) pad."""
        a = self._np
        n, num_tokens = len(seqs), len(ids)
        a["input_ids"][:num_tokens] = ids
        bt = a["block_table"]
        for i, (_, _, table) in enumerate(seqs):
            bt[i, :len(table)] = table
        starts = np.fromiter((s[0] for s in seqs), dtype=np.int64, count=n)
        lens = np.fromiter((s[1] for s in seqs), dtype=np.int64, count=n)
        write_chunk_layout(a, starts, lens, self.block_size, self._arange)
        write_padding(a, num_tokens, n, padded_tokens, padded_seqs)
        if self.device.type != "cpu":
            for name, size in (("input_ids", padded_tokens), ("positions", padded_tokens),
                               ("slot_mapping", padded_tokens), ("query_start_loc", padded_seqs + 1),
                               ("seq_lens", padded_seqs), ("block_table", padded_seqs)):
                self.dev[name][:size].copy_(self._host[name][:size])  # blocking: see the module doc

    def _forward_static(self, num_tokens: int, num_seqs: int, decode_only: bool, kv_caches: list) -> torch.Tensor:
        d = self.dev
        meta = TritonAttentionMetadata(d["slot_mapping"][:num_tokens], d["block_table"][:num_seqs],
                                       d["seq_lens"][:num_seqs], d["query_start_loc"][:num_seqs + 1],
                                       self.block_size, decode_only)
        return self.model(d["input_ids"][:num_tokens], d["positions"][:num_tokens], kv_caches, meta)

    def forward(self, seqs: list, ids: list[int], kv_caches: list, keep: bool = True) -> torch.Tensor:
        """The draft's hidden rows for these chunks. keep: rows read after the next forward (a catch-up's, kept per
        request) come as a tensor of their own, since a graph's output is overwritten by the next replay; rows used
        at once (a draft decode's, turned into logits) come as the graph's output."""
        num_tokens, n = len(ids), len(seqs)
        decode_only = num_tokens == n
        padded = self.graphs.size_for(n, True) if self.graphs is not None and decode_only else None
        if padded is not None and self.graphs.graphs:
            self._fill(seqs, ids, padded, padded)
            self.replays += 1
            rows = self.graphs.replay(padded, True)[:num_tokens]
            return rows.clone() if keep else rows
        self._fill(seqs, ids, num_tokens, n)
        return self._forward_static(num_tokens, n, decode_only, kv_caches)

    def capture(self, kv_caches: list) -> None:
        """Capture the decode graphs over kv_caches (the draft's allocated cache)."""
        if self.graphs is None:
            return

        def fill(num_tokens: int, decode_only: bool) -> None:
            self._fill([], [], num_tokens, num_tokens)

        def forward(num_tokens: int, decode_only: bool) -> torch.Tensor:
            return self._forward_static(num_tokens, num_tokens, decode_only, kv_caches)

        with torch.inference_mode():
            self.graphs.capture(fill, forward, self.device)
