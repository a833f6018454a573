"""How plugins share one answer to "how much of this prompt does each endpoint already hold in its KV cache?".

Prefix scorers (the approximate `prefix-cache-scorer`, the event-fed `precise-prefix-cache-scorer`) compute it;
load-aware plugins (`prefix-cache-affinity-filter`, `predicted-ttft-scorer`) need it to weigh a cache hit
against queueing. They must not compute it twice per request, nor know which scorer produced it, so a prefix
scorer implements PrefixMatchSource and memoizes its answer in the request's CycleState; a consumer is handed
the profile's source when the config is built (`wire_prefix_sources`), and asks it.

Contract of a source (all per request; call as often as needed, the work is done once per cycle):
  prompt_tokens(request, cycle)            the prompt's length in tokens, as the source counts them (exact when
                                            it tokenizes like the engine, else an estimate)
  cached_tokens(request, endpoints, cycle) np.ndarray aligned with `endpoints`: prompt tokens each endpoint
                                            already holds (its longest cached prefix of the prompt), ≤ prompt_tokens
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from kvgate.epp.scheduling.framework import CycleState, Plugin
from kvgate.epp.types import EndpointState, LLMRequest


@runtime_checkable
class PrefixMatchSource(Protocol):
    name: str

    def prompt_tokens(self, request: LLMRequest, cycle: CycleState | None) -> int: ...

    def cached_tokens(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None
                      ) -> np.ndarray: ...


class NeedsPrefixMatch:
    """Mixin for plugins that consume a PrefixMatchSource. `prefix_source_name` (a plugin parameter, may be
    empty) names the source; empty means the profile's only one. Without a source, `prefix_source` stays None
    and the plugin must behave as if no endpoint held any of the prompt."""

    prefix_source_name: str = ""
    prefix_source: PrefixMatchSource | None = None


def wire_prefix_sources(plugins: list[Plugin]) -> None:
    """Give every NeedsPrefixMatch plugin of one profile its source; ValueError when the named source is absent
    or the choice is ambiguous (two sources, none named)."""
    sources = {p.name: p for p in plugins if isinstance(p, PrefixMatchSource)}
    for plugin in plugins:
        if not isinstance(plugin, NeedsPrefixMatch):
            continue
        if plugin.prefix_source_name:
            if plugin.prefix_source_name not in sources:
                raise ValueError(f"plugin {plugin.name!r}: prefix source {plugin.prefix_source_name!r} is not a "
                                 f"prefix scorer of this profile (have: {sorted(sources) or 'none'})")
            plugin.prefix_source = sources[plugin.prefix_source_name]
        elif len(sources) == 1:
            plugin.prefix_source = next(iter(sources.values()))
        elif len(sources) > 1:
            raise ValueError(f"plugin {plugin.name!r}: the profile has several prefix scorers "
                             f"({sorted(sources)}); name one with its prefixScorer parameter")
        else:
            plugin.prefix_source = None
