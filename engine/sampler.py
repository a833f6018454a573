"""Batched sampling on the logits' device.

Order (vLLM's): raw logprobs -> min_tokens mask -> structured-output mask (constrained rows only) -> logit bias
(biased rows only) -> penalties -> greedy argmax for greedy rows -> temperature -> min-p -> top-k -> top-p -> draw.
Logprobs are the model's own (before any mask or bias). Draws use the exponential-race trick
(argmax(p / E), E ~ Exp(1)), which lets each seeded request take its noise from its own generator, so a
seeded request samples the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgate.engine.request import Logprob, Request
from kvgate.engine.structured_output import unpack_bitmask


@dataclass
class SamplingBatch:
    """Per-row sampling tensors, built once per step from the requests that sample."""

    temperature: torch.Tensor | None  # [B] (0 for greedy rows); None when every row is greedy
    greedy: torch.Tensor | None  # [B] bool; None when every row is greedy
    top_k: torch.Tensor | None  # [B] long, 0 = off
    top_p: torch.Tensor | None  # [B]
    min_p: torch.Tensor | None  # [B]
    repetition: torch.Tensor | None  # [B]
    presence: torch.Tensor | None
    frequency: torch.Tensor | None
    prompt_mask: torch.Tensor | None  # [B, V] bool: token occurs in the prompt
    output_counts: torch.Tensor | None  # [B, V] counts of generated tokens
    banned: list[tuple[int, list[int]]]  # (row, token ids) masked to -inf (min_tokens)
    generators: list[torch.Generator | None]
    num_logprobs: list[int | None]
    # Structured outputs: the constrained rows and their allowed tokens, int32 bitmask [len(rows), ceil(V/32)].
    grammar_rows: list[int] | None = None
    grammar_bitmask: torch.Tensor | None = None
    # Logit bias: (rows [K], token ids [K], biases [K]) over every biased row's entries; None when no row has one.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    all_greedy: bool = False  # known on the host: no device-to-host wait to ask the device

    @classmethod
    def build(cls, requests: list[Request], vocab_size: int, device: torch.device,
              grammar: tuple[list[int], torch.Tensor | None] = ([], None)) -> "SamplingBatch":
        """`grammar`: (rows, bitmask) from structured_output.fill_bitmasks for these requests."""
        ps = [r.sampling_params for r in requests]

        def col(values, dtype=torch.float32):
            # From pinned memory without waiting: a pageable copy would wait for the device to finish its queue
            # (the forward pass just launched, and with async scheduling the step before it).
            if device.type != "cuda":
                return torch.tensor(values, dtype=dtype, device=device)
            return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)

        greedy = [p.greedy for p in ps]
        needs_penalty = any(p.has_penalties for p in ps)
        prompt_mask = output_counts = None
        if needs_penalty:
            prompt_mask = torch.zeros(len(ps), vocab_size, dtype=torch.bool, device=device)
            output_counts = torch.zeros(len(ps), vocab_size, dtype=torch.float32, device=device)
            for i, r in enumerate(requests):
                if r.prompt_token_ids:
                    prompt_mask[i, col(r.prompt_token_ids, torch.long)] = True
                if r.output_token_ids:
                    ids = col(r.output_token_ids, torch.long)
                    output_counts[i].index_add_(0, ids, torch.ones_like(ids, dtype=torch.float32))
        banned = []
        for i, p in enumerate(ps):
            if not p.min_tokens:
                continue
            r = requests[i]
            # Outputs before the one sampled now (the step's own placeholder is the last of the request's).
            earlier = r.num_output_tokens + max(r.num_output_placeholders - 1, 0)
            if earlier < p.min_tokens and r.grammar is None:  # a grammar decides when EOS may come
                ids = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(p.eos_token_ids)))
                if ids:
                    banned.append((i, ids))
        bias_rows, bias_ids, bias_values = [], [], []
        for i, p in enumerate(ps):
            if p.logit_bias:
                bias_rows += [i] * len(p.logit_bias)
                bias_ids += p.logit_bias.keys()
                bias_values += p.logit_bias.values()
        any_sampled = not all(greedy)
        return cls(
            # An all-greedy batch (the common case) takes the argmax alone: no per-row tensors to copy.
            temperature=col([0.0 if g else p.temperature for g, p in zip(greedy, ps)]) if any_sampled else None,
            greedy=col(greedy, torch.bool) if any_sampled else None,
            top_k=col([p.top_k for p in ps], torch.long) if any_sampled and any(p.top_k > 0 for p in ps) else None,
            top_p=col([p.top_p for p in ps]) if any_sampled and any(p.top_p < 1.0 for p in ps) else None,
            min_p=col([p.min_p for p in ps]) if any_sampled and any(p.min_p > 0 for p in ps) else None,
            repetition=col([p.repetition_penalty for p in ps]) if needs_penalty else None,
            presence=col([p.presence_penalty for p in ps]) if needs_penalty else None,
            frequency=col([p.frequency_penalty for p in ps]) if needs_penalty else None,
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            banned=banned,
            generators=[r.generator for r in requests],
            num_logprobs=[p.logprobs for p in ps],
            grammar_rows=grammar[0] or None,
            grammar_bitmask=None if grammar[1] is None else grammar[1].to(device, non_blocking=True),
            logit_bias=(col(bias_rows, torch.long), col(bias_ids, torch.long), col(bias_values))
            if bias_rows else None,
            all_greedy=not any_sampled,
        )


def apply_grammar_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Disallowed tokens of the constrained rows to -inf, in place; other rows are not touched."""
    allowed = unpack_bitmask(bitmask, logits.shape[-1])
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    """Each biased row's biases added to its tokens' logits, in place (a row's ids are distinct: a dict's keys)."""
    rows, ids, values = bias
    logits.index_put_((rows, ids), values, accumulate=True)


def apply_penalties(logits, prompt_mask, output_counts, repetition, presence, frequency):
    """Repetition (HF/CTRL style, prompt and output tokens), presence and frequency (OpenAI, output tokens)."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None].expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0).float()


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = logits.softmax(dim=-1)
    threshold = min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep the top_k most likely tokens, then the smallest set whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).clamp(max=vocab)
        kth = sorted_logits.gather(1, (vocab - k)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1)
        drop = cum <= (1 - top_p[:, None])
        drop[:, -1] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


class Sampler:
    @staticmethod
    def greedy(logits: torch.Tensor) -> torch.Tensor:
        """Greedy rows with nothing to mask: the argmax in the model's dtype is the argmax of its float32 copy (the
        conversion is exact, ties stay ties, the first index wins), without a [B, V] float32 copy to write and read
        (with a large vocabulary and batch a noticeable share of a decode step: `python -m tests.engine.gpu_profile
        engine` shows it)."""
        return logits.argmax(dim=-1)

    @staticmethod
    def probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """What a sampled row draws from: temperature, min-p, top-k, top-p (greedy rows at temperature 1)."""
        temp = torch.where(batch.greedy, torch.ones_like(batch.temperature), batch.temperature)
        logits = logits.float() / temp[:, None]
        if batch.min_p is not None:
            logits = apply_min_p(logits, batch.min_p)
        if batch.top_k is not None or batch.top_p is not None:
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p)
        return logits.softmax(dim=-1)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, list | None]:
        """logits [B, V] (float32) -> (token ids [B], top logprobs per row or None)."""
        wants_logprobs = any(n is not None for n in batch.num_logprobs)
        if batch.all_greedy and not (wants_logprobs or batch.banned or batch.grammar_rows
                                     or batch.repetition is not None or batch.logit_bias is not None):
            return self.greedy(logits), None
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if wants_logprobs else None
        for row, ids in batch.banned:
            logits[row, ids] = float("-inf")
        if batch.grammar_rows:
            apply_grammar_bitmask(logits, batch.grammar_rows, batch.grammar_bitmask)
        if batch.logit_bias is not None:
            apply_logit_bias(logits, batch.logit_bias)
        if batch.repetition is not None:
            logits = apply_penalties(logits, batch.prompt_mask, batch.output_counts,
                                     batch.repetition, batch.presence, batch.frequency)
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            tokens = greedy_tokens
        else:
            probs = self.probs(logits, batch)
            noise = self._exponential_noise(probs, batch.generators)
            sampled = probs.div(noise).argmax(dim=-1)
            tokens = torch.where(batch.greedy, greedy_tokens, sampled)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, tokens, batch.num_logprobs)
        return tokens, logprobs

    @staticmethod
    def _exponential_noise(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        unseeded = [i for i, g in enumerate(generators) if g is None]
        if unseeded:
            if len(unseeded) == len(generators):
                noise.exponential_()
            else:
                noise[unseeded] = torch.empty_like(noise[unseeded]).exponential_()
        for i, g in enumerate(generators):
            if g is not None:
                noise[i].exponential_(generator=g)
        return noise


def gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor, counts: list[int | None]) -> list:
    """Per row of raw logprobs [B, V]: None where its count is None, else {its token: Logprob} and its top `count`
    tokens' (ranks from 1, the most likely)."""
    k = max(n or 0 for n in counts)
    chosen = raw.gather(1, tokens[:, None]).squeeze(1)
    ranks = (raw > chosen[:, None]).sum(dim=-1) + 1
    top_vals = top_ids = None
    if k > 0:
        top_vals, top_ids = raw.topk(k, dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    chosen, ranks, toks = chosen.tolist(), ranks.tolist(), tokens.tolist()
    result = []
    for i, n in enumerate(counts):
        if n is None:
            result.append(None)
            continue
        entry = {toks[i]: Logprob(chosen[i], ranks[i])}
        for j in range(n):
            tid = top_ids[i][j]
            if tid not in entry:
                entry[tid] = Logprob(top_vals[i][j], j + 1)
        result.append(entry)
    return result
