"""What load-aware plugins ask their PrefixMatchSource (scheduling/prefix_match.py), with the no-source fallback."""

from __future__ import annotations

import numpy as np

from kvgate.epp.scheduling.framework import CycleState
from kvgate.epp.scheduling.live_load import PICKED_UNCACHED_TOKENS
from kvgate.epp.scheduling.prefix_match import NeedsPrefixMatch
from kvgate.epp.types import EndpointState, LLMRequest


def prefix_tokens(plugin: NeedsPrefixMatch, request: LLMRequest, endpoints: list[EndpointState],
                  cycle: CycleState | None) -> tuple[int, np.ndarray]:
    """(prompt tokens, cached tokens per endpoint); without a source the prompt's estimate and nothing cached."""
    source = plugin.prefix_source
    if source is None:
        return request.estimated_prompt_tokens, np.zeros(len(endpoints))
    prompt = source.prompt_tokens(request, cycle)
    cached = np.asarray(source.cached_tokens(request, endpoints, cycle), dtype=float)
    return prompt, np.minimum(cached, prompt)


# `produces` of a plugin whose pick hook calls record_picked_uncached: the key, once it has a prefix source.
PRODUCES_PICKED_UNCACHED = property(lambda self: (PICKED_UNCACHED_TOKENS,) if self.prefix_source is not None else ())


def record_picked_uncached(plugin: NeedsPrefixMatch, request: LLMRequest, endpoint: EndpointState,
                           cycle: CycleState | None) -> None:
    """Tell the director what the pick adds to the endpoint's prefill backlog: the prompt less its cached part."""
    if cycle is None or plugin.prefix_source is None or PICKED_UNCACHED_TOKENS in cycle:
        return
    prompt, cached = prefix_tokens(plugin, request, [endpoint], cycle)
    cycle[PICKED_UNCACHED_TOKENS] = int(prompt - cached[0])
