"""prefix-cache-affinity-filter (llm-d's name): stay on the endpoints that hold most of the prompt, until their
load costs more than the hit saves.

    f(e)    = cached(e) / prompt_tokens                       from the profile's prefix match (PREFIX_MATCH)
    warm    = {e : f(e) ≥ affinityThreshold},  cold = the other candidates
    L(e)    = loadSignal backlog: prompt tokens e still has to prefill — its kvgate:num_prefill_tokens_pending as
              last scraped, less what its running step had computed by then (EndpointMetrics.prefill_backlog),
              plus the uncached prompt tokens this EPP routed to e since (live_load.py) — the work that stands
              between a new request and its first token, exact to the last pick (but for the running step's phase,
              an estimate);
              loadSignal tokens: tokens in flight from this EPP to e (prompt + max_tokens, cached or not);
              auto (default): backlog when the endpoints export the metric (kvgate engines), else tokens
    w*      = argmin_warm L,   c* = argmin_cold L              the least loaded of each side
    saved   = cached_tokens(w*) - cached_tokens(c*)            prefill tokens going to w* instead of c* saves
    keep only warm   iff   L(w*) - L(c*) ≤ loadTolerance × saved
    else keep all    (stickiness broken: the warm side's queue costs more than the hit saves)

Every candidate is kept when none is warm, when there is no cold one, or — with probability
explorationProbability, drawn from the request id — to let other endpoints warm up (llm-d's exploration). So the
filter never returns an empty list, and returns the very list it got when it keeps all (the per-snapshot caches
of the scorers after it then still hold). It is a preference filter: with a picker returning fallbacks
(maxNumOfEndpoints > 1), the cold endpoints it dropped follow the warm ones, so a dead warm endpoint is retried
elsewhere by a gateway that follows fallbacks.

llm-d's version breaks stickiness on a predicted-TTFT gap (maxTTFTPenaltyMs, from its latency predictor); kvgate
compares the prefill backlog with the prefill tokens saved, both in tokens the same engine computes at the same
rate, so loadTolerance 1 means "leave only when the warm endpoint's first token would come later". Why not
in-flight tokens: a warm endpoint's in-flight requests are mostly cached and cost it little, yet counted whole
they break stickiness under load (`kvgate bench routing --workloads multi-tenant --configs affinity,kvgate`).
Pools of mixed speed (loadUnit seconds): a token of backlog on a replica half as fast costs twice the time, so
both sides of the comparison convert to the fastest replica's seconds with each endpoint's relative prefill speed
s(e) (plugins/_relative_speed.py, from the engines' own prefill timing; 1 for every endpoint of a uniform
pool, where the rule is the one above):

    w*, c*  = argmin of L(e) / s(e) on each side
    saved   = (prompt - cached(c*)) / s(c*) - (prompt - cached(w*)) / s(w*)
    keep only warm   iff   L(w*)/s(w*) - L(c*)/s(c*) ≤ loadTolerance × saved

A prefix whose traffic outgrows one endpoint (spillShare σ > 0; off unless set, 1.25 in kvgate's profile): the
rule above weighs one request's hit against the warm side's queue, and a tenant that asks for 40% of a pool of four
keeps its one warm replica's queue long while every single comparison still favours staying (its requests are
mostly cached, so the backlog stays under what a hit saves; `kvgate bench routing --workloads hot-tenant`,
docs/benchmarks.md). A spill costs one cold prefill and from then on serves the prefix from two warm endpoints, so
the filter also counts each sticky prefix's share of the recent requests (plugins/_prefix_rates.py: the prompt's
first affinityThreshold share, counts decayed over spillWindowSeconds, shares counted once a whole window has
passed) and gives it

    homes   = ⌈share × n / σ⌉       n = the candidates (an endpoint's fair share is 1 / n)
    spill   iff   homes > |warm|  and  L(w*) > L(c*)      keep only the cold candidates (the scorers pick which)

The spilled request's blocks are held on its endpoint from the pick (the precise scorer's request holds), so the
next request of the prefix finds two warm endpoints and the rule above chooses between them.

Where the copy must fit: without a fit test the spill evens the load where the pool's caches have room for the second
copy, and costs hit rate and the tail where they do not: the copy evicts what the cold replica serves (`kvgate bench
routing --workloads hot-tenant --configs kvgate,kvgate-no-spill,kvgate-spill-anywhere`, and the same with `kv_tokens`
doubled for caches with room). So with spillFit (default) and the KV room in the profile (KV_ROOM, kv_fit.py: produced by
the group balance with fitKvCapacity) only the cold candidates where the copy fits beside the groups they serve count as cold above;
where none does the request is not spilled (counted as a spill without room) and the rule above decides: on
oversubscribed caches the filter then behaves as without spilling, and where caches have room it spills
(docs/benchmarks.md).

Parameters: affinityThreshold (0, 1] = 0.80, explorationProbability [0, 1] = 0.01, loadTolerance ≥ 0 = 1.0 (0:
leave warm endpoints as soon as they carry more load than the coldest; large: always sticky; above 1 values the
cache a spill would pollute), loadSignal auto | backlog | tokens = auto, loadUnit tokens | seconds = tokens,
prefixScorer = the profile's only prefix scorer, spillShare ≥ 0 = 0 (off), spillWindowSeconds (0, 3600] = 30,
spillFit true | false = true.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import numpy as np
import xxhash

from kvgate.epp.scheduling import live_load
from kvgate.epp.scheduling.data import PICKED_UNCACHED_TOKENS
from kvgate.epp.scheduling.framework import CycleState, Filter
from kvgate.epp.scheduling.kv_fit import KV_ROOM
from kvgate.epp.scheduling.plugins._params import (LOAD_UNITS, bool_param, check_keys, choice_param, float_param,
                                                       load_unit_param, str_param)
from kvgate.epp.scheduling.plugins._prefix_rates import PrefixRates, prefix_key
from kvgate.epp.scheduling.plugins._relative_speed import relative_speed
from kvgate.epp.scheduling.plugins._prefix_source import prefix_tokens, record_picked_uncached
from kvgate.epp.scheduling.prefix_match import PREFIX_MATCH
from kvgate.epp.types import EndpointState, LLMRequest

DEFAULT_AFFINITY_THRESHOLD = 0.80  # llm-d's default
DEFAULT_EXPLORATION_PROBABILITY = 0.01  # llm-d's default
LOAD_SIGNALS = ("auto", "backlog", "tokens")
DEFAULT_SPILL_WINDOW_S = 30.0


class PrefixCacheAffinityFilter(Filter):
    type_name = "prefix-cache-affinity-filter"
    preference = True  # cold endpoints stay fallbacks (framework.Filter.preference)
    stats_group = "affinity"
    # the prefix match it weighs load against; the KV room its spill asks (with spillShare and spillFit)
    consumes_optional = (PREFIX_MATCH, KV_ROOM)
    produces = (PICKED_UNCACHED_TOKENS,)  # what its pick adds to the endpoint's prefill backlog (the director reads it)

    def __init__(self, affinity_threshold: float = DEFAULT_AFFINITY_THRESHOLD,
                 exploration_probability: float = DEFAULT_EXPLORATION_PROBABILITY, load_tolerance: float = 1.0,
                 prefix_source_name: str = "", load_signal: str = "auto", load_unit: str = "tokens",
                 spill_share: float = 0.0, spill_window_s: float = DEFAULT_SPILL_WINDOW_S, spill_fit: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.spill_share = spill_share
        self.spill_fit = spill_fit
        self._rates = PrefixRates(spill_window_s, clock) if spill_share > 0 else None
        self.counts = {"spills": 0, "spills_without_room": 0}
        if load_unit not in LOAD_UNITS:
            raise ValueError(f"load_unit must be one of {', '.join(LOAD_UNITS)}, got {load_unit!r}")
        self.load_unit = load_unit
        self.affinity_threshold = affinity_threshold
        self.exploration_probability = exploration_probability
        self.load_tolerance = load_tolerance
        if prefix_source_name:
            self.sources[PREFIX_MATCH] = prefix_source_name
        if not (spill_share > 0 and spill_fit):
            self.consumes_optional = (PREFIX_MATCH,)
        self.load_signal = load_signal

    def filter(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
               ) -> list[EndpointState]:
        homes = self._homes(request, len(endpoints))
        if len(endpoints) <= 1 or cycle is None or cycle.read(self, PREFIX_MATCH) is None or self._explores(request):
            return endpoints
        prompt, cached = prefix_tokens(self, request, endpoints, cycle)
        warm = cached >= self.affinity_threshold * prompt
        if not warm.any() or warm.all():
            return endpoints
        load = self._load(cycle, endpoints)
        if self.load_unit == "seconds":
            speed = relative_speed(endpoints, cycle)
            load = load / speed
        w = _argmin_where(load, warm)
        c = _argmin_where(load, ~warm)
        if homes > warm.sum() and load[w] > load[c]:  # the prefix outgrows its warm endpoints: one more home
            room = self._room(endpoints, cycle, warm, prompt)
            if not room.any():
                self.counts["spills_without_room"] += 1
            elif load[w] > load[_argmin_where(load, room)]:
                self.counts["spills"] += 1
                return [e for e, keep in zip(endpoints, room) if keep]
        if self.load_unit == "seconds":  # the prefill each side would still do, in the fastest replica's seconds
            saved = (prompt - cached[c]) / speed[c] - (prompt - cached[w]) / speed[w]
        else:
            saved = cached[w] - cached[c]
        if load[w] - load[c] > self.load_tolerance * saved:
            return endpoints
        return [e for e, keep in zip(endpoints, warm) if keep]

    def _room(self, endpoints: list[EndpointState], cycle: CycleState, warm: np.ndarray, prompt: int) -> np.ndarray:
        """The cold candidates a spill may go to: those where a copy of the prompt fits (every cold one without a
        fit check)."""
        room = cycle.read(self, KV_ROOM)
        if room is None:
            return ~warm
        return ~warm & room.fits(endpoints, prompt)

    def _homes(self, request: LLMRequest, candidates: int) -> int:
        """How many warm endpoints the request's sticky prefix deserves by its share of the recent requests (1
        without spillShare); counts the request."""
        if self._rates is None:
            return 1
        share = self._rates.add(prefix_key(request.prompt, self.affinity_threshold))
        return max(1, math.ceil(share * candidates / self.spill_share - 1e-9))

    def stats(self) -> dict[str, float]:
        return dict(self.counts)

    def _load(self, cycle: CycleState | None, endpoints: list[EndpointState]) -> np.ndarray:
        scraped = [e.metrics.prefill_backlog for e in endpoints]
        if self.load_signal == "tokens" or (self.load_signal == "auto" and all(p is None for p in scraped)):
            return live_load.live_column(cycle, endpoints, "tokens")
        backlog = np.fromiter((p or 0 for p in scraped), dtype=float, count=len(endpoints))
        return backlog + live_load.live_column(cycle, endpoints, "unseen_prompt")

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
                                     "loadSignal", "prefixScorer", "loadUnit", "spillShare", "spillWindowSeconds",
                                     "spillFit"},
                        t)
    signal = choice_param(params, "loadSignal", "auto", LOAD_SIGNALS, t)
    unit = load_unit_param(params, t)
    return PrefixCacheAffinityFilter(
        affinity_threshold=float_param(params, "affinityThreshold", DEFAULT_AFFINITY_THRESHOLD, t, 0.0, 1.0,
                                       min_inclusive=False),
        exploration_probability=float_param(params, "explorationProbability", DEFAULT_EXPLORATION_PROBABILITY, t,
                                            0.0, 1.0),
        load_tolerance=float_param(params, "loadTolerance", 1.0, t, 0.0),
        prefix_source_name=str_param(params, "prefixScorer", "", t),
        load_signal=signal,
        load_unit=unit,
        spill_share=float_param(params, "spillShare", 0.0, t, 0.0),
        spill_window_s=float_param(params, "spillWindowSeconds", DEFAULT_SPILL_WINDOW_S, t, 0.0, 3600.0,
                                   min_inclusive=False),
        spill_fit=bool_param(params, "spillFit", True, t),
    )
