"""token-load-scorer: prefer endpoints with fewer tokens in flight from this EPP.

    score(e) = (max_t - t(e)) / (max_t - min_t)     t = estimated prompt + output tokens routed, not finished
    all equal → every score is 1.0

Unlike the queue scorer it reacts between scrapes: the EPP's own in-flight accounting moves at once.
"""

from __future__ import annotations

from kvgate.epp.scheduling.framework import Scorer
from kvgate.epp.scheduling.plugins._normalize import lower_is_better
from kvgate.epp.scheduling.plugins._params import check_keys
from kvgate.epp.types import EndpointState, LLMRequest


class TokenLoadScorer(Scorer):
    type_name = "token-load-scorer"

    def score(self, request: LLMRequest, endpoints: list[EndpointState]) -> dict[str, float]:
        return lower_is_better([e.endpoint.address for e in endpoints], [e.in_flight_tokens for e in endpoints])


def factory(parameters: dict | None) -> TokenLoadScorer:
    check_keys(parameters, set(), TokenLoadScorer.type_name)
    return TokenLoadScorer()
