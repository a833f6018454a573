"""A request's life in the engine: WAITING -> RUNNING -> FINISHED_*, and PREEMPTED back to waiting.

A request's end is decided in one place, `Request.check_stop`, called once per accepted token by the
scheduler's `update_from_output`: EOS / stop token, stop string (its detokenizer), a complete structured
output (its grammar), max_tokens, the context length.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvgate.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvgate.engine.detokenizer import IncrementalDetokenizer
    from kvgate.engine.lora.request import LoRARequest
    from kvgate.engine.structured_output import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # EOS, stop token, stop string or a complete structured output
    FINISHED_LENGTH = 4  # max_tokens or the context length
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
        }.get(self)


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = most likely
    decoded_token: str | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # lower value = served first (vLLM's convention)
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None  # the adapter this request runs with; None = the base model
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose K/V are in the cache or are being computed by a scheduled step (the scheduler advances it when
    # it schedules a chunk, as vLLM V1's does).
    num_computed_tokens: int = 0
    # Tokens sampled by scheduled steps whose ids the host does not have yet: 1 between scheduling a step that
    # samples and its update, 2 with async scheduling (the next step is scheduled before this one's tokens arrive).
    num_output_placeholders: int = 0
    # Prompt tokens that the prefix cache supplied at the (last) admission.
    num_cached_tokens: int = -1
    # Prompt tokens the prefix cache held when the request arrived: what the prefill backlog does not count while it
    # waits (scheduler.prefill_tokens_pending); admission then asks the cache again.
    num_cached_on_arrival: int = 0
    num_preemptions: int = 0
    # Chained hashes of this request's full blocks, extended as tokens arrive.
    block_hashes: list[bytes] = field(default_factory=list)
    stop_reason: int | str | None = None
    # One {token_id: Logprob} per generated token when sampling_params.logprobs is set.
    logprobs: list[dict[int, Logprob]] | None = None
    # One entry per prompt token when sampling_params.prompt_logprobs is set, filled as its prefill chunks run: None
    # for the first token (nothing precedes it), then {token_id: Logprob} for each one (prompt_logprobs.py).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    first_token_time: float | None = None
    scheduled_time: float | None = None  # first time it was scheduled (queue time ends)
    max_model_len: int = 0
    sample_index: int = 0  # which of a parent's n samples this is
    # The output's text and stop strings (None: no text is kept, as in scheduler-only tests).
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)
    # The structured-output matcher when sampling_params.structured_outputs is set.
    grammar: RequestGrammar | None = field(default=None, repr=False)
    # Its own random source, so a seeded request draws the same tokens whatever it is batched with: a
    # torch.Generator for a seeded request on the torch runner (None: the global one), the sim's random.Random.
    generator: object | None = field(default=None, repr=False)
    # The speculative proposer's state kept between steps (spec_decode.py: the ngram proposer's NgramIndex).
    spec_state: object | None = field(default=None, repr=False)
    # Its drafts' acceptance record for adaptive drafting (spec_decode.DraftBackoff); None until it first drafts.
    draft_backoff: object | None = field(default=None, repr=False)
    # Output tokens its last step added: 1, or more when speculative decoding accepted drafts.
    num_step_tokens: int = 0

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        params = self.sampling_params
        if params.logprobs is not None:
            self.logprobs = []
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        # Outputs after which it surely ends (max_tokens, or the context length when known): a request whose
        # scheduled steps already sample that many needs no more steps (async scheduling).
        room = self.max_model_len - len(self.prompt_token_ids) if self.max_model_len > 0 else float("inf")
        self.output_limit = min(params.max_tokens if params.max_tokens is not None else float("inf"), room)
        # Greedy with nothing that reads per-row state when sampling (logprobs, min_tokens' banned ids, a grammar,
        # penalties, a logit bias, a seeded generator): a batch of only such requests is sampled by an argmax alone.
        self.plain_greedy = (params.greedy and params.logprobs is None and not params.min_tokens
                             and params.structured_outputs is None and params.seed is None
                             and not params.has_penalties and params.logit_bias is None)
        # Every id that can end it (EOS unless ignored, stop tokens): one set test per token in check_stop.
        self._stop_ids = frozenset(params.stop_token_ids) | frozenset(() if params.ignore_eos else params.eos_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self) -> bool:
        """Advance the grammar and the text by the last output token and decide whether the request ends
        (sets status and stop_reason); True when it finished. The only place a request's end is decided."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        grammar = self.grammar
        if grammar is not None:
            grammar.accept(last)
        # The EOS / stop token that ends a request is not part of its text.
        if last in self._stop_ids and (len(self.output_token_ids) >= params.min_tokens or grammar is not None):
            if not params.ignore_eos and last in params.eos_token_ids:
                return self._finish(RequestStatus.FINISHED_STOPPED, self._grammar_error())
            return self._finish(RequestStatus.FINISHED_STOPPED, last)
        if self.detokenizer is not None:
            stop = self.detokenizer.add_token(last)
            if stop is not None:
                return self._finish(RequestStatus.FINISHED_STOPPED, stop)
        if grammar is not None and (grammar.is_terminated or grammar.error is not None):
            return self._finish(RequestStatus.FINISHED_STOPPED, self._grammar_error())
        if params.max_tokens is not None and len(self.output_token_ids) >= params.max_tokens:
            return self._finish(RequestStatus.FINISHED_LENGTH)
        if len(self.all_token_ids) >= self.max_model_len:
            return self._finish(RequestStatus.FINISHED_LENGTH)
        return False

    def _grammar_error(self) -> str | None:
        if self.grammar is None or self.grammar.error is None:
            return None
        return f"structured output error: {self.grammar.error}"

    def _finish(self, status: RequestStatus, stop_reason: int | str | None = None) -> bool:
        self.status = status
        self.stop_reason = stop_reason
        return True
