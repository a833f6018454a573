"""queue-scorer: prefer endpoints with shorter waiting queues.

    score(e) = (max_q - q(e)) / (max_q - min_q)     q = vllm:num_requests_waiting, over this request's candidates
    all queues equal → every score is 1.0
"""

from __future__ import annotations

from kvgate.epp.scheduling.framework import Scorer
from kvgate.epp.scheduling.plugins._normalize import lower_is_better
from kvgate.epp.scheduling.plugins._params import check_keys
from kvgate.epp.types import EndpointState, LLMRequest


class QueueScorer(Scorer):
    type_name = "queue-scorer"

    def score(self, request: LLMRequest, endpoints: list[EndpointState]) -> dict[str, float]:
        return lower_is_better([e.endpoint.address for e in endpoints],
                               [e.metrics.waiting_queue_size for e in endpoints])


def factory(parameters: dict | None) -> QueueScorer:
    check_keys(parameters, set(), QueueScorer.type_name)
    return QueueScorer()
