"""prefix-cache-affinity-filter (llm-d's name): stay on the endpoints that hold most of the prompt, until their
load costs more than the hit saves.

    f(e)    = cached_tokens(e) / prompt_tokens                 from the profile's prefix scorer (PrefixMatchSource)
    warm    = {e : f(e) ≥ affinityThreshold},  cold = the other candidates
    L(e)    = tokens in flight from this EPP to e (exact at this decision: scheduling/live_load.py)
    w*      = argmin_warm L,   c* = argmin_cold L              the least loaded of each side
    saved   = cached_tokens(w*) - cached_tokens(c*)            prefill tokens going to w* instead of c* saves
    keep only warm   iff   L(w*) - L(c*) ≤ loadTolerance × saved
    else keep all    (stickiness broken: the warm side's queue costs more than the hit saves)

Every candidate is kept when none is warm, when there is no cold one, or — with probability
explorationProbability, drawn from the request id — to let other endpoints warm up (llm-d's exploration). So the
filter never returns an empty list, and returns the very list it got when it keeps all (the per-snapshot caches
of the scorers after it then still hold).

llm-d's version breaks stickiness on a predicted-TTFT gap (maxTTFTPenaltyMs, from its latency predictor); kvgate
compares in-flight tokens with the prefill tokens saved, which it knows exactly. Parameters: affinityThreshold
(0, 1] = 0.80, explorationProbability [0, 1] = 0.01, loadTolerance ≥ 0 = 1.0 (0: leave warm endpoints as soon as
they carry more load than the coldest; large: always sticky), prefixScorer = the profile's only prefix scorer.
"""

from __future__ import annotations

import numpy as np
import xxhash

from kvgate.epp.scheduling import live_load
from kvgate.epp.scheduling.framework import CycleState, Filter
from kvgate.epp.scheduling.plugins._params import check_keys, float_param, str_param
from kvgate.epp.scheduling.plugins._prefix import prefix_tokens, record_picked_uncached
from kvgate.epp.scheduling.prefix_match import NeedsPrefixMatch
from kvgate.epp.types import EndpointState, LLMRequest

DEFAULT_AFFINITY_THRESHOLD = 0.80  # llm-d's default
DEFAULT_EXPLORATION_PROBABILITY = 0.01  # llm-d's default


class PrefixCacheAffinityFilter(NeedsPrefixMatch, Filter):
    type_name = "prefix-cache-affinity-filter"

    def __init__(self, affinity_threshold: float = DEFAULT_AFFINITY_THRESHOLD,
                 exploration_probability: float = DEFAULT_EXPLORATION_PROBABILITY, load_tolerance: float = 1.0,
                 prefix_source_name: str = "") -> None:
        super().__init__()
        self.affinity_threshold = affinity_threshold
        self.exploration_probability = exploration_probability
        self.load_tolerance = load_tolerance
        self.prefix_source_name = prefix_source_name

    def filter(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
               ) -> list[EndpointState]:
        if len(endpoints) <= 1 or self.prefix_source is None or self._explores(request):
            return endpoints
        prompt, cached = prefix_tokens(self, request, endpoints, cycle)
        warm = cached >= self.affinity_threshold * prompt
        if not warm.any() or warm.all():
            return endpoints
        load = live_load.column(cycle, endpoints, "tokens")
        w = _argmin_where(load, warm)
        c = _argmin_where(load, ~warm)
        if load[w] - load[c] > self.load_tolerance * (cached[w] - cached[c]):
            return endpoints
        return [e for e, keep in zip(endpoints, warm) if keep]

    def _explores(self, request: LLMRequest) -> bool:
        if self.exploration_probability <= 0:
            return False
        draw = xxhash.xxh3_64_intdigest(request.request_id.encode(), seed=0x5EED) / 2.0**64
        return draw < self.exploration_probability

    def pre_request(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None) -> None:
        record_picked_uncached(self, request, endpoint, cycle)


def _argmin_where(values: np.ndarray, mask: np.ndarray) -> int:
    return int(np.argmin(np.where(mask, values, np.inf)))


def factory(parameters: dict | None) -> PrefixCacheAffinityFilter:
    t = PrefixCacheAffinityFilter.type_name
    params = check_keys(parameters, {"affinityThreshold", "explorationProbability", "loadTolerance",
                                     "prefixScorer"}, t)
    return PrefixCacheAffinityFilter(
        affinity_threshold=float_param(params, "affinityThreshold", DEFAULT_AFFINITY_THRESHOLD, t, 0.0, 1.0,
                                       min_inclusive=False),
        exploration_probability=float_param(params, "explorationProbability", DEFAULT_EXPLORATION_PROBABILITY, t,
                                            0.0, 1.0),
        load_tolerance=float_param(params, "loadTolerance", 1.0, t, 0.0),
        prefix_source_name=str_param(params, "prefixScorer", "", t),
    )
