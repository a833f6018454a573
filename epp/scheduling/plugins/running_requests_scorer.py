"""running-requests-size-scorer: prefer endpoints running fewer requests.

    score(e) = (max_r - r(e)) / (max_r - min_r)     r = vllm:num_requests_running
    all equal → every score is 1.0
"""

from __future__ import annotations

from kvgate.epp.scheduling.framework import Scorer
from kvgate.epp.scheduling.plugins._normalize import lower_is_better
from kvgate.epp.scheduling.plugins._params import check_keys
from kvgate.epp.types import EndpointState, LLMRequest


class RunningRequestsScorer(Scorer):
    type_name = "running-requests-size-scorer"

    def score(self, request: LLMRequest, endpoints: list[EndpointState]) -> dict[str, float]:
        return lower_is_better([e.endpoint.address for e in endpoints], [e.metrics.running_requests for e in endpoints])


def factory(parameters: dict | None) -> RunningRequestsScorer:
    check_keys(parameters, set(), RunningRequestsScorer.type_name)
    return RunningRequestsScorer()
