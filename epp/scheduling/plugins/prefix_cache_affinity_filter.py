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

A second home priced by the latency models (secondHome latency, in place of spillShare's share threshold): whether a
prefix group's traffic outgrows its home is a question of what a second home costs and what it saves, both of which
the profile's other plugins measure. The group is the spill's key (the prompt's first affinityThreshold share,
plugins/_prefix_rates.py); its homes are the warm candidates it was picked on within spillWindowSeconds (a group
not picked yet: every warm candidate). For a request whose best home h* (by predicted TTFT) starts it later than a
cold start would somewhere:

    T(e)     its predicted TTFT at e (PREDICTED_TTFT: predicted-latency-scorer, the engines' own models with
             learnFrom engines): e's queue and the prompt tokens e does not hold — at a home the user part, at a
             cold endpoint the whole prompt
    H(e)     the delay its uncached prefill puts on e's other requests, in request-seconds (PREFILL_HARM:
             prefill-interference-scorer's harm)
    λ        the group's requests per second (its decayed count over the window)
    gain(e)  = (T(h*) − T(e)) × (1 + λ × T(h*) / 2)      this request's saving, and the group's next requests'
             while the home's wait lasts (λ × T(h*) of them, each saving half the gap on average as the queues even)
    open e* = argmax of gain − H over the cold candidates where a copy fits   iff it is > 0      keep only e*

Not before the spill's whole window has passed (plugins/_prefix_rates.py): until then the KV room knows only the
groups picked so far, a copy fits everywhere, and one copy made in a cell's first seconds put the hot group's
footprint where the balance would have placed a tenant (multi-tenant, a tuning shape: hit rate 0.87 → 0.78).
Where the copy fits: spillFit, with the group balance's KV room, as for the share spill. A copy that does not fit
costs more than one cold prefill: as long as it stays, the endpoint's own groups evict each other in turn (priced
as one re-prefill of the overflow, `kvgate bench routing --workloads bursty-tenants --configs kvgate,kvgate-second-home`
lost 5-14 points of hit rate), so it opens none there (counted as a spill without room), and a second home where
other groups have since come and the copy no longer fits beside them stops being a home (the first home never).

Once a group has two homes, its request goes to the home with the lower predicted TTFT (ties: the home opened first,
so a group that cools comes back to one home); a home not picked for a window lapses, and a home whose cache lost the
prompt (the prefix match: with the precise scorer, the engines' KV events' removals) is forgotten. A lapsed home
that still holds the prompt is reopened only at the price above, and the sticky rule weighs the homes against the
endpoints that hold no part of the prompt.

Parameters: affinityThreshold (0, 1] = 0.80, explorationProbability [0, 1] = 0.01, loadTolerance ≥ 0 = 1.0 (0:
leave warm endpoints as soon as they carry more load than the coldest; large: always sticky; above 1 values the
cache a spill would pollute), loadSignal auto | backlog | tokens = auto, loadUnit tokens | seconds = tokens,
prefixScorer = the profile's only prefix scorer, spillShare ≥ 0 = 0 (off), spillWindowSeconds (0, 3600] = 30,
spillFit true | false = true, secondHome share | latency = share (latency needs a predicted-latency-scorer and a
prefill-interference-scorer in the profile, and ignores spillShare).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import xxhash

from kvgate.epp.scheduling import live_load
from kvgate.epp.scheduling.data import PICKED_UNCACHED_TOKENS, PREDICTED_TTFT, PREFILL_HARM
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
SECOND_HOMES = ("share", "latency")
MAX_HOME_GROUPS = 4096  # groups whose homes are recorded (secondHome latency); the least recently picked go first


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
                 second_home: str = "share", clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        if second_home not in SECOND_HOMES:
            raise ValueError(f"second_home must be one of {', '.join(SECOND_HOMES)}, got {second_home!r}")
        self.by_latency = second_home == "latency"
        self.spill_share = 0.0 if self.by_latency else spill_share
        self.spill_fit = spill_fit
        self.window_s = spill_window_s
        self.clock = clock
        self._rates = PrefixRates(spill_window_s, clock) if self.spill_share > 0 or self.by_latency else None
        # secondHome latency: group → {address: the group's latest pick there}, in the order its homes opened
        self._home_picks: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._group_key = (self, "group")
        self.counts = {"spills": 0, "spills_without_room": 0}
        if self.by_latency:
            self.counts.update(second_homes_opened=0, second_homes_declined=0, homes_lapsed=0, homes_evicted=0,
                               homes_crowded=0)
        if load_unit not in LOAD_UNITS:
            raise ValueError(f"load_unit must be one of {', '.join(LOAD_UNITS)}, got {load_unit!r}")
        self.load_unit = load_unit
        self.affinity_threshold = affinity_threshold
        self.exploration_probability = exploration_probability
        self.load_tolerance = load_tolerance
        if prefix_source_name:
            self.sources[PREFIX_MATCH] = prefix_source_name
        if self.by_latency:  # the engines' predictions and the interference a cold start causes decide
            self.consumes = (PREDICTED_TTFT, PREFILL_HARM)
        if not ((self.spill_share > 0 or self.by_latency) and spill_fit):
            self.consumes_optional = (PREFIX_MATCH,)
        self.load_signal = load_signal

    def filter(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
               ) -> list[EndpointState]:
        homes = self._homes(request, len(endpoints), cycle)
        if len(endpoints) <= 1 or cycle is None or cycle.read(self, PREFIX_MATCH) is None or self._explores(request):
            return endpoints
        prompt, cached = prefix_tokens(self, request, endpoints, cycle)
        warm = cached >= self.affinity_threshold * prompt
        group = cycle.get(self._group_key) if self.by_latency else None
        if group is not None:
            return self._homes_by_latency(group, endpoints, cycle, warm, prompt, cached)
        if not warm.any() or warm.all():
            return endpoints
        load, speed = self._loads(endpoints, cycle)
        w = _argmin_where(load, warm)
        c = _argmin_where(load, ~warm)
        if homes > warm.sum() and load[w] > load[c]:  # the prefix outgrows its warm endpoints: one more home
            room = self._room(endpoints, cycle, warm, prompt)
            if not room.any():
                self.counts["spills_without_room"] += 1
            elif load[w] > load[_argmin_where(load, room)]:
                self.counts["spills"] += 1
                return [e for e, keep in zip(endpoints, room) if keep]
        if self._leaves(load, speed, w, c, prompt, cached):
            return endpoints
        return [e for e, keep in zip(endpoints, warm) if keep]

    def _leaves(self, load: np.ndarray, speed: np.ndarray | None, w: int, c: int, prompt: int, cached: np.ndarray
                ) -> bool:
        """The sticky rule: the warm side's least loaded w* carries more than loadTolerance × what its hit saves over
        the cold side's least loaded c*."""
        if speed is not None:  # the prefill each side would still do, in the fastest replica's seconds
            saved = (prompt - cached[c]) / speed[c] - (prompt - cached[w]) / speed[w]
        else:
            saved = cached[w] - cached[c]
        return load[w] - load[c] > self.load_tolerance * saved

    def _loads(self, endpoints: list[EndpointState], cycle: CycleState) -> tuple[np.ndarray, np.ndarray | None]:
        """The load signal per candidate, in seconds of the fastest replica with loadUnit seconds; and the relative
        speeds then (None in tokens)."""
        load = self._load(cycle, endpoints)
        if self.load_unit != "seconds":
            return load, None
        speed = relative_speed(endpoints, cycle)
        return load / speed, speed

    # ---------------------------------------------------------------- secondHome latency

    def _homes_by_latency(self, group: int, endpoints: list[EndpointState], cycle: CycleState, warm: np.ndarray,
                          prompt: int, cached: np.ndarray) -> list[EndpointState]:
        """secondHome latency (the module docstring): a second home where it pays, else the sticky rule against the
        endpoints that do not hold the prompt, else the group's nearest home."""
        homes, recorded = self._live_homes(group, endpoints, warm)
        if not homes.any():
            return endpoints
        if recorded and homes.sum() > 1:
            homes = self._without_crowded(group, endpoints, cycle, homes, prompt)
        if not homes.all():
            opened = self._second_home(group, endpoints, cycle, homes, prompt)
            if opened is not None:
                return [endpoints[opened]]
        if not warm.all():  # lapsed homes that still hold the prompt are reopened only by a second home's price
            load, speed = self._loads(endpoints, cycle)
            if self._leaves(load, speed, _argmin_where(load, homes), _argmin_where(load, ~warm), prompt, cached):
                return endpoints
        if recorded and homes.sum() > 1:
            return self._nearest_home(group, endpoints, cycle, homes)
        return endpoints if homes.all() else [e for e, keep in zip(endpoints, homes) if keep]

    def _live_homes(self, group: int, endpoints: list[EndpointState], warm: np.ndarray) -> tuple[np.ndarray, bool]:
        """The group's homes among the candidates — the warm ones it was picked on within the window — and True;
        or, without a live one (a group not picked yet, or every home lapsed or evicted), every warm candidate and
        False. A home not picked for a window lapses; one whose cache no longer holds the prompt (the KV events'
        removals, in the prefix match) is forgotten."""
        picks = self._home_picks.get(group)
        if not picks:
            return warm, False
        horizon = self.clock() - self.window_s
        positions = {e.address: i for i, e in enumerate(endpoints)}
        homes = np.zeros(len(endpoints), dtype=bool)
        for address, at in list(picks.items()):
            i = positions.get(address)
            if at < horizon:
                del picks[address]
                self.counts["homes_lapsed"] += 1
            elif i is not None and not warm[i]:
                del picks[address]
                self.counts["homes_evicted"] += 1
            elif i is not None:
                homes[i] = True
        if not picks:
            del self._home_picks[group]
        return (homes, True) if homes.any() else (warm, False)

    def _without_crowded(self, group: int, endpoints: list[EndpointState], cycle: CycleState, homes: np.ndarray,
                         prompt: int) -> np.ndarray:
        """The group's homes less those, but the first opened, where its copy no longer fits beside the groups the
        endpoint serves (spillFit, with the KV room in the profile): other groups came after the copy, and keeping
        it there would evict them in turn."""
        room = cycle.read(self, KV_ROOM) if self.spill_fit else None
        if room is None:
            return homes
        picks = self._home_picks[group]
        first = next(iter(picks))
        fits = room.fits(endpoints, prompt)
        for i in np.flatnonzero(homes & ~fits):
            address = endpoints[i].address
            if address != first:
                homes[i] = False
                del picks[address]
                self.counts["homes_crowded"] += 1
        return homes

    def _nearest_home(self, group: int, endpoints: list[EndpointState], cycle: CycleState, homes: np.ndarray
                      ) -> list[EndpointState]:
        """A group served from several homes: the one its request is predicted to start soonest on (ties: the
        home opened first, so a group that cools comes back to one home and the other lapses)."""
        ttft = cycle.read(self, PREDICTED_TTFT).of(endpoints)
        opened = list(self._home_picks.get(group, ()))
        rank = {address: k for k, address in enumerate(opened)}
        best = min(np.flatnonzero(homes), key=lambda i: (ttft[i], rank.get(endpoints[i].address, len(opened))))
        return [endpoints[int(best)]]

    def _second_home(self, group: int, endpoints: list[EndpointState], cycle: CycleState, homes: np.ndarray,
                     prompt: int) -> int | None:
        """Open a second home for the group on a cold candidate when it pays (see the module docstring): the
        candidate, or None to stay."""
        if not self._rates.settled():  # the KV room knows only the groups picked so far (as for the share spill)
            return None
        ttft = cycle.read(self, PREDICTED_TTFT).of(endpoints)
        w = _argmin_where(ttft, homes)
        cold = ~homes
        if ttft[w] <= ttft[cold].min():  # no cold start anywhere comes sooner than the home: nothing to weigh
            return None
        room = self._room(endpoints, cycle, homes, prompt) if self.spill_fit else cold
        if not room.any():
            self.counts["spills_without_room"] += 1
            return None
        harm = cycle.read(self, PREFILL_HARM).of(endpoints)
        rate = self._rates.rate(group)
        gain = (ttft[w] - ttft) * (1.0 + rate * ttft[w] / 2.0)
        net = np.where(room, gain - harm, -np.inf)
        c = int(np.argmax(net))
        if not net[c] > 0:
            self.counts["second_homes_declined"] += 1
            return None
        self.counts["second_homes_opened"] += 1
        return c

    def _room(self, endpoints: list[EndpointState], cycle: CycleState, warm: np.ndarray, prompt: int) -> np.ndarray:
        """The cold candidates a spill may go to: those where a copy of the prompt fits (every cold one without a
        fit check)."""
        room = cycle.read(self, KV_ROOM)
        if room is None:
            return ~warm
        return ~warm & room.fits(endpoints, prompt)

    def _homes(self, request: LLMRequest, candidates: int, cycle: CycleState | None) -> int:
        """How many warm endpoints the request's sticky prefix deserves by its share of the recent requests (1
        without spillShare); counts the request. With secondHome latency, keeps its group in the cycle instead."""
        if self._rates is None:
            return 1
        key = prefix_key(request.prompt, self.affinity_threshold)
        share = self._rates.add(key)
        if self.by_latency:
            if cycle is not None and key is not None:
                cycle[self._group_key] = key
            return 1
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
        if self.by_latency:
            group = cycle.get(self._group_key) if cycle is not None else None
            if group is None:
                group = prefix_key(request.prompt, self.affinity_threshold)
            if group is not None:
                self._record_home(group, endpoint.address)

    def _record_home(self, group: int, address: str) -> None:
        """The group was picked on `address` now: a home of its (the latest, if new)."""
        picks = self._home_picks.get(group)
        if picks is None:
            picks = self._home_picks[group] = {}
        else:
            self._home_picks.move_to_end(group)
        picks[address] = self.clock()
        if len(self._home_picks) > MAX_HOME_GROUPS:
            self._home_picks.popitem(last=False)

    def remove_endpoint(self, address: str) -> None:
        for picks in self._home_picks.values():
            picks.pop(address, None)


def _argmin_where(values: np.ndarray, mask: np.ndarray) -> int:
    return int(np.argmin(np.where(mask, values, np.inf)))


def factory(parameters: dict | None) -> PrefixCacheAffinityFilter:
    t = PrefixCacheAffinityFilter.type_name
    params = check_keys(parameters, {"affinityThreshold", "explorationProbability", "loadTolerance",
                                     "loadSignal", "prefixScorer", "loadUnit", "spillShare", "spillWindowSeconds",
                                     "spillFit", "secondHome"},
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
        second_home=choice_param(params, "secondHome", "share", SECOND_HOMES, t),
    )
