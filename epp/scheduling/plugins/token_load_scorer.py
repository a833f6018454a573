"""token-load-scorer: prefer endpoints with fewer tokens in flight from this EPP.

    t(e)     = Σ over requests routed to e and not yet released of (estimated prompt tokens + max_tokens)
    score(e) = (max_t - t(e)) / (max_t - min_t)
    all equal → every score is 1.0

t is exact at every decision: it comes from the director's live overlay (scheduling/live_load.py), updated on
each pick and each release, not from the round snapshot's frozen in_flight_tokens. Without an overlay (a caller
that builds states per request) it reads EndpointState.in_flight_tokens.
"""

from __future__ import annotations

import numpy as np

from kvgate.epp.scheduling import live_load
from kvgate.epp.scheduling.framework import CycleState, Scorer
from kvgate.epp.scheduling.plugins._normalize import lower_is_better
from kvgate.epp.scheduling.plugins._params import check_keys
from kvgate.epp.types import EndpointState, LLMRequest


class TokenLoadScorer(Scorer):
    type_name = "token-load-scorer"

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> np.ndarray:
        return lower_is_better(live_load.live_column(cycle, endpoints, "tokens"))


def factory(parameters: dict | None) -> TokenLoadScorer:
    check_keys(parameters, set(), TokenLoadScorer.type_name)
    return TokenLoadScorer()
