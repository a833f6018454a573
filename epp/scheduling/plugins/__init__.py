"""The plugin registry: EndpointPickerConfig `type` names → factories taking the `parameters` mapping."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from kvgate.epp.scheduling.framework import Plugin
from kvgate.epp.scheduling.plugins import (
    header_filter,
    kv_cache_utilization_scorer,
    lora_affinity_scorer,
    no_hit_lru_scorer,
    pickers,
    precise_prefix_cache_scorer,
    predicted_latency_scorer,
    predicted_ttft_scorer,
    prefill_interference_scorer,
    prefix_cache_affinity_filter,
    prefix_cache_scorer,
    prefix_group_balance_scorer,
    previous_response_filter,
    queue_scorer,
    running_requests_scorer,
    token_load_scorer,
)

PluginFactory = Callable[[Mapping[str, Any] | None], Plugin]

REGISTRY: dict[str, PluginFactory] = {
    "queue-scorer": queue_scorer.factory,
    "kv-cache-utilization-scorer": kv_cache_utilization_scorer.factory,
    "prefix-cache-scorer": prefix_cache_scorer.factory,
    "precise-prefix-cache-scorer": precise_prefix_cache_scorer.factory,
    "lora-affinity-scorer": lora_affinity_scorer.factory,
    "running-requests-size-scorer": running_requests_scorer.factory,
    "token-load-scorer": token_load_scorer.factory,
    "prefix-cache-affinity-filter": prefix_cache_affinity_filter.factory,
    "no-hit-lru-scorer": no_hit_lru_scorer.factory,
    "prefix-group-balance-scorer": prefix_group_balance_scorer.factory,
    "prefill-interference-scorer": prefill_interference_scorer.factory,
    "predicted-ttft-scorer": predicted_ttft_scorer.factory,
    "predicted-latency-scorer": predicted_latency_scorer.factory,
    "header-based-testing-filter": header_filter.factory,
    "previous-response-affinity-filter": previous_response_filter.factory,
    "max-score-picker": pickers.max_score_factory,
    "random-picker": pickers.random_factory,
    "weighted-random-picker": pickers.weighted_random_factory,
    "single-profile-handler": pickers.single_profile_handler_factory,
}


def create_plugin(type_name: str, parameters: Mapping[str, Any] | None = None, name: str | None = None) -> Plugin:
    """A new plugin instance; KeyError for an unknown type, ValueError for bad parameters."""
    plugin = REGISTRY[type_name](parameters)
    plugin.name = name or type_name
    return plugin
