"""The scheduling framework: filter → score → pick, in profiles, modelled on kube-scheduler and upstream's EPP.

A SchedulingProfile runs its filters in order (each narrows the candidate list), then every scorer gives each
surviving endpoint a score in [0, 1]; an endpoint's total is Σ weight_i · score_i. The picker orders the
survivors from best to worst: the first is the primary target, the rest are fallbacks Envoy may try.

Plugins may also implement lifecycle hooks, which the Scheduler fans out:
  pre_request(request, endpoint)                       the pick is final (e.g. prefix index update)
  response_complete(request, address, prompt_tokens, completion_tokens)
  remove_endpoint(address)                             the endpoint left the pool (drop per-endpoint state)

The scheduler is not thread-safe: the EPP calls it from its one asyncio event loop.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvgate.epp.types import EndpointState, LLMRequest


class Plugin:
    """Base of every plugin. `type_name` is the registry key used in EndpointPickerConfig files."""

    type_name: str = ""

    def __init__(self) -> None:
        self.name = self.type_name

    def pre_request(self, request: LLMRequest, endpoint: EndpointState) -> None:
        """Called once the pick for `request` is final; `endpoint` is the primary target."""

    def response_complete(self, request: LLMRequest, endpoint_address: str, prompt_tokens: int,
                          completion_tokens: int) -> None:
        """Called when the response from `endpoint_address` has finished."""

    def remove_endpoint(self, address: str) -> None:
        """Called when `address` has left the pool."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class Filter(Plugin):
    def filter(self, request: LLMRequest, endpoints: list[EndpointState]) -> list[EndpointState]:
        raise NotImplementedError


class PinnedOrder(list):
    """A filter result whose order is the final answer: the scheduler returns it without scoring or picking.

    The conformance header filter uses it so that the endpoints a test lists come back primary first, in the
    listed order.
    """


class Scorer(Plugin):
    def score(self, request: LLMRequest, endpoints: list[EndpointState]) -> dict[str, float]:
        """{address: score in [0, 1]} (scorers keep to the range); a missing address scores 0."""
        raise NotImplementedError


class Picker(Plugin):
    """Orders scored endpoints best first. `max_endpoints` (upstream's maxNumOfEndpoints) caps the list; 0 = all."""

    def __init__(self, max_endpoints: int = 0) -> None:
        super().__init__()
        self.max_endpoints = max_endpoints

    def pick(self, request: LLMRequest, endpoints: list[EndpointState], scores: dict[str, float]
             ) -> list[EndpointState]:
        """`scores` holds every endpoint's weighted total, by address."""
        ordered = self.order(request, endpoints, scores)
        return ordered[: self.max_endpoints] if self.max_endpoints > 0 else ordered

    def order(self, request: LLMRequest, endpoints: list[EndpointState], scores: dict[str, float]
              ) -> list[EndpointState]:
        raise NotImplementedError

    @staticmethod
    def rng(request: LLMRequest) -> random.Random:
        """Per-request randomness: reproducible for one request id, spread across requests."""
        return random.Random(request.request_id)


class ProfileHandler(Plugin):
    """Marks a profile-handler plugin (upstream `single-profile-handler`); kvgate runs the primary profile."""


@dataclass
class WeightedScorer:
    scorer: Scorer
    weight: float


@dataclass
class SchedulingProfile:
    name: str
    filters: list[Filter] = field(default_factory=list)
    scorers: list[WeightedScorer] = field(default_factory=list)
    picker: Picker | None = None

    def plugins(self) -> list[Plugin]:
        found: list[Plugin] = [*self.filters, *(ws.scorer for ws in self.scorers)]
        if self.picker is not None:
            found.append(self.picker)
        return found

    def run(self, request: LLMRequest, candidates: Sequence[EndpointState]) -> list[EndpointState]:
        endpoints = list(candidates)
        pinned = False
        for f in self.filters:
            endpoints = f.filter(request, endpoints)
            pinned = pinned or isinstance(endpoints, PinnedOrder)
            if not endpoints:
                return []
        if pinned:
            return list(endpoints)
        if self.picker is None:
            raise RuntimeError(f"scheduling profile {self.name!r} has no picker")
        totals = dict.fromkeys([e.endpoint.address for e in endpoints], 0.0)
        for ws in self.scorers:
            if ws.weight == 0:
                continue
            weight = ws.weight
            # Walk the scorer's answer, not the candidates: sparse scorers (prefix hits) stay cheap.
            for address, s in ws.scorer.score(request, endpoints).items():
                if address in totals:
                    totals[address] += weight * s
        return self.picker.pick(request, endpoints, totals)


@dataclass
class SchedulerConfig:
    """Profiles to run (the first is primary) and every configured plugin instance by name."""

    profiles: list[SchedulingProfile]
    plugins: dict[str, Plugin] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        if not config.profiles:
            raise ValueError("a scheduler needs at least one scheduling profile")
        self.config = config
        self.primary = config.profiles[0]
        # Every distinct plugin instance, so that hooks run once per plugin even if shared by profiles.
        unique: dict[int, Plugin] = {}
        for p in [*config.plugins.values(), *(pl for prof in config.profiles for pl in prof.plugins())]:
            unique.setdefault(id(p), p)
        self.plugins: list[Plugin] = list(unique.values())
        self._pre_request = [p for p in self.plugins if _overrides(p, "pre_request")]
        self._response_complete = [p for p in self.plugins if _overrides(p, "response_complete")]
        self._remove_endpoint = [p for p in self.plugins if _overrides(p, "remove_endpoint")]

    def schedule(self, request: LLMRequest, candidates: Sequence[EndpointState]) -> list[EndpointState]:
        """All eligible candidates, best first (primary, then fallbacks); [] = none eligible (answer 503)."""
        if not candidates:
            return []
        return self.primary.run(request, candidates)

    def on_picked(self, request: LLMRequest, endpoint: EndpointState) -> None:
        for p in self._pre_request:
            p.pre_request(request, endpoint)

    def on_response_complete(self, request: LLMRequest, endpoint_address: str, prompt_tokens: int = 0,
                             completion_tokens: int = 0) -> None:
        for p in self._response_complete:
            p.response_complete(request, endpoint_address, prompt_tokens, completion_tokens)

    def remove_endpoint(self, address: str) -> None:
        for p in self._remove_endpoint:
            p.remove_endpoint(address)

    def plugin(self, name: str) -> Plugin | None:
        return self.config.plugins.get(name)

    def plugins_of_type(self, type_name: str) -> list[Plugin]:
        return [p for p in self.plugins if p.type_name == type_name]

    def prefix_stats(self) -> dict[str, float]:
        """The prefix-cache scorer's index size and hit ratio (summed over instances); {} when none is configured."""
        total: dict[str, float] = {}
        for p in self.plugins_of_type("prefix-cache-scorer"):
            for key, value in p.stats().items():
                total[key] = total.get(key, 0) + value
        if total:
            total["hit_ratio"] = total["hit_blocks"] / total["total_blocks"] if total["total_blocks"] else 0.0
        return total


def _overrides(plugin: Plugin, method: str) -> bool:
    return getattr(type(plugin), method) is not getattr(Plugin, method)
