"""running-requests-size-scorer: prefer endpoints running fewer requests.

    score(e) = (max_r - r(e)) / (max_r - min_r)     r = vllm:num_requests_running
    all equal → every score is 1.0

Computed once per metrics snapshot (framework.Snapshot), not once per request.
"""

from __future__ import annotations

import numpy as np

from kvgate.epp.scheduling.framework import CycleState, Scorer
from kvgate.epp.scheduling.plugins._normalize import attribute_values, lower_is_better, per_snapshot
from kvgate.epp.scheduling.plugins._params import check_keys
from kvgate.epp.types import EndpointState, LLMRequest


def _scores(endpoints: list[EndpointState]) -> np.ndarray:
    return lower_is_better(attribute_values(endpoints, "metrics.running_requests"))


class RunningRequestsScorer(Scorer):
    type_name = "running-requests-size-scorer"

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> np.ndarray:
        return per_snapshot(self, cycle, endpoints, _scores)


def factory(parameters: dict | None) -> RunningRequestsScorer:
    check_keys(parameters, set(), RunningRequestsScorer.type_name)
    return RunningRequestsScorer()
