"""queue-scorer: prefer endpoints with shorter waiting queues.

    score(e) = (max_q - q(e)) / (max_q - min_q)     q = vllm:num_requests_waiting, over this request's candidates
    all queues equal → every score is 1.0

Computed once per metrics snapshot (framework.Snapshot), not once per request.
"""

from __future__ import annotations

import numpy as np

from kvgate.epp.scheduling.framework import CycleState, Scorer
from kvgate.epp.scheduling.plugins._normalize import column, lower_is_better, per_snapshot
from kvgate.epp.scheduling.plugins._params import check_keys
from kvgate.epp.types import EndpointState, LLMRequest


def _scores(endpoints: list[EndpointState]) -> np.ndarray:
    return lower_is_better(column(endpoints, "metrics.waiting_queue_size"))


class QueueScorer(Scorer):
    type_name = "queue-scorer"

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> np.ndarray:
        return per_snapshot(self, cycle, endpoints, _scores)


def factory(parameters: dict | None) -> QueueScorer:
    check_keys(parameters, set(), QueueScorer.type_name)
    return QueueScorer()
