"""prefix-cache-affinity-filter (llm-d's name): stay on the endpoints that hold most of the prompt, until their
load costs more than the hit saves.

    f(e)    = cached_tokens(e) / prompt_tokens                 from the profile's prefix scorer (PrefixMatchSource)
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

A group too big for its warm endpoints (hotGroupTolerance). The rule above weighs a warm endpoint's queue against
one request's hit. A spill costs one cold prefill, and from then on the group is served from one more warm endpoint;
whether that pays depends on the group's rate, which one request's hit does not see. So the filter keeps each prefix
group's share of the requests it has seen (exponentially decayed, half-life 10 s), and a request whose group asks
more than its warm endpoints' share of the pool has its warm side weighed with hotGroupTolerance instead:

    group(r)   = xxh3 of the prompt's first ~70-80% characters (threshold × its length, rounded down to 1/8 of the
                 power of two below: requests of nearly equal length share it), so requests in one group share the
                 prefix a warm endpoint must hold
    hot        = share(group(r)) > |warm| / |candidates|, once ≥ 32 requests are counted
    keep only warm   iff   L(w*) - L(c*) ≤ (hot ? hotGroupTolerance : loadTolerance) × saved

Why: with one tenant asking 45% of the requests of four replicas (`kvgate bench routing`, hot-tenant), all of it
stayed on one warm replica, its queue always within loadTolerance 4 × the hit (TTFT p90 0.82 s against 0.49 s when
it had spilled); a lower loadTolerance for every group spilled cold tenants too and moved the tail between seeds
(docs/benchmarks.md). A uniform group never asks more than its endpoints' share (12 tenants on 4 replicas: 1/12
each against 1/4), so there the rule never fires; a hot group that has spilled to enough warm endpoints stops being
hot, which bounds how far it spreads.

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
they broke stickiness under load (`kvgate bench routing`, multi-tenant, 24 req/s: TTFT p90 2.17 s with tokens).
Pools of mixed speed (loadUnit seconds): a token of backlog on a replica half as fast costs twice the time, so
both sides of the comparison convert to the fastest replica's seconds with each endpoint's relative prefill speed
s(e) (plugins/_relative_speed.py, from the engines' own prefill timing; 1 for every endpoint of a uniform
pool, where the rule is the one above):

    w*, c*  = argmin of L(e) / s(e) on each side
    saved   = (prompt - cached(c*)) / s(c*) - (prompt - cached(w*)) / s(w*)
    keep only warm   iff   L(w*)/s(w*) - L(c*)/s(c*) ≤ loadTolerance × saved

Parameters: affinityThreshold (0, 1] = 0.80, explorationProbability [0, 1] = 0.01, loadTolerance ≥ 0 = 1.0 (0:
leave warm endpoints as soon as they carry more load than the coldest; large: always sticky; above 1 values the
cache a spill would pollute), hotGroupTolerance ≥ 0 = 1.0 (loadTolerance for a hot group; equal to loadTolerance:
the rule is off), loadSignal auto | backlog | tokens = auto, loadUnit tokens | seconds = tokens,
prefixScorer = the profile's only prefix scorer.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict

import numpy as np
import xxhash

from kvgate.epp.scheduling import live_load
from kvgate.epp.scheduling.framework import CycleState, Filter
from kvgate.epp.scheduling.plugins._params import (LOAD_UNITS, check_keys, choice_param, float_param, load_unit_param,
                                                       str_param)
from kvgate.epp.scheduling.plugins._relative_speed import relative_speed
from kvgate.epp.scheduling.plugins._prefix_source import (PRODUCES_PICKED_UNCACHED, prefix_tokens,
                                                              record_picked_uncached)
from kvgate.epp.scheduling.prefix_match import NeedsPrefixMatch
from kvgate.epp.types import EndpointState, LLMRequest

DEFAULT_AFFINITY_THRESHOLD = 0.80  # llm-d's default
DEFAULT_EXPLORATION_PROBABILITY = 0.01  # llm-d's default
LOAD_SIGNALS = ("auto", "backlog", "tokens")
GROUP_HALF_LIFE_S = 10.0  # a group's share follows a change of workload within ~10 s, yet a burst does not make it hot
MIN_COUNTED = 32.0  # requests (decayed) counted before any group is judged hot: a first few are no share
MAX_GROUPS = 4096  # groups remembered (the least recently seen goes first): ~150 bytes each


class GroupShares:
    """Each prefix group's exponentially decayed count of requests, and the total: O(1) a request, bounded memory."""

    def __init__(self, half_life_s: float = GROUP_HALF_LIFE_S, max_groups: int = MAX_GROUPS) -> None:
        self.decay = math.log(2) / half_life_s
        self.max_groups = max_groups
        self.groups: OrderedDict[int, tuple[float, float]] = OrderedDict()  # key -> (count, when counted)
        self.total, self.total_at = 0.0, 0.0

    def add(self, key: int, now: float) -> float:
        """Count one request of `key` at `now` (monotonic s); its group's share of the decayed total after it."""
        self.total = self.total * math.exp(-self.decay * max(now - self.total_at, 0.0)) + 1.0
        self.total_at = now
        count, at = self.groups.pop(key, (0.0, now))
        count = count * math.exp(-self.decay * max(now - at, 0.0)) + 1.0
        self.groups[key] = (count, now)
        if len(self.groups) > self.max_groups:
            self.groups.popitem(last=False)
        return count / self.total


def group_key(prompt: str, threshold: float) -> int | None:
    """The hash of the prompt's first threshold × len characters, rounded down to 1/8 of the power of two below (so
    prompts of nearly equal length share it); None for a prompt too short to have one."""
    cut = int(threshold * len(prompt))
    if cut < 8:
        return None
    grid = 1 << max(cut.bit_length() - 4, 0)
    return xxhash.xxh3_64_intdigest(prompt[:cut - cut % grid].encode("utf-8", "surrogatepass"))


class PrefixCacheAffinityFilter(NeedsPrefixMatch, Filter):
    type_name = "prefix-cache-affinity-filter"
    preference = True  # cold endpoints stay fallbacks (framework.Filter.preference)
    stats_group = "affinity"
    produces = PRODUCES_PICKED_UNCACHED  # what its pick adds to the endpoint's prefill backlog (the director reads it)

    def __init__(self, affinity_threshold: float = DEFAULT_AFFINITY_THRESHOLD,
                 exploration_probability: float = DEFAULT_EXPLORATION_PROBABILITY, load_tolerance: float = 1.0,
                 prefix_source_name: str = "", load_signal: str = "auto", load_unit: str = "tokens",
                 hot_group_tolerance: float = 1.0, clock=time.monotonic) -> None:
        super().__init__()
        if load_unit not in LOAD_UNITS:
            raise ValueError(f"load_unit must be one of {', '.join(LOAD_UNITS)}, got {load_unit!r}")
        self.load_unit = load_unit
        self.affinity_threshold = affinity_threshold
        self.exploration_probability = exploration_probability
        self.load_tolerance = load_tolerance
        self.prefix_source_name = prefix_source_name
        self.load_signal = load_signal
        self.hot_group_tolerance = hot_group_tolerance
        self.shares = GroupShares()
        self.clock = clock
        self.hot_picks = 0  # requests weighed as a hot group's (stats)

    def filter(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
               ) -> list[EndpointState]:
        if len(endpoints) <= 1 or self.prefix_source is None or self._explores(request):
            return endpoints
        share = self._share(request)
        prompt, cached = prefix_tokens(self, request, endpoints, cycle)
        warm = cached >= self.affinity_threshold * prompt
        if not warm.any() or warm.all():
            return endpoints
        tolerance = self.load_tolerance
        if share is not None and share * len(endpoints) > warm.sum() and self.shares.total >= MIN_COUNTED:
            tolerance = self.hot_group_tolerance
            self.hot_picks += 1
        load = self._load(cycle, endpoints)
        if self.load_unit == "seconds":
            speed = relative_speed(endpoints, cycle)
            load = load / speed
        w = _argmin_where(load, warm)
        c = _argmin_where(load, ~warm)
        if self.load_unit == "seconds":  # the prefill each side would still do, in the fastest replica's seconds
            saved = (prompt - cached[c]) / speed[c] - (prompt - cached[w]) / speed[w]
        else:
            saved = cached[w] - cached[c]
        if load[w] - load[c] > tolerance * saved:
            return endpoints
        return [e for e, keep in zip(endpoints, warm) if keep]

    def _share(self, request: LLMRequest) -> float | None:
        """Count the request in its prefix group; the group's share (None: no group, or the rule is off)."""
        if self.hot_group_tolerance == self.load_tolerance:
            return None
        key = group_key(request.prompt, self.affinity_threshold)
        return None if key is None else self.shares.add(key, self.clock())

    def stats(self) -> dict[str, float]:
        return {"hot_group_requests": self.hot_picks}

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
                                     "loadSignal", "prefixScorer", "loadUnit", "hotGroupTolerance"}, t)
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
        hot_group_tolerance=float_param(params, "hotGroupTolerance", 1.0, t, 0.0),
    )
