"""Pickers: order the scored candidates best first (the primary, then fallbacks).

max-score-picker       descending total score; among equal scores the order starts at a per-request random
                       offset, so ties spread the primary evenly without shuffling the whole list
random-picker          a per-request random permutation, scores ignored
weighted-random-picker weighted sampling without replacement, P(first = e) = score(e) / Σ score
                       (Efraimidis–Spirakis: sort by u^(1/score), u ~ U(0,1)); zero scores go last in random
                       order; all zero → uniform

`maxNumOfEndpoints` (upstream's parameter) caps the list; default 1, as upstream: one endpoint is all a stock
ORIGINAL_DST cluster can parse. More (primary, then fallbacks) only for gateways that retry on the list.
"""

from __future__ import annotations

from kvgate.epp.scheduling.framework import Picker, ProfileHandler
from kvgate.epp.scheduling.plugins._params import check_keys, int_param
from kvgate.epp.types import EndpointState, LLMRequest


class MaxScorePicker(Picker):
    type_name = "max-score-picker"

    def order(self, request: LLMRequest, endpoints: list[EndpointState], scores: dict[str, float]
              ) -> list[EndpointState]:
        if len(endpoints) < 2:
            return list(endpoints)
        # Rotate by a random offset, then stable-sort: each of k tied maxima is first with probability 1/k.
        offset = self.rng(request).randrange(len(endpoints))
        by_address = {e.endpoint.address: e for e in endpoints}
        addresses = list(by_address)
        addresses = addresses[offset:] + addresses[:offset]
        addresses.sort(key=scores.__getitem__, reverse=True)
        return [by_address[a] for a in addresses]


class RandomPicker(Picker):
    type_name = "random-picker"

    def order(self, request: LLMRequest, endpoints: list[EndpointState], scores: dict[str, float]
              ) -> list[EndpointState]:
        shuffled = list(endpoints)
        self.rng(request).shuffle(shuffled)
        return shuffled


class WeightedRandomPicker(Picker):
    type_name = "weighted-random-picker"

    def order(self, request: LLMRequest, endpoints: list[EndpointState], scores: dict[str, float]
              ) -> list[EndpointState]:
        rng = self.rng(request)
        positive, zero = [], []
        for e in endpoints:
            score = scores[e.endpoint.address]
            if score > 0:
                positive.append((rng.random() ** (1.0 / score), e))  # larger key first: P(first) ∝ score
            else:
                zero.append(e)
        positive.sort(key=lambda kv: kv[0], reverse=True)
        rng.shuffle(zero)
        return [e for _, e in positive] + zero


class SingleProfileHandler(ProfileHandler):
    """Upstream's default profile handler; accepted so upstream configs load (kvgate runs the first profile)."""

    type_name = "single-profile-handler"


def _picker_factory(cls):
    def factory(parameters: dict | None) -> Picker:
        params = check_keys(parameters, {"maxNumOfEndpoints"}, cls.type_name)
        return cls(max_endpoints=int_param(params, "maxNumOfEndpoints", 1, cls.type_name, minimum=1))
    return factory


max_score_factory = _picker_factory(MaxScorePicker)
random_factory = _picker_factory(RandomPicker)
weighted_random_factory = _picker_factory(WeightedRandomPicker)


def single_profile_handler_factory(parameters: dict | None) -> SingleProfileHandler:
    check_keys(parameters, set(), SingleProfileHandler.type_name)
    return SingleProfileHandler()
