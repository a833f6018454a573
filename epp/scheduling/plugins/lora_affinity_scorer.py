"""lora-affinity-scorer: prefer endpoints that already serve (or can load) the requested LoRA adapter.

    score(e) = 1.0  target model is a running adapter on e
               0.8  target model is waiting to be loaded on e
               0.6  e has a free adapter slot: len(running) < max_lora
               0.0  otherwise
    no candidate serves adapters at all (max_lora == 0 everywhere) → every score is 1.0 (the base model)

(Upstream ranks "free slot" 0.8 above "waiting" 0.6; kvgate prefers an adapter already on its way in.)
"""

from __future__ import annotations

from kvgate.epp.scheduling.framework import CycleState, Scorer
from kvgate.epp.scheduling.plugins._params import check_keys
from kvgate.epp.types import EndpointState, LLMRequest

RUNNING, WAITING, FREE_SLOT, FULL = 1.0, 0.8, 0.6, 0.0


class LoraAffinityScorer(Scorer):
    type_name = "lora-affinity-scorer"

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> dict[str, float]:
        if all(e.metrics.max_lora <= 0 for e in endpoints):
            return {e.address: 1.0 for e in endpoints}
        target = request.target_model
        scores = {}
        for e in endpoints:
            m = e.metrics
            if target in m.running_loras:
                scores[e.address] = RUNNING
            elif target in m.waiting_loras:
                scores[e.address] = WAITING
            elif len(m.running_loras) < m.max_lora:
                scores[e.address] = FREE_SLOT
            else:
                scores[e.address] = FULL
        return scores


def factory(parameters: dict | None) -> LoraAffinityScorer:
    check_keys(parameters, set(), LoraAffinityScorer.type_name)
    return LoraAffinityScorer()
