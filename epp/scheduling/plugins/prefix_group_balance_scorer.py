"""prefix-group-balance-scorer (kvgate's own): give a prompt prefix that no endpoint holds to the endpoint serving the
fewest prefix groups, so groups (tenants, system prompts) partition the pool instead of piling up on one endpoint.

    g(r)   = xxh3 of the prompt's first groupChars characters                       the request's prefix group
    G(e)   = groups picked for e within the last windowSeconds (this scorer's own record, amortised O(1)), counted
             (balanceBy groups) or each weighed by its latest request's prompt tokens (balanceBy tokens: its cache
             footprint, which grows with a conversation's turns)
    G'(e)  = G(e) less g(r)'s own share when g(r) is among them (it costs e nothing new)
    homeless: no candidate holds affinityThreshold of the prompt (per the profile's prefix scorer)
    score(e) = (max G' - G'(e)) / (max G' - min G')   for a homeless request; all equal → 1.0
             = 0.5 everywhere                           for a warm one: prefix affinity decides
             = 1 at h, 0 elsewhere                      keepHomeBelow k > 0, for a homeless request whose group's
                                                        latest pick within the window went to candidate h (its
                                                        home) and h holds less than k of the prompt: its prefix
                                                        was evicted there, and it stays home

Parameters: groupChars ≥ 1 = 512, windowSeconds > 0 = 60, affinityThreshold (0, 1] = 0.8 (the affinity filter's),
prefixScorer = the profile's only prefix scorer, maxGroupsPerEndpoint ≥ 1 = 4096 (memory: the oldest group goes
first past it; ~100 bytes a group, so ≤ ~0.4 MB an endpoint however many distinct prompts arrive within the
window), keepHomeBelow [0, 1] = 0 (off), fitKvCapacity [0, 4] = 0 (off), balanceBy groups | tokens = groups,
loadUnit tokens | seconds = tokens, kvCapacityShares true | false = true, evictionAware true | false = false.

Why: when a pool's caches together hold the working set only if each prefix lives on one endpoint, an endpoint
given one group too many evicts its groups' prefixes faster than they are reused, and its hit rate collapses
(`kvgate bench routing --workloads multi-tenant` sizes each replica's cache for an even share of its tenants).
Counting groups routed, not cache contents, sees a placement the moment it is made, before any KV event. llm-d's
no-hit-lru-scorer spreads cold requests in time (least recently cold-picked); this spreads the groups themselves.

Mixed hardware (plugins/_relative_speed.py): G'(e) counts as a share of e's KV capacity relative to the largest,
k(e) — a replica with half the KV is given half the groups: G'(e) / k(e) —, and with loadUnit seconds a group
counts against the resource it takes: one picked there more than once within the window (a tenant, a
conversation) holds cache that is reused, a share of k(e); one picked there once (a one-off prompt) leaves nothing
reused and is only work, a share of e's relative prefill speed s(e):
    G'(e) = reused(e) / k(e) + once(e) / s(e)
kvCapacityShares false: k(e) = 1, footprints in tokens whatever each endpoint holds. In a uniform pool k = s = 1
and both forms are the plain G(e).

Why the split in seconds: a replica half as fast holds as many prefixes as a fast one with the same KV, so giving it
a share by min(k, s) piles twice its share of tenants onto the fast replicas' caches, which thrash; one-off prompts,
which hold no reused cache, must still go to the faster replicas in proportion to their speed, or the slow
replicas' queues grow (`kvgate bench routing --shapes mixed-hardware --configs kvgate,sglang-router,vllm-router
--rates saturation --per-request` shows both: mixed-speed for the tenants, mixed-speed-no-reuse for the one-off
prompts).

Why keep an evicted group home (keepHomeBelow): a group whose prefix its home evicted is cold everywhere, so the
balance would send it to whichever endpoint carries least at that moment, and the prefill-interference scorer to
whichever is least busy; repeated at each eviction, every endpoint comes to serve most groups, each cache holds
more prefixes than it fits, and evictions (and so cold prefills) multiply. Keeping it home — unless the other
scorers find home far worse — keeps each endpoint's set of groups, as a fixed placement does. The bound leaves
alone a conversation's next turn, which its home mostly holds (the prefix scorers weigh that).

Why a fit check (fitKvCapacity φ > 0, the plugin then also a preference filter that runs where it stands in the
profile): the scorers weigh what a placement costs now — the balance a share, prefill-interference the delay a cold
prefill puts on the requests already there — and none weighs what it costs later when the endpoint's cache cannot
hold one more group: every group there is evicted in turn and comes back as a cold prefill, or moves and evicts
elsewhere. While the first cold prefills queue, prefill-interference can outweigh the balance and place one group
too many on a replica, which then evicts and sheds its tenants onto the others. For a homeless request the check
keeps the candidates the group fits on,

    fits(e)  ⇔  F(e) + p ≤ φ × C(e)     F(e) = footprints (prompt tokens of each group's latest request) of the groups
                                         picked for e within the window, less the request's own group; p = its
                                         prompt tokens; C(e) = e's KV cache in tokens (vllm:cache_config_info)

when some fit and some do not (none or all: every candidate, as without it; C unknown: fits). The scorers then
choose among those that fit. A footprint is the latest prompt, not the users' contexts a tenant also keeps cached,
so φ = 1 still lets a replica hold a little more than fits. `kvgate bench routing --workloads
multi-tenant,hot-tenant,bursty-tenants --per-request` prints each replica's tenants, with and without the check
(configurations in bench/routing/configurations.py).

Why eviction-aware (evictionAware, off in kvgate's profile; bench configuration `kvgate-evict-aware`): G'(e) leaves
out the request's own group where e serves it — right while e's cache holds the group, since the request costs e
nothing new. A homeless request's group is held nowhere: where it was picked last (its home) the cache has evicted
it, which says that endpoint serves more than its cache holds, and leaving the group out there makes the home look
lightest by exactly its footprint, so the balance sends every evicted group back to the endpoint that could not
keep it. With evictionAware the group of a homeless request counts wherever it is recorded, as any other group
there (the prefix match says what each cache holds; with the precise scorer, from the engines' KV events' removals):
its next cold start goes to the least loaded endpoint, its evicted home included only on equal terms; a group whose
prefix is still resident is not homeless, and stays where the prefix scorers and the affinity filter keep it.

Why tokens in kvgate's profile: when groups differ in size (conversations of 1 to 10 turns, `kvgate bench routing
--workloads multi-turn`) counting them piles long conversations together; weighing each by its footprint spreads
the cache they take.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import xxhash

from kvgate.epp.scheduling.data import Deferred, PerEndpoint
from kvgate.epp.scheduling.framework import CycleState, Filter, Scorer
from kvgate.epp.scheduling.kv_fit import KV_ROOM, KvRoom
from kvgate.epp.scheduling.plugins._normalize import lower_is_better
from kvgate.epp.scheduling.plugins._params import (bool_param, check_keys, choice_param, float_param, int_param,
                                                       load_unit_param, str_param)
from kvgate.epp.scheduling.plugins._relative_speed import relative_kv_capacity, relative_speed
from kvgate.epp.scheduling.plugins._prefix_source import prefix_tokens
from kvgate.epp.scheduling.prefix_match import PREFIX_MATCH
from kvgate.epp.types import EndpointState, LLMRequest

DEFAULT_GROUP_CHARS = 512
DEFAULT_WINDOW_S = 60.0
DEFAULT_AFFINITY_THRESHOLD = 0.8
DEFAULT_MAX_GROUPS = 4096
BALANCE_BY = ("groups", "tokens")
MAX_GROUP_TOKENS = 1 << 32  # a peer's footprint for a group past this is not a prompt's (peer_pick drops it)


class PrefixGroupBalanceScorer(Filter, Scorer):
    type_name = "prefix-group-balance-scorer"
    preference = True  # the fit check's (fitKvCapacity): the endpoints it drops stay fallbacks
    consumes_optional = (PREFIX_MATCH,)  # whether a request is homeless, and its footprint
    produces = (KV_ROOM,)  # the fit check's record, for the affinity filter's spill (with fitKvCapacity > 0)

    def __init__(self, group_chars: int = DEFAULT_GROUP_CHARS, window_s: float = DEFAULT_WINDOW_S,
                 affinity_threshold: float = DEFAULT_AFFINITY_THRESHOLD, prefix_source_name: str = "",
                 max_groups: int = DEFAULT_MAX_GROUPS, clock: Callable[[], float] = time.monotonic,
                 balance_by: str = "groups", load_unit: str = "tokens", kv_capacity_shares: bool = True,
                 keep_home_below: float = 0.0, fit_kv_capacity: float = 0.0, eviction_aware: bool = False) -> None:
        super().__init__()
        self.eviction_aware = eviction_aware
        self.fit_kv_capacity = fit_kv_capacity
        if fit_kv_capacity <= 0:
            self.produces = ()
        self.keep_home_below = keep_home_below
        self.load_unit = load_unit
        self.kv_capacity_shares = kv_capacity_shares
        if balance_by not in BALANCE_BY:
            raise ValueError(f"balance_by must be one of {', '.join(BALANCE_BY)}, got {balance_by!r}")
        self.balance_by = balance_by
        self.group_chars = group_chars
        self.window_s = window_s
        self.affinity_threshold = affinity_threshold
        if prefix_source_name:
            self.sources[PREFIX_MATCH] = prefix_source_name
        self.max_groups = max_groups
        self.clock = clock
        # address → group → (last pick, the prompt tokens of its latest request: its cache footprint, whether it was
        # picked there before within the window: reused there), oldest first
        self._groups: dict[str, OrderedDict[int, tuple[float, int, bool]]] = {}
        # address → [live groups' footprints, of which those of groups picked there more than once; groups picked
        # there more than once] (kept as they change)
        self._totals: dict[str, list[int]] = {}

    def group(self, request: LLMRequest) -> int:
        return xxhash.xxh3_64_intdigest(request.prompt[:self.group_chars].encode("utf-8", "surrogatepass"))

    def _live(self, address: str, now: float) -> OrderedDict[int, tuple[float, int, bool]]:
        groups = self._groups.get(address)
        if groups is None:
            groups = self._groups[address] = OrderedDict()
            self._totals[address] = [0, 0, 0]
        horizon = now - self.window_s
        while groups and next(iter(groups.values()))[0] < horizon:
            self._drop_oldest(address, groups)
        return groups

    def _count(self, address: str, entry: tuple[float, int, bool], sign: int) -> None:
        """Add (sign 1) or take out (-1) a group's entry in e's totals."""
        totals = self._totals[address]
        totals[0] += sign * entry[1]
        if entry[2]:
            totals[1] += sign * entry[1]
            totals[2] += sign

    def _drop_oldest(self, address: str, groups: OrderedDict[int, tuple[float, int, bool]]) -> None:
        _, entry = groups.popitem(last=False)
        self._count(address, entry, -1)

    def _load(self, address: str, groups: OrderedDict[int, tuple[float, int, bool]], group: int | None
              ) -> tuple[float, float]:
        """What e carries besides this request's own group, as (reused, once): the groups picked there more than
        once within the window and those picked once — counted, or weighed by their prompts' tokens (O(1) both)."""
        tokens, reused_tokens, reused_groups = self._totals[address]
        own = groups.get(group)
        if self.balance_by == "groups":
            total, reused = len(groups) - (own is not None), reused_groups - (own is not None and own[2])
        else:
            total = tokens - (own[1] if own else 0)
            reused = reused_tokens - (own[1] if own and own[2] else 0)
        return reused, total - reused

    def _homeless(self, prompt: int, cached: np.ndarray) -> bool:
        return not (prompt > 0 and (cached >= self.affinity_threshold * prompt).any())

    def filter(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
               ) -> list[EndpointState]:
        """The fit check (fitKvCapacity > 0): a homeless request's group goes where its footprint still fits."""
        if self.fit_kv_capacity <= 0 or len(endpoints) <= 1:
            return endpoints
        prompt, cached = prefix_tokens(self, request, endpoints, cycle)
        if not self._homeless(prompt, cached):
            return endpoints
        fits = self.copy_fits(request, endpoints, prompt, homeless=True)
        if all(fits) or not any(fits):
            return endpoints
        return [e for e, fit in zip(endpoints, fits) if fit]

    def copy_fits(self, request: LLMRequest, endpoints: list[EndpointState], prompt_tokens: int,
                  homeless: bool = False) -> list[bool]:
        """Per endpoint, whether the request's prompt fits beside the footprints of the groups it serves (a homeless
        request's own group among them with evictionAware)."""
        group, now = self._own_group(request, homeless), self.clock()
        fits = []
        for e in endpoints:
            footprint, limit = self._room(e, group, now)
            fits.append(footprint + prompt_tokens <= limit)
        return fits

    def produce(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState) -> None:
        """The same record as the KV room of each candidate (kv_fit.py), which the affinity filter's spill asks
        before it puts a second copy of a hot prefix on a cold endpoint: computed only for the cycles that spill
        (Deferred), a Python loop over the candidates."""
        cycle.put(self, KV_ROOM, Deferred(lambda: self._kv_room(request, endpoints)))

    def _kv_room(self, request: LLMRequest, endpoints: list[EndpointState]) -> KvRoom:
        group, now, n = self.group(request), self.clock(), len(endpoints)
        footprint, limit = np.empty(n), np.empty(n)
        for i, e in enumerate(endpoints):
            footprint[i], limit[i] = self._room(e, group, now)
        return KvRoom(PerEndpoint(endpoints, footprint), PerEndpoint(endpoints, limit, math.inf))

    def _room(self, endpoint: EndpointState, group: int | None, now: float) -> tuple[int, float]:
        """(the footprints of the groups `endpoint` serves but `group`, φ × its KV cache in tokens; unknown: inf)."""
        capacity = endpoint.metrics.kv_cache_tokens
        if capacity is None:
            return 0, math.inf
        groups = self._live(endpoint.address, now)
        own = groups.get(group)
        return self._totals[endpoint.address][0] - (own[1] if own else 0), self.fit_kv_capacity * capacity

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> np.ndarray:
        n = len(endpoints)
        prompt, cached = prefix_tokens(self, request, endpoints, cycle)
        if not self._homeless(prompt, cached):
            return np.full(n, 0.5)
        group, now = self.group(request), self.clock()
        own = self._own_group(request, True)
        if self.keep_home_below > 0:
            home = self._home(group, endpoints, now)
            if home is not None and cached[home] < self.keep_home_below * prompt:
                kept = np.zeros(n)
                kept[home] = 1.0
                return kept
        reused, once = np.empty(n), np.empty(n)
        for i, e in enumerate(endpoints):
            reused[i], once[i] = self._load(e.address, self._live(e.address, now), own)
        # each group against the resource it takes: footprints reused there are a share of e's KV capacity, and in
        # seconds a one-off prompt is a share of e's speed (in tokens, of its KV like the rest)
        kv = relative_kv_capacity(endpoints, cycle) if self.kv_capacity_shares else 1.0
        work = relative_speed(endpoints, cycle) if self.load_unit == "seconds" else kv
        return lower_is_better(reused / kv + once / work)

    def _own_group(self, request: LLMRequest, homeless: bool) -> int | None:
        """The group whose footprint the request's endpoint would not pay again: its own — but for a homeless
        request with evictionAware (None: no group left out), whose prefix no cache holds any longer."""
        return None if homeless and self.eviction_aware else self.group(request)

    def _home(self, group: int, endpoints: list[EndpointState], now: float) -> int | None:
        """The candidate the group's latest pick within the window went to, if any."""
        home, latest = None, now - self.window_s
        for i, e in enumerate(endpoints):
            groups = self._groups.get(e.address)
            picked = groups.get(group) if groups else None
            if picked is not None and picked[0] >= latest:
                home, latest = i, picked[0]
        return home

    def pre_request(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None) -> None:
        tokens = (prefix_tokens(self, request, [endpoint], cycle)[0]
                  if self.balance_by == "tokens" or self.fit_kv_capacity > 0 else 0)
        self._record(endpoint.address, self.group(request), int(tokens))

    def _record(self, address: str, group: int, tokens: int) -> None:
        now = self.clock()
        groups = self._live(address, now)
        old = groups.get(group)
        if old is not None:
            self._count(address, old, -1)
        groups[group] = entry = (now, tokens, old is not None)
        groups.move_to_end(group)
        self._count(address, entry, 1)
        if len(groups) > self.max_groups:  # bounded: distinct prompts (no shared prefix) each make a group
            self._drop_oldest(address, groups)

    # Active-active (epp/peer_sync.py): a peer's placements count as this replica's own, so that both balance
    # groups over the same record.
    def share_pick(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None
                   ) -> list[int]:
        group = self.group(request)  # pre_request has just recorded it, with its footprint
        return [group, self._groups[endpoint.address][group][1]]

    def peer_pick(self, pick_id: str, address: str, shared: list[int]) -> None:
        if len(shared) == 2 and 0 <= shared[0] < 1 << 64 and 0 <= shared[1] <= MAX_GROUP_TOKENS:
            self._record(address, shared[0], shared[1])

    def remove_endpoint(self, address: str) -> None:
        self._groups.pop(address, None)
        self._totals.pop(address, None)


def factory(parameters: dict | None) -> PrefixGroupBalanceScorer:
    t = PrefixGroupBalanceScorer.type_name
    params = check_keys(parameters, {"groupChars", "windowSeconds", "affinityThreshold", "prefixScorer",
                                     "maxGroupsPerEndpoint", "balanceBy", "loadUnit", "kvCapacityShares",
                                     "keepHomeBelow", "fitKvCapacity", "evictionAware"}, t)
    balance_by = choice_param(params, "balanceBy", "groups", BALANCE_BY, t)
    return PrefixGroupBalanceScorer(
        group_chars=int_param(params, "groupChars", DEFAULT_GROUP_CHARS, t, 1),
        window_s=float_param(params, "windowSeconds", DEFAULT_WINDOW_S, t, 0.0, min_inclusive=False),
        affinity_threshold=float_param(params, "affinityThreshold", DEFAULT_AFFINITY_THRESHOLD, t, 0.0, 1.0,
                                       min_inclusive=False),
        prefix_source_name=str_param(params, "prefixScorer", "", t),
        max_groups=int_param(params, "maxGroupsPerEndpoint", DEFAULT_MAX_GROUPS, t, 1),
        balance_by=balance_by,
        load_unit=load_unit_param(params, t),
        kv_capacity_shares=bool_param(params, "kvCapacityShares", True, t),
        keep_home_below=float_param(params, "keepHomeBelow", 0.0, t, 0.0, 1.0),
        fit_kv_capacity=float_param(params, "fitKvCapacity", 0.0, t, 0.0, 4.0),
        eviction_aware=bool_param(params, "evictionAware", False, t),
    )
