"""queue-scorer: prefer endpoints with shorter waiting queues.

    q(e)     = scraped waiting (vllm:num_requests_waiting) + u(e)
    u(e)     = requests this EPP routed to e after the scrape the snapshot holds, still in flight
               (scheduling/live_load.py: the queue as it is now, not as the round's scrape saw it)
    score(e) = (max_q - q(e)) / (max_q - min_q)     over this request's candidates
    all queues equal → every score is 1.0

The scraped column and its scores are computed once per metrics snapshot (framework.Snapshot); only when some
routed request is not yet visible (u ≠ 0 somewhere) is the sum renormalized per request, a few numpy
operations. Without u, a burst within one scrape round would all see the same shortest queue (the herd).
"""

from __future__ import annotations

import numpy as np

from kvgate.epp.scheduling import live_load
from kvgate.epp.scheduling.framework import CycleState, Scorer
from kvgate.epp.scheduling.plugins._normalize import attribute_values, lower_is_better, per_snapshot
from kvgate.epp.scheduling.plugins._params import check_keys
from kvgate.epp.types import EndpointState, LLMRequest


def _waiting(endpoints: list[EndpointState]) -> np.ndarray:
    return attribute_values(endpoints, "metrics.waiting_queue_size")


class QueueScorer(Scorer):
    type_name = "queue-scorer"

    def __init__(self) -> None:
        super().__init__()
        self._waiting_key = (self, "waiting")

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> np.ndarray:
        waiting = per_snapshot(self._waiting_key, cycle, endpoints, _waiting)
        if live_load.unseen_total(cycle) == 0:
            return per_snapshot(self, cycle, endpoints, lambda _: lower_is_better(waiting))
        return lower_is_better(waiting + live_load.live_column(cycle, endpoints, "unseen_requests"))


def factory(parameters: dict | None) -> QueueScorer:
    check_keys(parameters, set(), QueueScorer.type_name)
    return QueueScorer()
