"""Prompt logprobs (vLLM's `prompt_logprobs`): the log-probability of each prompt token given the tokens before it,
with that position's top-k, from the hidden states of the prefill chunks that compute the prompt.

A prompt position's logits are a row of the vocabulary; a chunk of T positions would be a [T, V] float32 tensor at
once (an 8k-token chunk over a 152k vocabulary: 5 GB). They are computed PIECE_ELEMENTS at a time instead, so the
memory a step adds stays bounded whatever the chunk's length. The rows are planned on the host from the scheduled
chunks; positions a request already holds (a preempted request computing its prompt again, or a chunk scheduled
before the step ahead of it was taken) are not planned again.

With tensor parallelism every rank runs the same pieces (the LM head gathers the vocabulary across ranks), so rank 0
sends the planned rows with the step and the workers call `run_pieces` as rank 0 does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvgate.engine.sampler import gather_logprobs

# float32 logits per piece: 16M elements, 64 MiB (its log-softmax and rank test take about as much again)
PIECE_ELEMENTS = 2**24


@dataclass
class PromptLogprobRows:
    """What one step computes: rows of the step's hidden states, each scoring the prompt token after its position."""

    rows: list[int]  # rows of the step's hidden states (its tokens in scheduled order)
    targets: list[int]  # the prompt token each row scores (the next one)
    counts: list[int]  # top-k of each row
    spans: list[tuple[str, int, int]]  # (request id, index of its first prompt token scored, number of rows)


def plan_rows(scheduled: Sequence) -> PromptLogprobRows | None:
    """The step's prompt-logprob rows (None: no scheduled chunk computes one). The logits at prompt position p score
    prompt token p + 1, so a chunk of positions [start, start + n) scores tokens up to the prompt's last."""
    plan = PromptLogprobRows([], [], [], [])
    offset = 0
    for s in scheduled:
        r = s.request
        held = r.prompt_logprobs
        if held is not None and s.draft is None:
            first = max(s.start, len(held) - 1)  # the first position whose next token has no entry yet
            end = min(s.start + s.num_new_tokens, r.num_prompt_tokens - 1)
            if first < end:
                plan.rows += range(offset + first - s.start, offset + end - s.start)
                plan.targets += r.prompt_token_ids[first + 1:end + 1]
                plan.counts += [r.sampling_params.prompt_logprobs] * (end - first)
                plan.spans.append((r.request_id, first + 1, end - first))
        offset += s.num_new_tokens
    return plan if plan.rows else None


def piece_rows(vocab_size: int) -> int:
    return max(1, PIECE_ELEMENTS // max(vocab_size, 1))


def run_pieces(hidden: torch.Tensor, rows: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
               vocab_size: int, score: Callable[[torch.Tensor, slice], None] | None = None) -> None:
    """The logits of `rows` of `hidden`, piece by piece, each handed to score(float32 logits, its slice of rows)
    (None: computed and dropped, a tensor-parallel worker's part)."""
    step = piece_rows(vocab_size)
    for i in range(0, rows.shape[0], step):
        part = slice(i, i + step)
        logits = compute_logits(hidden.index_select(0, rows[part]))
        if score is not None:
            score(logits.float(), part)


def compute(hidden: torch.Tensor, plan: PromptLogprobRows, compute_logits: Callable[[torch.Tensor], torch.Tensor],
            vocab_size: int, rows: torch.Tensor | None = None) -> dict[str, tuple[int, list[dict]]]:
    """{request id: (index of its first prompt token scored, one {token id: Logprob} per token from there)}.
    rows: plan.rows already on the device (None: copied here)."""
    device = hidden.device
    if rows is None:
        rows = torch.tensor(plan.rows, dtype=torch.long, device=device)
    targets = torch.tensor(plan.targets, dtype=torch.long, device=device)
    entries: list[dict] = []

    def score(logits: torch.Tensor, part: slice) -> None:
        entries.extend(gather_logprobs(logits.log_softmax(dim=-1), targets[part], plan.counts[part]))

    run_pieces(hidden, rows, compute_logits, vocab_size, score)
    out, at = {}, 0
    for request_id, first, count in plan.spans:
        out[request_id] = (first, entries[at:at + count])
        at += count
    return out


def record(scheduled: Sequence, computed: dict[str, tuple[int, list[dict]]]) -> None:
    """A taken step's prompt logprobs appended to their requests (steps are taken in order, so a request's entries
    arrive in order; those it already holds are skipped)."""
    if not computed:
        return
    for s in scheduled:
        got = computed.get(s.request.request_id)
        held = s.request.prompt_logprobs
        if got is None or held is None:
            continue
        first, entries = got
        skip = len(held) - first
        if 0 <= skip < len(entries):
            held.extend(entries[skip:])
