"""no-hit-lru-scorer (llm-d's name): spread requests that no endpoint has cached, least recently cold-served first.

A cold request (no candidate holds any of its prompt, per the profile's prefix scorer; every request when there
is no prefix scorer) creates new KV blocks wherever it goes, so cold prefixes are spread:

    rank(e)  = 0                                       e has had no cold request (or fell out of the lruSize
                                                       most recent ones)
             = n_never + (position of e among the other candidates, least recently cold-picked first)
    score(e) = 1 - rank(e) / (n - 1)                   n candidates; n = 1 → 1
    a warm request (some candidate has a hit): 0.5 everywhere, neutral, so prefix affinity decides

When the pick is final and the request was cold, the picked endpoint becomes the most recent. (llm-d ranks
never-used endpoints by list order; here they tie, and the picker's random tie-break spreads them.)
Parameters: lruSize ≥ 1 = 1024 (llm-d's), prefixScorer (llm-d's prefixPluginName is read as the same; its
prefixPluginType is accepted, the scorer being found by name).
"""

from __future__ import annotations

from collections import OrderedDict
from operator import attrgetter

import numpy as np

from kvgate.epp.scheduling.framework import CycleState, Scorer
from kvgate.epp.scheduling.plugins._params import check_keys, int_param, str_param
from kvgate.epp.scheduling.plugins._prefix_source import prefix_tokens
from kvgate.epp.scheduling.prefix_match import PREFIX_MATCH
from kvgate.epp.types import EndpointState, LLMRequest

DEFAULT_LRU_SIZE = 1024  # llm-d's default
_address_of = attrgetter("endpoint.address")


class NoHitLRUScorer(Scorer):
    type_name = "no-hit-lru-scorer"
    consumes_optional = (PREFIX_MATCH,)  # which requests are cold (without: every one)

    def __init__(self, lru_size: int = DEFAULT_LRU_SIZE, prefix_source_name: str = "") -> None:
        super().__init__()
        self.lru_size = lru_size
        if prefix_source_name:
            self.sources[PREFIX_MATCH] = prefix_source_name
        self._cold_picks: OrderedDict[str, int] = OrderedDict()  # address → tick of its last cold pick
        self._tick = 0

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> np.ndarray:
        n = len(endpoints)
        _, cached = prefix_tokens(self, request, endpoints, cycle)
        cold = not cached.any()
        if cycle is not None:
            cycle[self] = cold
        if not cold:
            return np.full(n, 0.5)
        if n == 1:
            return np.ones(1)
        get = self._cold_picks.get
        ticks = np.fromiter((get(a, -1) for a in map(_address_of, endpoints)), dtype=float, count=n)
        used = ticks >= 0
        rank = np.zeros(n)
        order = np.flatnonzero(used)[np.argsort(ticks[used], kind="stable")]  # oldest cold pick first
        rank[order] = (n - len(order)) + np.arange(len(order))
        return 1.0 - rank / (n - 1)

    def pre_request(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None) -> None:
        cold = cycle.get(self) if cycle is not None else None
        if cold is None:  # scored without a cycle state (or this scorer did not run): ask now
            _, cached = prefix_tokens(self, request, [endpoint], cycle)
            cold = not cached.any()
        if not cold:
            return
        self._tick += 1
        self._cold_picks[endpoint.address] = self._tick
        self._cold_picks.move_to_end(endpoint.address)
        while len(self._cold_picks) > self.lru_size:
            self._cold_picks.popitem(last=False)

    def remove_endpoint(self, address: str) -> None:
        self._cold_picks.pop(address, None)


def factory(parameters: dict | None) -> NoHitLRUScorer:
    t = NoHitLRUScorer.type_name
    params = check_keys(parameters, {"lruSize", "prefixScorer", "prefixPluginName", "prefixPluginType"}, t)
    str_param(params, "prefixPluginType", "", t)
    name = str_param(params, "prefixScorer", "", t) or str_param(params, "prefixPluginName", "", t)
    return NoHitLRUScorer(lru_size=int_param(params, "lruSize", DEFAULT_LRU_SIZE, t, minimum=1),
                          prefix_source_name=name)
