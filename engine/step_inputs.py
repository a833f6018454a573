"""A step's model inputs, built with array operations into persistent buffers and copied to the device once.

The host side is numpy over (pinned, on CUDA) torch tensors; the device side is one tensor per input that lives as
long as the runner, so captured CUDA graphs read them where they were captured. Per sequence only the token ids of
its chunk and its block table row are written from Python; positions, slots, query offsets and sequence lengths are
computed for the whole batch at once.

Padding (for a captured graph's shapes): tokens past the batch get slot -1 (the K/V store skips them) and position
0; sequences past the batch get query length 0 and length 0 (the attention kernel skips them).

With async scheduling a decode's input token can be one the running step is still sampling: its row is written 0 on
the host and listed in `StepBatch.fill_rows`, with the row of the running step's sampled ids that holds it in
`fill_src`; the runner copies those on the device before the forward pass.

Two sets of host buffers alternate: a step's host-to-device copies may still be queued when the next step is
prepared (async scheduling), but never two steps back, because the engine waits for a step's sampled tokens before
it prepares the step after next.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvgate.engine.scheduler import SchedulerOutput


def write_chunk_layout(a: dict[str, np.ndarray], starts: np.ndarray, lens: np.ndarray, block_size: int,
                       arange: np.ndarray) -> int:
    """query_start_loc, seq_lens, positions and slot_mapping of n sequences' chunks, the i-th `lens[i]` tokens from
    position `starts[i]`, into the host arrays `a` (their block table rows already written); the number of tokens.
    `arange`: 0, 1, 2, ... at least that long."""
    n = len(lens)
    qsl = a["query_start_loc"]
    qsl[0] = 0
    np.cumsum(lens, out=qsl[1:n + 1])
    a["seq_lens"][:n] = starts + lens
    num_tokens = int(qsl[n])
    if num_tokens == n:  # one token each (decodes): no repeat
        positions, rows = starts, np.arange(n)
    else:
        rows = np.repeat(np.arange(n), lens)
        positions = np.repeat(starts - qsl[:n], lens) + arange[:num_tokens]
    a["positions"][:num_tokens] = positions
    a["slot_mapping"][:num_tokens] = (a["block_table"][rows, positions // block_size].astype(np.int64) * block_size
                                      + positions % block_size)
    return num_tokens


def write_padding(a: dict[str, np.ndarray], num_tokens: int, num_seqs: int, padded_tokens: int,
                  padded_seqs: int) -> None:
    """The rows past a batch of num_tokens (token 0, position 0, slot -1) and its sequences past num_seqs (no
    queries, length 0), up to a captured graph's shapes."""
    if padded_tokens > num_tokens:
        a["input_ids"][num_tokens:padded_tokens] = 0
        a["positions"][num_tokens:padded_tokens] = 0
        a["slot_mapping"][num_tokens:padded_tokens] = -1
    if padded_seqs > num_seqs:
        a["query_start_loc"][num_seqs + 1:padded_seqs + 1] = num_tokens
        a["seq_lens"][num_seqs:padded_seqs] = 0


@dataclass
class StepBatch:
    num_tokens: int  # real tokens of the step
    num_padded_tokens: int  # rows of the forward pass (>= num_tokens)
    num_padded_seqs: int  # sequences the attention kernel is given
    decode_only: bool  # one token per sequence (the attention kernel's small tile)
    sample_rows: torch.Tensor  # [len(samplers)] rows of the forward's output, on the device
    lora_rows: dict[int, np.ndarray]  # slot -> token rows (only requests with an adapter)
    fill_rows: torch.Tensor | None = None  # input rows whose token the running step samples (on the device)
    fill_src: torch.Tensor | None = None  # for each, its row in that step's sampled ids


class StepInputs:
    def __init__(self, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device) -> None:
        self.block_size, self.device = block_size, device
        pin = device.type == "cuda"

        def host(shape, dtype):
            return torch.zeros(shape, dtype=dtype, pin_memory=pin)

        def host_set() -> dict[str, torch.Tensor]:
            return {
                "input_ids": host(max_tokens, torch.int64),
                "positions": host(max_tokens, torch.int64),
                "slot_mapping": host(max_tokens, torch.int64),
                "query_start_loc": host(max_seqs + 1, torch.int32),
                "seq_lens": host(max_seqs, torch.int32),
                "block_table": host((max_seqs, max_blocks_per_seq), torch.int32),
                # a row per sampling sequence, or 1 + its drafts (speculative decoding): at most one per token
                "sample_rows": host(max(max_seqs, max_tokens), torch.int64),
                "fill_rows": host(max_seqs, torch.int64),
                "fill_src": host(max_seqs, torch.int64),
            }

        # On CPU the host tensors are the device tensors (one set, nothing to copy: a step's forward pass has run
        # before the next is prepared).
        hosts = [host_set()] if device.type == "cpu" else [host_set(), host_set()]
        self._sets = [(h, {name: t.numpy() for name, t in h.items()}) for h in hosts]  # (tensors, numpy views)
        self._next_set = 0
        self._host, self._np = self._sets[0]
        self.dev = self._host if device.type == "cpu" else {
            name: torch.zeros_like(t, device=device) for name, t in self._host.items()}
        self._arange = np.arange(max_tokens, dtype=np.int64)

    def _switch_set(self) -> None:
        self._host, self._np = self._sets[self._next_set]
        self._next_set = (self._next_set + 1) % len(self._sets)

    def prepare(self, out: SchedulerOutput, padded_tokens: int | None = None, padded_seqs: int | None = None,
                running_rows: dict[str, int] | None = None) -> StepBatch:
        """Fill the buffers for this step. padded_tokens / padded_seqs: the shapes of a captured graph (None: the
        batch's own). running_rows: request id -> row of the running step's sampled ids (async scheduling)."""
        self._switch_set()
        a = self._np
        ids, bt = a["input_ids"], a["block_table"]
        bs = self.block_size
        sched = out.scheduled
        n = len(sched)
        # Per sequence only what Python must read (its chunk's place and its tokens); the rest as arrays.
        starts = np.array([s.start for s in sched], dtype=np.int64)
        lens = np.array([s.num_new_tokens for s in sched], dtype=np.int64)
        num_tokens = int(lens.sum())
        fill_rows, fill_src = [], []
        if num_tokens == n:  # decodes only (the common full batch): one token each
            tokens = []
            for i, s in enumerate(sched):
                all_ids = s.request.all_token_ids
                if s.start < len(all_ids):
                    tokens.append(all_ids[s.start])
                else:  # an output placeholder: the running step samples it
                    tokens.append(0)
                    fill_rows.append(i)
                    fill_src.append(running_rows[s.request.request_id])
            ids[:n] = tokens
            sample_idx = None if all(s.samples for s in sched) else [i for i, s in enumerate(sched) if s.samples]
        else:
            t = 0
            for s in sched:
                r, start, k = s.request, s.start, s.num_new_tokens
                if s.draft is not None:  # its last token, then the drafts to verify
                    ids[t] = r.all_token_ids[start]
                    ids[t + 1:t + k] = s.draft
                elif start + k <= len(r.all_token_ids):
                    ids[t:t + k] = r.all_token_ids[start:start + k]
                else:  # only a decode computes a placeholder (a chunk of one token)
                    ids[t] = 0
                    fill_rows.append(t)
                    fill_src.append(running_rows[r.request_id])
                t += k
            sample_idx = [i for i, s in enumerate(sched) if s.samples]
        seq_lens = starts + lens
        if n:
            # Each scheduled request's block ids: one gather of its rows of the KV cache manager's table.
            cols = -(-int(seq_lens.max()) // bs)
            rows = np.array([s.block_row for s in sched], dtype=np.intp)
            bt[:n, :cols] = out.block_table.ids[rows, :cols]
        lora_seqs: dict[int, list[int]] = {}
        if out.lora_slots:
            for i, s in enumerate(sched):
                lora = s.request.lora_request
                if lora is not None:
                    lora_seqs.setdefault(out.lora_slots[lora.lora_int_id], []).append(i)
        write_chunk_layout(a, starts, lens, bs, self._arange)
        qsl = a["query_start_loc"]
        num_samples = n if sample_idx is None else len(sample_idx)
        a["sample_rows"][:num_samples] = qsl[1:n + 1] - 1 if sample_idx is None else qsl[1:n + 1][sample_idx] - 1
        if out.has_drafts:  # a speculating sequence's logits at its last token and at each draft
            rows = [np.arange(qsl[i + 1] - 1 - len(s.draft), qsl[i + 1]) if s.draft is not None else [qsl[i + 1] - 1]
                    for i, s in enumerate(sched) if s.samples]
            rows = np.concatenate(rows)
            num_samples = len(rows)
            a["sample_rows"][:num_samples] = rows

        num_padded = padded_tokens or num_tokens
        seqs_padded = padded_seqs or n
        write_padding(a, num_tokens, n, num_padded, seqs_padded)
        lora_rows = {slot: np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in seqs])
                     for slot, seqs in lora_seqs.items()}
        num_fill = len(fill_rows)
        if num_fill:
            a["fill_rows"][:num_fill] = fill_rows
            a["fill_src"][:num_fill] = fill_src

        if self.device.type != "cpu":
            h, d = self._host, self.dev
            for name, size in (("input_ids", num_padded), ("positions", num_padded), ("slot_mapping", num_padded),
                               ("query_start_loc", seqs_padded + 1), ("seq_lens", seqs_padded),
                               ("block_table", seqs_padded), ("sample_rows", num_samples),
                               ("fill_rows", num_fill), ("fill_src", num_fill)):
                if size:
                    d[name][:size].copy_(h[name][:size], non_blocking=True)
        d = self.dev
        return StepBatch(num_tokens, num_padded, seqs_padded, num_tokens == n, d["sample_rows"][:num_samples],
                         lora_rows, d["fill_rows"][:num_fill] if num_fill else None,
                         d["fill_src"][:num_fill] if num_fill else None)

    def fill_padding(self, num_tokens: int, num_seqs: int) -> None:
        """A step of padding only (for graph capture): no token is stored, no sequence attends."""
        a = self._np
        a["input_ids"][:num_tokens] = 0
        a["positions"][:num_tokens] = 0
        a["slot_mapping"][:num_tokens] = -1
        a["query_start_loc"][:num_seqs + 1] = 0
        a["seq_lens"][:num_seqs] = 0
        if self.device.type != "cpu":
            for name in self._host:
                self.dev[name].copy_(self._host[name])
            torch.cuda.synchronize(self.device)

    def view(self, name: str, size: int | None = None) -> torch.Tensor:
        t = self.dev[name]
        return t if size is None else t[:size]
