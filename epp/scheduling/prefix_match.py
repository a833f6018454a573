"""The prefix match: how much of this prompt each candidate endpoint already holds in its KV cache.

Prefix scorers (the approximate `prefix-cache-scorer`, the event-fed `precise-prefix-cache-scorer`) produce it at
the start of a cycle, over the candidates; load-aware plugins (`prefix-cache-affinity-filter`,
`predicted-ttft-scorer`, ...) read it to weigh a cache hit against queueing. They read the one their
`prefixScorer` parameter names, else the profile's only one; without one they count nothing as cached.

    prompt_tokens   the prompt's length in tokens, as the producer counts them (exact when it tokenizes like the
                    engine, else an estimate)
    cached(e)       prompt tokens endpoint e already holds (its longest cached prefix of the prompt), ≤ prompt_tokens
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvgate.epp.scheduling.data import DataKey, PerEndpoint
from kvgate.epp.types import EndpointState

PREFIX_MATCH = DataKey("prefix-match", "name one with the consumer's prefixScorer parameter")


@dataclass(frozen=True)
class PrefixMatch:
    prompt_tokens: int
    cached: PerEndpoint  # ≤ prompt_tokens

    @classmethod
    def over(cls, prompt_tokens: int, endpoints: list[EndpointState], cached: np.ndarray) -> PrefixMatch:
        """The match for the candidates `endpoints`: `cached` aligned with them, capped at the prompt."""
        return cls(prompt_tokens, PerEndpoint(endpoints, np.minimum(np.asarray(cached, dtype=float), prompt_tokens)))
