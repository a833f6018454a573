"""token-load-scorer: prefer endpoints with fewer tokens in flight from this EPP.

    score(e) = (max_t - t(e)) / (max_t - min_t)     t = estimated prompt + output tokens routed, not finished
    all equal → every score is 1.0

It reads the EPP's own in-flight accounting as the director's round snapshot carries it (refreshed every
`--refresh-metrics-interval`, like the scraped metrics), and is computed per request, not cached per snapshot,
so callers that build states per request (EndpointState.in_flight_*) see every change at once.
"""

from __future__ import annotations

import numpy as np

from kvgate.epp.scheduling.framework import CycleState, Scorer
from kvgate.epp.scheduling.plugins._normalize import column, lower_is_better
from kvgate.epp.scheduling.plugins._params import check_keys
from kvgate.epp.types import EndpointState, LLMRequest


class TokenLoadScorer(Scorer):
    type_name = "token-load-scorer"

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> np.ndarray:
        return lower_is_better(column(endpoints, "in_flight_tokens"))


def factory(parameters: dict | None) -> TokenLoadScorer:
    check_keys(parameters, set(), TokenLoadScorer.type_name)
    return TokenLoadScorer()
