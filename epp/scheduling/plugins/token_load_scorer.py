"""token-load-scorer: prefer endpoints with fewer tokens in flight from this EPP.

    t(e)     = Σ over requests routed to e and not yet released of (estimated prompt tokens + max_tokens)
    score(e) = (max_t - t(e)) / (max_t - min_t)
    all equal → every score is 1.0

With loadUnit seconds, t(e) / s(e): e's tokens in the fastest replica's seconds, s(e) its relative prefill speed
(plugins/_relative_speed.py; a pool of mixed hardware). Parameters: loadUnit tokens | seconds = tokens.

t is exact at every decision: it comes from the director's live overlay (scheduling/live_load.py), updated on
each pick and each release, not from the round snapshot's frozen in_flight_tokens. Without an overlay (a caller
that builds states per request) it reads EndpointState.in_flight_tokens.
"""

from __future__ import annotations

import numpy as np

from kvgate.epp.scheduling import live_load
from kvgate.epp.scheduling.framework import CycleState, Scorer
from kvgate.epp.scheduling.plugins._normalize import lower_is_better
from kvgate.epp.scheduling.plugins._params import check_keys, load_unit_param
from kvgate.epp.scheduling.plugins._relative_speed import in_seconds
from kvgate.epp.types import EndpointState, LLMRequest


class TokenLoadScorer(Scorer):
    type_name = "token-load-scorer"

    def __init__(self, load_unit: str = "tokens") -> None:
        super().__init__()
        self.load_unit = load_unit

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> np.ndarray:
        tokens = live_load.live_column(cycle, endpoints, "tokens")
        return lower_is_better(in_seconds(tokens, endpoints, cycle, self.load_unit))


def factory(parameters: dict | None) -> TokenLoadScorer:
    t = TokenLoadScorer.type_name
    return TokenLoadScorer(load_unit=load_unit_param(check_keys(parameters, {"loadUnit"}, t), t))
