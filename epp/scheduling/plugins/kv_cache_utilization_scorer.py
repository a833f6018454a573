"""kv-cache-utilization-scorer: prefer endpoints with free KV cache.

    score(e) = 1 - kv_cache_usage(e)        kv_cache_usage = vllm:kv_cache_usage_perc in [0, 1]

Computed once per metrics snapshot (framework.Snapshot), not once per request.
"""

from __future__ import annotations

import numpy as np

from kvgate.epp.scheduling.framework import CycleState, Scorer, clamp_scores
from kvgate.epp.scheduling.plugins._normalize import attribute_values, per_snapshot
from kvgate.epp.scheduling.plugins._params import check_keys
from kvgate.epp.types import EndpointState, LLMRequest


def _scores(endpoints: list[EndpointState]) -> np.ndarray:
    return clamp_scores(1.0 - attribute_values(endpoints, "metrics.kv_cache_usage"))


class KVCacheUtilizationScorer(Scorer):
    type_name = "kv-cache-utilization-scorer"

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> np.ndarray:
        return per_snapshot(self, cycle, endpoints, _scores)


def factory(parameters: dict | None) -> KVCacheUtilizationScorer:
    check_keys(parameters, set(), KVCacheUtilizationScorer.type_name)
    return KVCacheUtilizationScorer()
