"""Pickers: order the scored candidates best first (the primary, then fallbacks).

max-score-picker       descending total score; among equal scores the order starts at a per-request random
                       offset, so ties spread the primary evenly without shuffling the whole list
random-picker          a per-request random permutation, scores ignored
weighted-random-picker weighted sampling without replacement, P(first = e) = score(e) / Σ score
                       (Efraimidis–Spirakis: sort by u^(1/score), u ~ U(0,1)); zero scores go last in random
                       order; all zero → uniform

`maxNumOfEndpoints` (upstream's parameter) caps the list; default 1, as upstream: one endpoint is all a stock
ORIGINAL_DST cluster can parse. More (primary, then fallbacks) only for gateways that retry on the list.
Totals arrive as a numpy array aligned with the endpoints; pickers answer positions into that list.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np
import xxhash

from kvgate.epp.scheduling.framework import Picker, ProfileHandler
from kvgate.epp.scheduling.plugins._params import check_keys, int_param
from kvgate.epp.types import EndpointState, LLMRequest


class MaxScorePicker(Picker):
    type_name = "max-score-picker"

    def order(self, request: LLMRequest, endpoints: list[EndpointState], totals: np.ndarray, limit: int
              ) -> list[int]:
        n = len(endpoints)
        if n < 2:
            return list(range(n))
        # Rotate by a per-request offset, then stable-sort: each of k tied maxima is first with probability 1/k.
        # The offset is a hash of the request id: far cheaper than seeding a random.Random (sha512) per request.
        offset = xxhash.xxh3_64_intdigest(request.request_id.encode()) % n
        if limit == 1:  # the first maximum at or after the offset, without sorting
            ties = np.flatnonzero(totals == totals.max()).tolist()
            return [ties[bisect_left(ties, offset) % len(ties)]]
        rotated = np.roll(totals, -offset)  # rotated[j] = totals[(j + offset) % n]
        return [(j + offset) % n for j in np.argsort(-rotated, kind="stable").tolist()]


class RandomPicker(Picker):
    type_name = "random-picker"

    def order(self, request: LLMRequest, endpoints: list[EndpointState], totals: np.ndarray, limit: int
              ) -> list[int]:
        shuffled = list(range(len(endpoints)))
        self.rng(request).shuffle(shuffled)
        return shuffled


class WeightedRandomPicker(Picker):
    type_name = "weighted-random-picker"

    def order(self, request: LLMRequest, endpoints: list[EndpointState], totals: np.ndarray, limit: int
              ) -> list[int]:
        rng = self.rng(request)
        positive, zero = [], []
        for i, score in enumerate(totals.tolist()):
            if score > 0:
                positive.append((rng.random() ** (1.0 / score), i))  # larger key first: P(first) ∝ score
            else:
                zero.append(i)
        positive.sort(key=lambda kv: kv[0], reverse=True)
        rng.shuffle(zero)
        return [i for _, i in positive] + zero


class SingleProfileHandler(ProfileHandler):
    """Upstream's default profile handler: one profile runs every request (a config with more is refused)."""

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
