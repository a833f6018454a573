"""prefill-interference-scorer (kvgate's own): put a long prefill where it holds up the fewest other requests.

An engine runs one batch at a time: while it computes a request's uncached prompt, every other request it holds
waits — those not yet at their first token for it, decoding ones between two tokens — and so does every request
that arrives meanwhile. The prefill's own wait is what the load scorers weigh; this weighs the delay it puts on
the others:

    u(e)    = prompt tokens e would compute for the request (prompt less what e caches, per the profile's prefix
              scorer; the whole prompt without one)
    T(e)    = u(e) / R(e)       seconds the prefill holds e's steps; R(e) its prefill rate as the engine times it
                                (unmeasured: the measured endpoints' median; none measured: the arrivals term below
                                is left out, T in tokens)
    n(e)    = requests e holds now: scraped running + waiting, plus this EPP's picks since that scrape
    λ(e)    = requests picked for e over the last windowSeconds ÷ windowSeconds (this replica's picks and, with
              active-active peers, theirs)
    harm(e) = T(e) × (n(e) + λ(e) × T(e) / 2)     request-seconds of delay: those there now wait T, those arriving
                                                  during it T/2 on average
    score(e) = 1 - (harm(e) - min harm) / max harm          all zero → 1 everywhere

Pools of mixed hardware: a replica's capacity share is c(e) = min(k(e), s(e)) — its KV cache and its prefill speed
relative to the largest / fastest (plugins/_relative_speed.py); the profile's group balance gives each replica
one-off prompts in proportion to s(e) and tenants in proportion to k(e), so c(e) is the share of the tighter of the
two (where only speed differs, it counts a slow replica's tenants as more harm than its share explains, which sends
a cold prompt to the replica that prefills it faster) — and at c(e) a replica holds requests in proportion to
c(e)/s(e) (arrivals ∝ c(e), each held ∝ 1/s(e)) and its prefills take ∝ 1/s(e): harm(e) ∝ c(e)/s(e)² there,
however well the pool runs. The scorer compares

    harm'(e) = harm(e) × s(e)² / c(e)           (capacityShares true, the default; 1 × harm in a uniform pool)

the harm beyond what each replica's share explains, so it moves a prompt off a replica busier than its share and
never works against the shares themselves. Without it, on cards of two memory sizes the big cards, holding twice
the groups and so twice the requests, look busier and turn new groups to the small ones, whose caches then thrash
(`kvgate bench routing --shapes mixed-hardware --configs kvgate,kvgate-no-interference` compares them).

Scaled by the largest harm rather than min-max: candidates a few percent apart (equal replicas, a request all of
them have cached) score a few percent apart, so the scorer moves a decision only where the difference is real —
a cold prompt of 2000 tokens on the replica that serves a hot tenant's stream of cheap cached requests.

Why: with a skewed tenant mix the hot tenant's replica serves its hot tenant and other tenants' cold prompts besides,
and most of the requests in the TTFT tail are the hot tenant's own, queued behind those cold prefills (`kvgate bench
routing --workloads hot-tenant --per-request` lists them): the backlog a load scorer sees stays small there, since the
hot tenant's requests are nearly all cached. Parameters: windowSeconds > 0 = 10, prefixScorer = the profile's only
prefix scorer, maxPicksPerEndpoint ≥ 1 = 10000 (memory: the arrival record keeps at most that many timestamps an
endpoint), capacityShares true | false = true.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np

from kvgate.epp.scheduling import live_load
from kvgate.epp.scheduling.data import PREFILL_HARM, Deferred, PerEndpoint
from kvgate.epp.scheduling.framework import CycleState, Scorer
from kvgate.epp.scheduling.plugins._normalize import attribute_values, per_snapshot
from kvgate.epp.scheduling.plugins._params import bool_param, check_keys, float_param, int_param, str_param
from kvgate.epp.scheduling.plugins._prefix_source import prefix_tokens
from kvgate.epp.scheduling.plugins._relative_speed import (fill_unmeasured, prefill_rates, relative_kv_capacity,
                                                               relative_speed, timed_prefill_rates)
from kvgate.epp.scheduling.plugins.predicted_ttft_scorer import DEFAULT_PREFILL_TOKENS_PER_SECOND
from kvgate.epp.scheduling.prefix_match import PREFIX_MATCH
from kvgate.epp.types import EndpointState, LLMRequest

DEFAULT_WINDOW_S = 10.0
DEFAULT_MAX_PICKS = 10000
_RATE_KEY = "kvgate.prefill-rate-seconds-per-token"
_HELD_KEY = "kvgate.scraped-running-plus-waiting"


class PrefillInterferenceScorer(Scorer):
    type_name = "prefill-interference-scorer"
    consumes_optional = (PREFIX_MATCH,)  # the prompt tokens each endpoint would compute (without: the whole prompt)
    produces = (PREFILL_HARM,)  # harm(e) per candidate, for a filter that weighs it (the affinity filter's second home)

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, prefix_source_name: str = "",
                 max_picks: int = DEFAULT_MAX_PICKS, clock: Callable[[], float] = time.monotonic,
                 capacity_shares: bool = True) -> None:
        super().__init__()
        self.window_s = window_s
        self.capacity_shares = capacity_shares
        if prefix_source_name:
            self.sources[PREFIX_MATCH] = prefix_source_name
        self.max_picks = max_picks
        self.clock = clock
        self._picks: dict[str, deque[float]] = {}  # address → when its picks in the window were made, oldest first
        self._arrivals_key = (self, "arrivals")

    def arrival_rate(self, address: str, now: float) -> float:
        picks = self._picks.get(address)
        if not picks:
            return 0.0
        horizon = now - self.window_s
        while picks and picks[0] < horizon:
            picks.popleft()
        return len(picks) / self.window_s

    def harm(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
             ) -> np.ndarray:
        prompt, cached = prefix_tokens(self, request, endpoints, cycle)
        uncached = np.maximum(prompt - cached, 0.0)
        if not uncached.any():
            return uncached
        held = (per_snapshot(_HELD_KEY, cycle, endpoints, _scraped_held)  # metric columns: once per scrape round
                + live_load.live_column(cycle, endpoints, "unseen_requests"))
        seconds_per_token = per_snapshot(_RATE_KEY, cycle, endpoints, _seconds_per_token)
        if np.isnan(seconds_per_token).any():  # no engine times its prefill: compare in tokens, now-held only
            harm = uncached * held
        else:
            busy = uncached * seconds_per_token
            # once per scrape round (a 50 ms step in a 10 s window); the picks since count in `held`
            arrivals = per_snapshot(self._arrivals_key, cycle, endpoints, self._arrival_column)
            harm = busy * (held + arrivals * busy / 2)
        if self.capacity_shares:
            speed = relative_speed(endpoints, cycle)
            harm = harm * speed ** 2 / np.minimum(relative_kv_capacity(endpoints, cycle), speed)
        return harm

    def produce(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState) -> None:
        """harm(e) of each candidate (PREFILL_HARM), computed only for the cycles that read it (Deferred)."""
        cycle.put(self, PREFILL_HARM, Deferred(lambda: PerEndpoint(endpoints, self.harm_seconds(request, endpoints,
                                                                                             cycle), float("inf"))))

    def harm_seconds(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
                     ) -> np.ndarray:
        """harm(e) in request-seconds also where no engine times its prefill (harm is then in tokens): at each
        endpoint's estimated prefill rate, else the analytic model's default."""
        harm = self.harm(request, endpoints, cycle)
        if np.isnan(per_snapshot(_RATE_KEY, cycle, endpoints, _seconds_per_token)).any():
            harm = harm / prefill_rates(endpoints, DEFAULT_PREFILL_TOKENS_PER_SECOND)
        return harm

    def _arrival_column(self, endpoints: list[EndpointState]) -> np.ndarray:
        now = self.clock()
        return np.fromiter((self.arrival_rate(e.address, now) for e in endpoints), dtype=float, count=len(endpoints))

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> np.ndarray:
        harm = self.harm(request, endpoints, cycle)
        top = harm.max() if harm.size else 0.0
        if top <= 0:
            return np.ones(len(endpoints))
        return 1.0 - (harm - harm.min()) / top

    def _record(self, address: str) -> None:
        picks = self._picks.get(address)
        if picks is None:
            picks = self._picks[address] = deque(maxlen=self.max_picks)
        picks.append(self.clock())

    def pre_request(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None) -> None:
        self._record(endpoint.address)

    # Active-active (epp/peer_sync.py): a peer's picks arrive at the same endpoints, so they count in λ too.
    def share_pick(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None
                   ) -> list[int]:
        return []

    def peer_pick(self, pick_id: str, address: str, shared: list[int]) -> None:
        self._record(address)

    def remove_endpoint(self, address: str) -> None:
        self._picks.pop(address, None)


def _seconds_per_token(endpoints: list[EndpointState]) -> np.ndarray:
    """1 / R(e) from the engines' own prefill timing; unmeasured at the measured median; none measured: NaN."""
    rates = fill_unmeasured(timed_prefill_rates(endpoints))
    return np.full(len(endpoints), np.nan) if rates is None else 1.0 / rates


def _scraped_held(endpoints: list[EndpointState]) -> np.ndarray:
    return (attribute_values(endpoints, "metrics.running_requests")
            + attribute_values(endpoints, "metrics.waiting_queue_size"))


def factory(parameters: dict | None) -> PrefillInterferenceScorer:
    t = PrefillInterferenceScorer.type_name
    params = check_keys(parameters, {"windowSeconds", "prefixScorer", "maxPicksPerEndpoint", "capacityShares"}, t)
    return PrefillInterferenceScorer(
        window_s=float_param(params, "windowSeconds", DEFAULT_WINDOW_S, t, 0.0, min_inclusive=False),
        prefix_source_name=str_param(params, "prefixScorer", "", t),
        max_picks=int_param(params, "maxPicksPerEndpoint", DEFAULT_MAX_PICKS, t, 1),
        capacity_shares=bool_param(params, "capacityShares", True, t),
    )
