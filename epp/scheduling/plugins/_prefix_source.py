"""What load-aware plugins read of the prefix match (PREFIX_MATCH, scheduling/prefix_match.py) their profile's prefix
scorer produces, and the fallback when none does: the prompt's estimate, nothing cached."""

from __future__ import annotations

import numpy as np

from kvgate.epp.scheduling.data import PICKED_UNCACHED_TOKENS
from kvgate.epp.scheduling.framework import CycleState, Plugin
from kvgate.epp.scheduling.prefix_match import PREFIX_MATCH
from kvgate.epp.types import EndpointState, LLMRequest


def prefix_tokens(plugin: Plugin, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None
                  ) -> tuple[int, np.ndarray]:
    """(prompt tokens, cached tokens per endpoint) from the prefix match `plugin` reads; without one the prompt's
    estimate and nothing cached."""
    match = cycle.read(plugin, PREFIX_MATCH) if cycle is not None else None
    if match is None:
        return request.estimated_prompt_tokens, np.zeros(len(endpoints))
    return match.prompt_tokens, match.cached.of(endpoints)


def record_picked_uncached(plugin: Plugin, request: LLMRequest, endpoint: EndpointState,
                           cycle: CycleState | None) -> None:
    """Tell the director what the pick adds to the endpoint's prefill backlog: the prompt less its cached part."""
    if cycle is None or cycle.read(plugin, PREFIX_MATCH) is None:
        return
    prompt, cached = prefix_tokens(plugin, request, [endpoint], cycle)
    cycle.put(plugin, PICKED_UNCACHED_TOKENS, int(prompt - cached[0]))
