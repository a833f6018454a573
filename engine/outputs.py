"""What the engine hands back per step and per finished request (vLLM's RequestOutput shape)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.engine.request import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str  # all text so far (stop string excluded)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    delta_text: str = ""  # text that became final since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # The prompt's logprobs when its sampling params asked for them (vLLM's field): None for the first token, then
    # {token_id: Logprob} per prompt token; whole, in a sample's first output and in its last (None in the others).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
