"""Per-request sampling parameters, validated on construction (vLLM's field names and meaning)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from kvgate.common.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
# Seeds are torch generator seeds (int64, vLLM's bound too); child i of an n > 1 request uses seed + i.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
_FLOATS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
MAX_LOGIT_BIAS = 100.0  # a logit_bias value is in [-100, 100] (OpenAI's range)


@dataclass
class StructuredOutputsParams:
    """vLLM's structured-output constraint: exactly one of json (a schema), json_object, regex, choice, grammar.

    `param` names the request field it came from, so errors point at it (see engine/structured_output.py)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise InvalidRequestError(f"{self.param} must set exactly one of json, json_object, regex, choice, "
                                      f"grammar; got {kinds or 'none'}", param=self.param)
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequestError(f"{self.param}: a JSON schema must be an object", param=self.param)
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) for c in self.choice)):
            raise InvalidRequestError(f"{self.param}: choice must be a non-empty list of strings", param=self.param)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{self.param}: {name} must be a non-empty string", param=self.param)

    @property
    def kind(self) -> str:
        if self.json is not None or self.json_object:
            return "json"
        return "regex" if self.regex is not None else "choice" if self.choice is not None else "grammar"

    @property
    def key(self) -> str:
        """The constraint as one string (what the grammar compiler takes, and caches on)."""
        if self.json_object:
            return '{"type": "object"}'
        if self.json is not None:
            return self.json if isinstance(self.json, str) else json.dumps(self.json, sort_keys=True)
        if self.choice is not None:
            return json.dumps(self.choice)
        return self.regex if self.regex is not None else self.grammar


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs per generated token (the chosen one is always given)
    # number of top logprobs per prompt token (vLLM's prompt_logprobs; the prompt's own token is always given, the
    # first prompt token has none). A request with it skips the prefix cache: a cached block has no logits.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    # {token id: bias} added to the token's logit before sampling (vLLM's logit_bias; the ids are checked against
    # the vocabulary when the engine takes the request). Empty is None.
    logit_bias: dict[int, float] | None = None
    # Filled by the engine from the tokenizer/config: EOS ids that end a request unless ignore_eos.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.logit_bias, dict) and not self.logit_bias:
            self.logit_bias = None
        self.validate()

    def validate(self) -> None:
        def bad(param: str, why: str) -> InvalidRequestError:
            return InvalidRequestError(f"{param} {why}", param=param)

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        for name in _FLOATS:  # NaN passes every comparison below, and an infinity poisons the sampler
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, f"must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be -1 (disabled) or a positive integer, got {self.top_k!r}")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise bad("prompt_logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX - (self.n - 1):
            raise bad("seed", f"must be in [{SEED_MIN}, {SEED_MAX - (self.n - 1)}] (a 64-bit seed; "
                              f"n={self.n} samples use seed .. seed + {self.n - 1}), got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must map token ids to biases")
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                    raise bad("logit_bias", f"keys must be token ids (integers >= 0), got {token!r:.40}")
                if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias) \
                        or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                    raise bad("logit_bias", f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                            f"got {bias!r:.40} for token {token}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        """Repetition, presence or frequency penalty on: sampling reads the request's earlier tokens."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
