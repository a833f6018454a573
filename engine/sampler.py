"""Batched sampling on the logits' device.

Order (vLLM's): raw logprobs -> min_tokens mask -> structured-output mask (constrained rows only) -> logit bias
(biased rows only) -> penalties (penalized rows only) -> greedy argmax for greedy rows -> temperature -> min-p ->
top-k -> top-p -> draw. Logprobs are the model's own (before any mask or bias). Draws use the exponential-race trick
(argmax(p / E), E ~ Exp(1)), which lets each seeded request take its noise from its own generator, so a seeded
request samples the same tokens whatever else shares its batch. Greedy and sampled rows share one pass.

Nothing here reads a device tensor on the host: every per-row choice is known from the requests' parameters
(which rows take top-k, top-p, penalties), penalties read device-side token counts (penalty_state.py), and
logprobs stay on the device until the step copies them back with its tokens (LogprobTensors). So a step's sampling
is queued behind its forward pass without a wait, whatever its requests ask for (grammars aside: their masks come
from the host).

Sampling runs after the CUDA graph of the forward pass, not inside it: seeded rows draw from their own
torch.Generator each step (a captured graph would replay one generator state), and the rows that take top-k,
top-p, penalties or logit bias, the batch's largest top_k and the logprob count change from step to step, so one
graph per decode size would not cover them. Its kernels are a handful of launches over [B, V].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvgate.engine.penalty_state import PenaltyState
from kvgate.engine.request import Logprob, Request
from kvgate.engine.structured_output import unpack_bitmask

# Bisection steps for a top-p threshold over float32 probabilities' bit patterns: a probability's bits, read as an
# integer, order like the probability, and every one lies in [0, bits(1.0)] < 2**30, so 31 halvings land on it.
_TOP_P_BISECTION_STEPS = 31


@dataclass
class Penalties:
    """The penalized rows of a batch: their rows in it, their rows of the device counts, and the three penalties."""

    rows: torch.Tensor  # [P] long: rows of the batch
    state_rows: torch.Tensor  # [P] long: rows of state's tensors
    repetition: torch.Tensor  # [P]
    presence: torch.Tensor
    frequency: torch.Tensor
    state: PenaltyState


@dataclass
class SamplingBatch:
    """Per-row sampling tensors, built once per step from the requests that sample (host lists to the device, no
    device values read back)."""

    temperature: torch.Tensor | None  # [B] (0 for greedy rows); None when every row is greedy
    greedy: torch.Tensor | None  # [B] bool; None when every row is greedy
    top_k: torch.Tensor | None  # [B] long, 0 = off; None when no row has one
    top_p: torch.Tensor | None  # [B]; None when no row has one
    min_p: torch.Tensor | None  # [B]
    banned: list[tuple[int, list[int]]]  # (row, token ids) masked to -inf (min_tokens)
    generators: list[torch.Generator | None]
    num_logprobs: list[int | None]
    penalties: Penalties | None = None
    max_top_k: int = 0  # the largest top_k of the batch (known on the host: the size of the partial selection)
    # Rows with top_p but no top_k ([R] long, maybe empty: their top-p threshold is bisected); None: not known, every
    # row without top_k is bisected and the ones with top_p < 1 take it.
    top_p_only_rows: torch.Tensor | None = None
    # Structured outputs: the constrained rows and their allowed tokens, int32 bitmask [len(rows), ceil(V/32)].
    grammar_rows: list[int] | None = None
    grammar_bitmask: torch.Tensor | None = None
    # Logit bias: (rows [K], token ids [K], biases [K]) over every biased row's entries; None when no row has one.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    all_greedy: bool = False  # known on the host: no device-to-host wait to ask the device

    @classmethod
    def build(cls, requests: list[Request], vocab_size: int, device: torch.device,
              grammar: tuple[list[int], torch.Tensor | None] = ([], None),
              penalty_state: PenaltyState | None = None) -> "SamplingBatch":
        """`grammar`: (rows, bitmask) from structured_output.fill_bitmasks for these requests. `penalty_state`: the
        runner's device-side token counts (None: a one-off state filled from these requests' host lists)."""
        ps = [r.sampling_params for r in requests]

        def col(values, dtype=torch.float32):
            # From pinned memory without waiting: a pageable copy would wait for the device to finish its queue
            # (the forward pass just launched, and with async scheduling the step before it).
            if device.type != "cuda":
                return torch.tensor(values, dtype=dtype, device=device)
            return torch.tensor(values, dtype=dtype).pin_memory().to(device, non_blocking=True)

        greedy = [p.greedy for p in ps]
        penalties = None
        penalized = [i for i, p in enumerate(ps) if p.has_penalties]
        if penalized:
            state = penalty_state if penalty_state is not None else PenaltyState(vocab_size, device, len(penalized))
            penalties = Penalties(
                rows=col(penalized, torch.long),
                state_rows=col(state.rows([requests[i] for i in penalized]), torch.long),
                repetition=col([ps[i].repetition_penalty for i in penalized]),
                presence=col([ps[i].presence_penalty for i in penalized]),
                frequency=col([ps[i].frequency_penalty for i in penalized]),
                state=state)
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
        sampled_top_k = [p.top_k if not g else 0 for g, p in zip(greedy, ps)]
        any_top_k = any_sampled and any(k > 0 for k in sampled_top_k)
        any_top_p = any_sampled and any(p.top_p < 1.0 for p in ps)
        top_p_only = [i for i, (g, p) in enumerate(zip(greedy, ps)) if not g and p.top_k <= 0 and p.top_p < 1.0]
        return cls(
            # An all-greedy batch (the common case) takes the argmax alone: no per-row tensors to copy.
            temperature=col([0.0 if g else p.temperature for g, p in zip(greedy, ps)]) if any_sampled else None,
            greedy=col(greedy, torch.bool) if any_sampled else None,
            top_k=col([p.top_k for p in ps], torch.long) if any_top_k else None,
            top_p=col([p.top_p for p in ps]) if any_top_p else None,
            min_p=col([p.min_p for p in ps]) if any_sampled and any(p.min_p > 0 for p in ps) else None,
            banned=banned,
            generators=[r.generator for r in requests],
            num_logprobs=[p.logprobs for p in ps],
            penalties=penalties,
            max_top_k=max(sampled_top_k, default=0),
            top_p_only_rows=col(top_p_only, torch.long) if top_p_only else torch.empty(0, dtype=torch.long),
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


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      max_top_k: int | None = None, top_p_only_rows: torch.Tensor | None = None) -> torch.Tensor:
    """Keep the top_k most likely tokens, then the smallest set whose probability reaches top_p; the rest to -inf.

    Without a full-vocabulary sort. Each row ends with one threshold, and keeps every token whose logit reaches it:
    - top-k: the k-th largest logit, from torch.topk over the batch's largest k (max_top_k; a partial selection).
      Like the sort it replaces (and HF's warper) it keeps every token tied with the k-th.
    - top-p in a row with top_k: the kept set lies within those candidates, already in descending order. A token
      is kept when the mass strictly before it (its exclusive cumulative sum, normalised over every token the top-k
      threshold keeps) is below top_p: the rule "drop while the ascending cumulative sum <= 1 - top_p" of the
      sort, read from the other end. The threshold is the last kept candidate's logit. When ties with the k-th
      logit lie past the candidates, the candidates' mass is short of top_p only if those ties are needed, and
      then the k-th logit is the threshold, which keeps them.
    - top-p in a row without top_k (top_p_only_rows): the threshold is the probability v_m of the token where the
      descending cumulative sum first reaches top_p, and v_m is the largest v with mass(prob >= v) >= top_p
      (tokens at or above v_m hold at least top_p; any larger v excludes it, leaving less than top_p). Mass is
      monotone in v, so a bisection over the probabilities' float32 bit patterns (integers in the same order)
      finds v_m exactly in 31 full-row passes, each a compare and a sum: no sort, no data-dependent branch.
    So the kept set is the reference sort's, up to float rounding of the sums and tokens tied exactly at a top-p
    cut-off (all kept here, an arbitrary subset by the sort's unstable order there); draws from it are the same.
    Every step is a fixed sequence of device ops: nothing waits for the device."""
    rows, vocab = logits.shape
    cut = logits.new_full((rows,), float("-inf"))  # per row: the smallest logit kept
    if top_k is not None:
        width = min(max_top_k or vocab, vocab)
        cand = logits.topk(width, dim=-1).values  # [B, width], descending
        has_k = top_k > 0
        k = torch.where(has_k, top_k, torch.full_like(top_k, width)).clamp(1, width)
        kth = torch.where(has_k, cand.gather(1, (k - 1)[:, None]).squeeze(1), cut)
        cut = kth
        if top_p is not None:
            kept = logits.masked_fill(logits < kth[:, None], float("-inf"))
            probs = (cand - kept.logsumexp(dim=-1, keepdim=True)).exp().masked_fill(cand < kth[:, None], 0.0)
            before = probs.cumsum(dim=-1) - probs  # mass strictly before each candidate
            num_kept = (before < top_p[:, None]).sum(dim=-1).clamp(1, width)
            cut_p = cand.gather(1, (num_kept - 1)[:, None]).squeeze(1)
            cut = torch.where(has_k & (top_p < 1.0), torch.maximum(cut, cut_p), cut)
    if top_p is not None and top_p_only_rows is not None:
        if top_p_only_rows.numel() == 0:  # a shape, known on the host
            return logits.masked_fill(logits < cut[:, None], float("-inf"))
        sub = logits.index_select(0, top_p_only_rows)
        cut.index_copy_(0, top_p_only_rows, _top_p_threshold(sub, top_p.index_select(0, top_p_only_rows)))
    elif top_p is not None:  # rows not named: every row without top_k (bisected whole, then chosen per row)
        alone = top_p < 1.0 if top_k is None else (top_k <= 0) & (top_p < 1.0)
        cut = torch.where(alone, _top_p_threshold(logits, top_p), cut)
    return logits.masked_fill(logits < cut[:, None], float("-inf"))


def _top_p_threshold(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest logit of the smallest most-likely set whose probability reaches top_p (bisection
    over the probabilities' bit patterns; see apply_top_k_top_p)."""
    probs = logits.softmax(dim=-1)
    bits = probs.view(torch.int32)
    lo = torch.zeros(logits.shape[0], dtype=torch.int32, device=logits.device)  # mass(>= lo) >= top_p holds
    hi = bits.max(dim=-1).values  # the answer is at most the largest probability
    for _ in range(_TOP_P_BISECTION_STEPS):
        mid = lo + (hi - lo + 1) // 2
        mass = probs.masked_fill(bits < mid[:, None], 0.0).sum(dim=-1)
        ok = mass >= top_p
        lo = torch.where(ok, mid, lo)
        hi = torch.where(ok, hi, mid - 1)
    return logits.masked_fill(bits < lo[:, None], float("inf")).min(dim=-1).values


def apply_top_k_top_p_by_sort(logits: torch.Tensor, top_k: torch.Tensor | None,
                              top_p: torch.Tensor | None) -> torch.Tensor:
    """The full-vocabulary sort apply_top_k_top_p replaces, kept as the reference its tests compare with."""
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
            logits = apply_top_k_top_p(logits, batch.top_k, batch.top_p, batch.max_top_k, batch.top_p_only_rows)
        return logits.softmax(dim=-1)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, LogprobTensors | None]:
        """logits [B, V] -> (token ids [B], the rows' logprobs on the device or None); nothing is read back."""
        wants_logprobs = any(n is not None for n in batch.num_logprobs)
        if batch.all_greedy and not (wants_logprobs or batch.banned or batch.grammar_rows
                                     or batch.penalties is not None or batch.logit_bias is not None):
            return self.greedy(logits), None
        logits = logits.float()
        raw_logprobs = logits.log_softmax(dim=-1) if wants_logprobs else None
        for row, ids in batch.banned:
            logits[row, ids] = float("-inf")
        if batch.grammar_rows:
            apply_grammar_bitmask(logits, batch.grammar_rows, batch.grammar_bitmask)
        if batch.logit_bias is not None:
            apply_logit_bias(logits, batch.logit_bias)
        pen = batch.penalties
        if pen is not None:
            counts = pen.state.output_counts.index_select(0, pen.state_rows)
            penalized = apply_penalties(logits.index_select(0, pen.rows),
                                        pen.state.prompt_seen.index_select(0, pen.state_rows), counts,
                                        pen.repetition, pen.presence, pen.frequency)
            logits = logits.index_copy(0, pen.rows, penalized)
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            tokens = greedy_tokens
        else:
            probs = self.probs(logits, batch)
            noise = self._exponential_noise(probs, batch.generators)
            sampled = probs.div(noise).argmax(dim=-1)
            tokens = torch.where(batch.greedy, greedy_tokens, sampled)
        if pen is not None:  # the next step's counts include this step's tokens, on the device
            pen.state.record(pen.state_rows, tokens.index_select(0, pen.rows))
        logprobs = None
        if raw_logprobs is not None:
            logprobs = LogprobTensors.gather(raw_logprobs, tokens, batch.num_logprobs)
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


@dataclass
class LogprobTensors:
    """A step's sampled-token logprobs on the device: copied back with its tokens (model_runner.PendingStep), turned
    into {token id: Logprob} entries on the host afterwards."""

    chosen: torch.Tensor  # [B] the sampled token's logprob
    ranks: torch.Tensor  # [B] its rank (1 = the most likely)
    top_values: torch.Tensor | None  # [B, k], k the batch's largest count; None when it is 0
    top_ids: torch.Tensor | None
    tokens: torch.Tensor  # [B]
    counts: list[int | None]  # per row: None (no logprobs) or how many top tokens it asked for

    @classmethod
    def gather(cls, raw: torch.Tensor, tokens: torch.Tensor, counts: list[int | None]) -> "LogprobTensors":
        k = max(n or 0 for n in counts)
        chosen = raw.gather(1, tokens[:, None]).squeeze(1)
        ranks = (raw > chosen[:, None]).sum(dim=-1) + 1
        top_values = top_ids = None
        if k > 0:
            top_values, top_ids = raw.topk(k, dim=-1)
        return cls(chosen, ranks, top_values, top_ids, tokens, counts)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.chosen, self.ranks, self.top_values, self.top_ids, self.tokens) if t is not None]

    def with_tensors(self, tensors: list[torch.Tensor]) -> "LogprobTensors":
        """The same entries over other copies of tensors() (the host's)."""
        it = iter(tensors)
        chosen, ranks = next(it), next(it)
        top_values, top_ids = (next(it), next(it)) if self.top_values is not None else (None, None)
        return LogprobTensors(chosen, ranks, top_values, top_ids, next(it), self.counts)

    def entries(self) -> list:
        """Per row: None where its count is None, else {its token: Logprob} and its top `count` tokens' (ranks
        from 1, the most likely). Reads the tensors on the host (call it on host copies, or accept the wait)."""
        chosen, ranks, toks = self.chosen.tolist(), self.ranks.tolist(), self.tokens.tolist()
        top_vals = self.top_values.tolist() if self.top_values is not None else None
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        result = []
        for i, n in enumerate(self.counts):
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


def gather_logprobs(raw: torch.Tensor, tokens: torch.Tensor, counts: list[int | None]) -> list:
    """Per row of raw logprobs [B, V]: None where its count is None, else {its token: Logprob} and its top `count`
    tokens' (read back now)."""
    return LogprobTensors.gather(raw, tokens, counts).entries()
