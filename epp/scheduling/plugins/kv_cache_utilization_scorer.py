"""kv-cache-utilization-scorer: prefer endpoints with free KV cache.

    score(e) = 1 - kv_cache_usage(e)        kv_cache_usage = vllm:kv_cache_usage_perc in [0, 1]
"""

from __future__ import annotations

from kvgate.epp.scheduling.framework import Scorer
from kvgate.epp.scheduling.plugins._params import check_keys
from kvgate.epp.types import EndpointState, LLMRequest


class KVCacheUtilizationScorer(Scorer):
    type_name = "kv-cache-utilization-scorer"

    def score(self, request: LLMRequest, endpoints: list[EndpointState]) -> dict[str, float]:
        scores = {}
        for e in endpoints:
            free = 1.0 - e.metrics.kv_cache_usage
            scores[e.endpoint.address] = 0.0 if free < 0.0 else 1.0 if free > 1.0 else free
        return scores


def factory(parameters: dict | None) -> KVCacheUtilizationScorer:
    check_keys(parameters, set(), KVCacheUtilizationScorer.type_name)
    return KVCacheUtilizationScorer()
