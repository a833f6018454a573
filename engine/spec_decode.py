"""Speculative decoding (vLLM's `--speculative-config`): by prompt lookup (`"method": "ngram"`, here) or with a
draft model (`"method": "draft_model"`, draft_model.py, whose q rows verify_sampled takes).

Both proposers implement `Proposer`, the scheduler's two phases a step (reserve each decoding request's drafts while
sizing chunks, then fill the step's drafts in one call). The scheduler asks `NgramProposer` for up to K draft tokens per
decoding request: the tokens that followed the
earliest earlier occurrence of the longest n-gram (prompt_lookup_max down to prompt_lookup_min) that ends the
request's tokens. The step computes the request's last token and its drafts together (one chunk of 1 + K positions in
the same forward pass as everything else), and the runner verifies the drafts here: greedy rows accept while the
draft equals the argmax; sampled rows accept a draft x with probability p(x) (an n-gram draft is one token for sure,
q = one-hot), else draw from max(p - q, 0) normalised, which keeps the target distribution. The step's tokens are the
accepted drafts and one more (the target's token at the first rejection, or the bonus token after the last draft).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvgate.common import bounded_json
from kvgate.common.errors import ConfigError

METHODS = ("ngram", "draft_model")
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    model: str | None = None  # draft_model: the draft's folder (or demo / copier)

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        try:
            data = bounded_json.loads(text, bounded_json.FLAG_BYTES)
        except bounded_json.JSONLimitError as exc:
            raise ConfigError(f"--speculative-config: {exc}") from None
        except ValueError as exc:
            raise ConfigError(f"--speculative-config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError('--speculative-config must be a JSON object, e.g. {"method": "ngram", '
                              '"num_speculative_tokens": 4, "prompt_lookup_max": 4}')
        return cls.from_dict(data)

    @classmethod
    def from_dict(cls, data: dict) -> SpeculativeConfig:
        unknown = sorted(set(data) - set(_KEYS))
        if unknown:
            raise ConfigError(f"--speculative-config: unknown key(s) {', '.join(unknown)}; known: {', '.join(_KEYS)}")
        method = data.get("method")
        if method is None and data.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling
            method = "ngram"
        if method is None and isinstance(data.get("model"), str):  # vLLM infers a draft model from a model alone
            method = "draft_model"
        if method == "[ngram]":
            method = "ngram"
        if method not in METHODS:
            raise ConfigError(f"--speculative-config: method must be ngram or draft_model, got {method!r}")
        k = data.get("num_speculative_tokens")
        lo, hi = data.get("prompt_lookup_min"), data.get("prompt_lookup_max")
        for name, value in (("num_speculative_tokens", k), ("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ConfigError(f"--speculative-config: {name} must be a positive integer, got {value!r}")
        if k is None:
            raise ConfigError("--speculative-config: num_speculative_tokens is required")
        if method == "draft_model":
            model = data.get("model")
            if not isinstance(model, str) or not model:
                raise ConfigError("--speculative-config: method draft_model needs \"model\": the draft model's folder")
            if lo is not None or hi is not None:
                raise ConfigError("--speculative-config: prompt_lookup_min/max are ngram keys, not draft_model's")
            return cls(method, k, 0, 0, model)
        # vLLM's defaults: both 5 when neither is given, else the one given for both.
        if lo is None and hi is None:
            lo = hi = 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        if lo > hi:
            raise ConfigError(f"--speculative-config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        return cls(method, k, lo, hi)


class NgramIndex:
    """The earliest start of every n-gram (n in [min_n, max_n]) of a request's tokens, extended as they grow: a
    lookup is then a dict probe per n instead of a search of the whole context. Searching with numpy each step (sliding
    windows over the tokens) costs host time that grows with every request's context, a visible share of a speculative
    run's steps (`kvgate bench engine --num-requests 8 --output-len 192 --max-prompt-len 256` with prompt lookup); this
    costs a dict update per new token. Memory: one dict entry per distinct n-gram per n (~150 bytes), freed with the
    request."""

    __slots__ = ("first", "end")

    def __init__(self, min_n: int, max_n: int) -> None:
        self.first: dict[int, dict[tuple, int]] = {n: {} for n in range(min_n, max_n + 1)}
        self.end = 0  # n-grams ending before this position are indexed

    def extend(self, tokens: list[int], end: int) -> None:
        """Index the n-grams tokens[i:i + n] with self.end < i + n <= end."""
        if end < self.end:  # the tokens were replaced (never by the scheduler): start again
            for first in self.first.values():
                first.clear()
            self.end = 0
        for n, first in self.first.items():
            for i in range(max(0, self.end - n + 1), end - n + 1):
                first.setdefault(tuple(tokens[i:i + n]), i)
        self.end = max(self.end, end)


class Proposer:
    """Who drafts for speculative decoding, in the scheduler's two phases a step:

    1. `reserve(request, limit)`, per decoding request while the scheduler sizes the step's chunks: the request's
       drafts this step, at most `limit` of them ([] for none). Their number sizes its chunk (its last token and the
       drafts), whose blocks the scheduler then allocates. The tokens are the drafts themselves where the proposer
       has them at once (ngram), else placeholders of the length it reserves (a draft model, which drafts for the
       whole step in one batched run and needs the chunks' blocks first: it writes its K/V into their slots).
    2. `fill(requests, drafts, block_table)`, once per step that has drafts, after every chunk is sized and
       allocated: for each drafting request (in the order given) its draft tokens, as many as reserved, and q
       ([len, target vocab]: the distribution each draft was sampled from; None for a one-hot q).
    """

    def reserve(self, request, limit: int) -> list[int]:
        raise NotImplementedError

    def fill(self, requests: list, drafts: list[list[int]], block_table) -> list[tuple[list[int], object]]:
        """The tokens phase one gave are the drafts, q one-hot (ngram, and any proposer that drafts at once)."""
        return [(draft, None) for draft in drafts]


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.k = config.num_speculative_tokens
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.max_model_len = max_model_len

    def propose(self, tokens: list[int], limit: int, index: NgramIndex | None = None) -> list[int]:
        """Up to min(K, limit) tokens that followed the longest n-gram ending `tokens` where it occurred earliest
        before; [] when none of n in [min, max] occurs earlier (vLLM's ngram proposer). index: the request's
        NgramIndex over these tokens, kept between calls (see reserve); a throwaway one without it."""
        total = len(tokens)
        k = min(self.k, limit, self.max_model_len - total)
        if k <= 0 or total <= self.min_n:
            return []
        if index is None:
            index = NgramIndex(self.min_n, self.max_n)
        index.extend(tokens, total - 1)  # an occurrence must end before the last token (not the suffix itself)
        first = index.first
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            start = first[n].get(tuple(tokens[total - n:]))
            if start is not None:
                return tokens[start + n:start + n + k]
        return []

    def reserve(self, request, limit: int) -> list[int]:
        """Phase one: the drafts themselves, propose() over the request's tokens, with the request keeping its
        NgramIndex (request.spec_state). Phase two (fill) is Proposer's: these tokens, q one-hot."""
        if request.spec_state is None:
            request.spec_state = NgramIndex(self.min_n, self.max_n)
        return self.propose(request.all_token_ids, limit, request.spec_state)


class _BackoffState:
    """A request's drafting record: `estimate` (accepted drafts per drafted step, a moving average), `pause` (the
    last pause in steps; 0 while drafting every step) and `skip` (steps of the current pause still to wait)."""

    __slots__ = ("estimate", "pause", "skip")

    def __init__(self, estimate: float) -> None:
        self.estimate, self.pause, self.skip = estimate, 0, 0


class DraftBackoff:
    """Adaptive drafting (EngineConfig.speculative_backoff_threshold): a request whose drafts keep being rejected
    stops paying for them. Why: a drafted step computes K more positions for the request (a draft model also runs K
    forwards for it) whether or not anything is accepted, so on text the proposer cannot predict speculation is a
    pure cost, per request: vLLM drafts every step regardless.

    Per request, `estimate` is the mean number of drafts accepted per drafted step, an exponential moving average
    (the latest step weighs WEIGHT), starting at PRIOR x the threshold: a request that drafts and accepts nothing
    falls below the threshold after 3 such steps. Below it, the request stops drafting for `pause` of its decode
    steps, then drafts again once (a probe): if the estimate is still below, the next pause is twice as long (up to
    MAX_PAUSE); once it is back at the threshold (from about 0, a probe that accepts 2 x threshold drafts), drafting
    resumes every step and the pause starts again from FIRST_PAUSE. Steps in which the proposer has no draft (no
    n-gram match) change nothing: a probe is the next step that has drafts.

    Outputs never change: greedy verification yields the target's argmax whether or not a step drafts, and rejection
    sampling keeps the target distribution in every step it runs in, whatever decided beforehand to draft."""

    WEIGHT = 0.5
    PRIOR = 4.0
    FIRST_PAUSE = 1
    MAX_PAUSE = 32

    def __init__(self, threshold: float, stats: SpecDecodeStats | None = None) -> None:
        self.threshold = threshold
        self.stats = stats  # counts the paused steps (SpecDecodeStats.num_paused_steps)

    def allows(self, request) -> bool:
        """Whether the request may draft in this step: asked once for each decode step it is scheduled for."""
        state = request.draft_backoff
        if state is None or not state.skip:
            return True
        state.skip -= 1
        if self.stats is not None:
            self.stats.num_paused_steps += 1
        return False

    def record(self, request, num_accepted: int) -> None:
        """A drafted step of the request's accepted `num_accepted` drafts."""
        state = request.draft_backoff
        if state is None:
            state = request.draft_backoff = _BackoffState(self.PRIOR * self.threshold)
        state.estimate += self.WEIGHT * (num_accepted - state.estimate)
        if state.estimate >= self.threshold:
            state.pause = 0
        else:
            state.pause = min(2 * state.pause, self.MAX_PAUSE) if state.pause else self.FIRST_PAUSE
            state.skip = state.pause


@dataclass
class SpecDecodeStats:
    """Counters behind vLLM's vllm:spec_decode_* metrics (since the engine started)."""

    num_drafts: int = 0  # requests that carried drafts in a step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [K]: drafts accepted at position i
    num_paused_steps: int = 0  # decode steps in which DraftBackoff held a request's drafting back (not vLLM's)

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def since(self, before: SpecDecodeStats) -> SpecDecodeStats:
        """The counts added after `before` (a copy taken earlier)."""
        return SpecDecodeStats(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                               self.num_accepted_tokens - before.num_accepted_tokens,
                               [a - b for a, b in zip(self.accepted_per_pos, before.accepted_per_pos)],
                               self.num_paused_steps - before.num_paused_steps)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculating step yields per request on average (1 + accepted drafts)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0


def speculation_eligible(request) -> bool:
    """Requests whose sampling reads per-token host state (grammars, penalties, min_tokens' bans, logprobs per
    token) are not speculated: their rows would need that state advanced through each draft. Nor are requests with a
    logit bias (the drafts are verified against the unbiased logits) or LoRA requests yet (untested with adapters)."""
    p = request.sampling_params
    return (p.structured_outputs is None and p.logprobs is None and not p.min_tokens and not p.has_penalties
            and p.logit_bias is None and request.grammar is None and request.lora_request is None)


def verify_greedy(target: list[int], draft: list[int]) -> list[int]:
    """target: the argmax at each of the 1 + len(draft) positions. Accept drafts while they equal the target's
    choice; the target's token at the first mismatch (or the bonus after the last draft) ends the run."""
    out = []
    for x, t in zip(draft, target):
        if x != t:
            out.append(t)
            return out
        out.append(x)
    out.append(target[len(draft)])
    return out


def verify_sampled(probs: torch.Tensor, draft: list[int], generator: torch.Generator | None,
                   draft_probs: torch.Tensor | None = None) -> list[int]:
    """probs [1 + len(draft), V]: the target's (processed) distribution at each position; draft_probs
    [len(draft), V]: the distribution q each draft was sampled from (a draft model's), None for a one-hot q (ngram).
    Rejection sampling: accept x with probability min(1, p(x) / q(x)); at the first rejection draw from
    max(p - q, 0) normalised; after the last draft, the bonus token from the last row."""
    d = len(draft)
    dev = probs.device
    index = torch.tensor(draft, dtype=torch.long, device=dev)
    p_draft = probs[torch.arange(d, device=dev), index] if d else probs.new_zeros(0)
    uniform = torch.rand(d, generator=generator, device=dev)
    residual = probs.clone()
    if d and draft_probs is not None:
        p_draft = p_draft / draft_probs[torch.arange(d, device=dev), index]  # q(x) > 0: x was drawn from q
        residual[:d] = (residual[:d] - draft_probs).clamp_min_(0.0)
    elif d:  # q one-hot: max(p - q, 0) is p without x (p(x) <= 1)
        residual[torch.arange(d, device=dev), index] = 0.0
    noise = torch.empty_like(residual).exponential_(generator=generator)
    candidates = residual.div_(noise).argmax(dim=-1).tolist()  # exponential race: a draw from each row's residual
    accepted = (uniform < p_draft).tolist()
    out = []
    for j in range(d):
        if not accepted[j]:
            out.append(candidates[j])
            return out
        out.append(draft[j])
    out.append(candidates[d])
    return out
