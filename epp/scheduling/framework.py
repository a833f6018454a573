"""The scheduling framework: filter → score → pick, in profiles, modelled on kube-scheduler and upstream's EPP.

A SchedulingProfile runs its filters in order (each narrows the candidate list), then every scorer gives each
surviving endpoint a score; an endpoint's total is Σ weight_i · clamp(score_i, 0, 1). The picker orders the
survivors from best to worst: the first is the primary target, the rest are fallbacks Envoy may try.

The framework keeps plugins pure and bounded:
  - every score is clamped to [0, 1] here (NaN counts 0), so a buggy scorer cannot outweigh the others;
  - every plugin call is timed (PluginTimings: totals by extension point and plugin, plus an optional observer
    the EPP can feed a histogram with);
  - one CycleState per scheduling cycle is shared by the filters, scorers, picker and the pick hook
    (`pre_request`): a plugin keeps what it computed while scoring (the prefix scorer's block hashes) for the
    hook, with nothing kept between requests.

Scores are numpy arrays aligned with the endpoint list ("dense", what the built-in scorers return) or a mapping
{address: score} ("sparse", a missing address scores 0). Scorers that derive numbers from the endpoints' scraped
metrics cache them in the cycle's Snapshot: the same list of EndpointState objects coming back (a datalayer
snapshot reused for a scrape round) reuses them, so a decision over 1000 endpoints does not walk 1000 Python
objects per scorer. EndpointStates are therefore treated as immutable snapshots: publish new metrics by new
objects, never by mutating one in place.

Plugins may also implement lifecycle hooks, which the Scheduler fans out to the plugins that override them:
  start(ctx)                                           the EPP starts: runtime options and its loop (PluginContext)
  produce(request, endpoints, cycle)                   a cycle starts: write the declared data others read
  needs_prepare(request) / async prepare(request)      slow per-request work before the decision, off the loop
  stop()                                               the EPP stops (in reverse order of start)
  set_endpoints(endpoints)                             the pool's endpoints now (after remove_endpoint of leavers)
  pre_request(request, endpoint, cycle)                the pick is final (e.g. prefix index update)
  response_complete(request, address, prompt_tokens, completion_tokens)
  remove_endpoint(address)                             the endpoint left the pool (drop per-endpoint state)
  stats()                                              numbers for the EPP's metrics, summed by `stats_group`

What plugins hand each other goes through the cycle, under keys each declares as class attributes
(scheduling/data.py): `produces` what it writes (`cycle.put`), `consumes` what it needs and `consumes_optional`
what it reads when its profile produces it (`cycle.read`); a plugin's private `cycle[self]` is none of these. A
profile links each reader to its producer when it is built (`SchedulingProfile.link`) and refuses one that needs a
key none of its plugins produces. Data that others read before they filter is written by the `produce` hook, which
the profile runs over the candidates at the start of each cycle for the producers whose keys a plugin reads. The
director reads what it needs of a cycle through the Scheduler (`picked_uncached_tokens`, `objectives_unmeetable`).

One endpoint's data never fails a pick for the pool: when a plugin raises during a decision, the scheduler runs the
decision again for each candidate alone, takes out of rotation for QUARANTINE_S those whose decision alone raises
(counted per endpoint, logged at most every QUARANTINE_LOG_S each) and decides among the others. When every
candidate's decision raises alone, the fault is the request's or a plugin's, not an endpoint's: it propagates.

The scheduler is not thread-safe: the EPP calls it from its one asyncio event loop.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

import numpy as np

from kvgate.epp.scheduling.data import OBJECTIVES_UNMEETABLE, PICKED_UNCACHED_TOKENS, DataKey, Deferred
from kvgate.epp.types import Endpoint, EndpointState, LLMRequest

log = logging.getLogger(__name__)

_address_of = attrgetter("endpoint.address")
_perf_ns = time.perf_counter_ns

QUARANTINE_S = 1.0  # an endpoint whose data made a plugin raise sits out this long, then is tried again
QUARANTINE_LOG_S = 30.0  # at most one log line per endpoint this often about its faults


class Snapshot:
    """One list of candidate endpoint states and what plugins derived from it (addresses, metric columns).

    The scheduler keeps the last Snapshot per profile and reuses it while the same state objects come back
    (identity comparison: EndpointState compares by identity).
    """

    __slots__ = ("endpoints", "memo", "_addresses", "_positions")

    def __init__(self, endpoints: list[EndpointState]) -> None:
        self.endpoints = endpoints
        self.memo: dict[Any, Any] = {}  # plugin-owned keys (use the plugin instance) → derived values
        self._addresses: list[str] | None = None
        self._positions: dict[str, int] | None = None

    @property
    def addresses(self) -> list[str]:
        if self._addresses is None:
            self._addresses = list(map(_address_of, self.endpoints))
        return self._addresses

    @property
    def positions(self) -> dict[str, int]:
        """address → index in `endpoints`."""
        if self._positions is None:
            self._positions = {a: i for i, a in enumerate(self.addresses)}
        return self._positions

    def cached(self, key: Any, compute: Callable[[list[EndpointState]], Any]) -> Any:
        """compute(endpoints), once per snapshot for `key`."""
        try:
            return self.memo[key]
        except KeyError:
            value = self.memo[key] = compute(self.endpoints)
            return value


class CycleState(dict):
    """Per-request scratch space shared by one cycle's filters, scorers, picker and pre_request hooks.

    A plugin keeps its own work under itself as key (two instances of one type do not collide); what it hands
    others goes through `put` and `read`, under the keys it declares (scheduling/data.py).
    `snapshot` is the Snapshot the scorers saw (None before scoring, or when a filter pinned the order).
    `load` is the live in-flight overlay of the director's round snapshot (scheduling/live_load.py LiveLoad), or
    None when the caller gave none: plugins then read the states' own in_flight_* fields.
    `scores` is the picker's input: the weighted score totals, one per endpoint of `snapshot` (what a trace shows).
    """

    __slots__ = ("snapshot", "load", "scores")

    def __init__(self, load: Any = None) -> None:
        super().__init__()
        self.snapshot: Snapshot | None = None
        self.load = load
        self.scores = None

    def put(self, producer: Plugin, key: DataKey, value: Any) -> None:
        """`producer`'s data for `key` (one of its `produces`) in this cycle; a Deferred is computed at its first
        read."""
        self[key, producer.name] = value

    def read(self, consumer: Plugin, key: DataKey, default: Any = None) -> Any:
        """The data for `key` (one of `consumer`'s consumes) from the producer its profile linked it to; `default`
        when it has none, or the producer wrote none in this cycle."""
        producer = consumer.inputs.get(key)
        if producer is None:
            return default
        value = self.get((key, producer), default)
        if type(value) is Deferred:
            value = self[key, producer] = value.compute()
        return value


@dataclass(frozen=True)
class PluginContext:
    """What the EPP hands every plugin it starts (Plugin.start): its runtime options and a way back onto the
    scheduler's thread. A plugin reads what it needs; tests build one with only that."""

    deliver: Callable[..., Any] | None = None  # deliver(fn, *args) runs fn(*args) on the scheduler's thread
    tokenizer: str | None = None  # --tokenizer: the model's tokenizer folder
    prefix_index_max_bytes: int | None = None  # --prefix-index-max-bytes: every prefix index's budget
    kv_event_sources: Callable[[Sequence[Endpoint]], list] | None = None  # endpoints → their KV-event sources


class Plugin:
    """Base of every plugin. `type_name` is the registry key used in EndpointPickerConfig files."""

    type_name: str = ""
    stats_group: str = ""  # the EPP metric family stats() feeds ("" = none)
    produces: tuple[DataKey, ...] = ()  # what it writes into a cycle for others (CycleState.put)
    consumes: tuple[DataKey, ...] = ()  # what it reads from a cycle (CycleState.read) and cannot work without
    consumes_optional: tuple[DataKey, ...] = ()  # what it reads when a plugin of its profile produces it
    # response_complete reads what only the response body carries (request.first_token_at, the usage's token
    # counts): a gateway must then stream response bodies through the EPP (EppConfig.needs_response_body)
    reads_response_body: bool = False

    def __init__(self) -> None:
        self.name = self.type_name
        self.sources: dict[DataKey, str] = {}  # key read → the plugin its config names to produce it
        self.inputs: dict[DataKey, str] = {}  # key read → the plugin producing it, as its profile linked them

    def start(self, ctx: PluginContext) -> None:
        """The EPP starts (its event loop runs): take runtime options, start threads or sockets."""

    def produce(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState) -> None:
        """A cycle starts: `cycle.put` the data of `produces` that others read, for the candidates `endpoints`.
        Called when a plugin of the profile reads it, once per cycle, before the filters."""

    def stop(self) -> None:
        """The EPP stops: end what start() started."""

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """The pool's endpoints now (those that left were given to remove_endpoint first)."""

    def needs_prepare(self, request: LLMRequest) -> bool:
        """Whether `prepare` has work for this request (checked on the event loop: keep it cheap)."""
        return False

    async def prepare(self, request: LLMRequest) -> None:
        """Slow per-request work, awaited before the (synchronous) decision: run it off the event loop, within
        a time budget of the plugin's own, and leave the result in `request.prepared[self]`."""

    def stats(self) -> Mapping[str, float]:
        """Counters and gauges for the EPP's metrics (`stats_group` names the family)."""
        return {}

    def pre_request(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None) -> None:
        """Called once the pick for `request` is final; `endpoint` is the primary target; `cycle` the state its
        scheduling cycle left (Scheduler.on_picked without one makes one holding the data the hooks read)."""

    def response_complete(self, request: LLMRequest, endpoint_address: str, prompt_tokens: int,
                          completion_tokens: int) -> None:
        """Called when the response from `endpoint_address` has finished."""

    def remove_endpoint(self, address: str) -> None:
        """Called when `address` has left the pool."""

    # Active-active replicas (epp/peer_sync.py): a plugin whose pre_request keeps state that decides later picks
    # shares what a peer needs to replay the pick, as a list of ints, and replays its peers' picks.
    def share_pick(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None
                   ) -> list[int] | None:
        """After pre_request: what a peer replica's `peer_pick` needs to record this pick (None: nothing). Peers
        get at most peer_sync.MAX_SHARED_INTS of it, a prefix: order it so that a prefix still means something."""
        return None

    def peer_pick(self, pick_id: str, address: str, shared: list[int]) -> None:
        """A peer replica picked `address` (in this replica's pool) for a request; `shared` is that replica's
        share_pick, untrusted: check its shape, ignore what does not fit."""

    def peer_done(self, pick_id: str, address: str) -> None:
        """The peer's request `pick_id` ended (or the peer was forgotten)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class Filter(Plugin):
    # A preference filter narrows where a request should go, not where it may: when the picker returns more than
    # one endpoint (fallbacks for a gateway that retries), those it dropped follow the ones it kept, ranked by
    # the same scorers — so a request that sticks to one warm endpoint still has somewhere to go if it is dead.
    preference: bool = False

    def filter(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
               ) -> list[EndpointState]:
        raise NotImplementedError


class PinnedOrder(list):
    """A filter result whose order is the final answer: the scheduler returns it without scoring or picking.

    The conformance header filter uses it so that the endpoints a test lists come back primary first, in the
    listed order.
    """


class Scorer(Plugin):
    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None):
        """Scores in [0, 1]: an array aligned with `endpoints` (dense), or {address: score} (sparse, missing = 0).
        The framework clamps whatever comes back."""
        raise NotImplementedError


def clamp_scores(scores: np.ndarray) -> np.ndarray:
    """[0, 1], NaN → 0 (fmax/fmin skip NaN): what the framework applies to every scorer's answer."""
    return np.fmin(np.fmax(scores, 0.0), 1.0)


def dense_scores(scores, endpoints: Sequence[EndpointState], positions: Mapping[str, int] | None = None
                 ) -> np.ndarray:
    """A scorer's or picker's input as a float array aligned with `endpoints` (a mapping's missing address = 0)."""
    if isinstance(scores, Mapping):
        if positions is None:
            positions = {a: i for i, a in enumerate(map(_address_of, endpoints))}
        out = np.zeros(len(endpoints))
        for address, s in scores.items():
            i = positions.get(address)
            if i is not None:
                out[i] = s
        return out
    return np.asarray(scores, dtype=float)


def score_map(scores, endpoints: Sequence[EndpointState]) -> dict[str, float]:
    """{address: score} of a dense or sparse answer (for tests and debugging)."""
    if isinstance(scores, Mapping):
        return dict(scores)
    return {e.address: float(s) for e, s in zip(endpoints, scores)}


class Picker(Plugin):
    """Orders scored endpoints best first. `max_endpoints` (upstream's maxNumOfEndpoints) caps the list; 0 = all."""

    def __init__(self, max_endpoints: int = 0) -> None:
        super().__init__()
        self.max_endpoints = max_endpoints

    def pick(self, request: LLMRequest, endpoints: list[EndpointState], scores, cycle: CycleState | None = None
             ) -> list[EndpointState]:
        """`scores`: every endpoint's weighted total, an array aligned with `endpoints` (or {address: total})."""
        totals = dense_scores(scores, endpoints)
        positions = self.order(request, endpoints, totals, self.max_endpoints)
        if self.max_endpoints > 0:
            positions = positions[: self.max_endpoints]
        return [endpoints[i] for i in positions]

    def order(self, request: LLMRequest, endpoints: list[EndpointState], totals: np.ndarray, limit: int
              ) -> Sequence[int]:
        """Positions into `endpoints`, best first; only the first `limit` (0 = all) are used."""
        raise NotImplementedError

    @staticmethod
    def rng(request: LLMRequest) -> random.Random:
        """Per-request randomness: reproducible for one request id, spread across requests."""
        return random.Random(request.request_id)


class ProfileHandler(Plugin):
    """Marks a profile-handler plugin (upstream `single-profile-handler`); kvgate runs the primary profile."""


# ------------------------------------------------------------------------------------------------ timing

Observer = Callable[[str, str, str, float], None]  # (extension point, plugin type, plugin name, seconds)


class PluginTimings:
    """Calls and total time per (extension point, plugin): cheap counters the EPP exports.

    Cost: two perf_counter_ns calls and a counter update per plugin call (`kvgate bench epp --parts scheduling`
    prints the decision's p50 with and without them). `observer`, when set, also gets every
    duration (e.g. a Prometheus histogram).
    """

    def __init__(self) -> None:
        self._records: dict[tuple[str, str, str], list[int]] = {}  # key → [calls, total ns]
        self.observer: Observer | None = None
        self.enabled = True

    def record_for(self, point: str, plugin: Plugin) -> list[int]:
        return self._records.setdefault((point, plugin.type_name, plugin.name), [0, 0])

    def add(self, key_record: list[int], point: str, plugin: Plugin, ns: int) -> None:
        key_record[0] += 1
        key_record[1] += ns
        if self.observer is not None:
            self.observer(point, plugin.type_name, plugin.name, ns / 1e9)

    def total_ns(self) -> dict[tuple[str, str, str], int]:
        """(point, type, name) → total ns so far (a decision's own times are the difference across it)."""
        return {k: v[1] for k, v in self._records.items()}

    def totals(self) -> dict[tuple[str, str, str], tuple[int, float]]:
        """(point, type, name) → (calls, total seconds)."""
        return {k: (v[0], v[1] / 1e9) for k, v in self._records.items() if v[0]}

    def reset(self) -> None:
        for v in self._records.values():
            v[0] = v[1] = 0


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
    timings: PluginTimings = field(default_factory=PluginTimings, repr=False)
    _snapshot: Snapshot | None = field(default=None, repr=False, compare=False)
    _producers: list[Plugin] = field(default_factory=list, repr=False, compare=False)  # link(): produce() runs them

    def plugins(self) -> list[Plugin]:
        found: list[Plugin] = [*self.filters, *(ws.scorer for ws in self.scorers)]
        if self.picker is not None:
            found.append(self.picker)
        return found

    def link(self) -> None:
        """Link every key a plugin of the profile reads to its producer (`Plugin.inputs`, see _link_inputs), then
        line up the producers whose `produce` some plugin reads, each after those it reads from."""
        plugins = list({id(p): p for p in self.plugins()}.values())
        producers: dict[DataKey, list[str]] = {}
        for p in plugins:
            for key in p.produces:
                producers.setdefault(key, []).append(p.name)
        for p in plugins:
            _link_inputs(p, producers)
        read = {(key, name) for p in plugins for key, name in p.inputs.items()}
        waiting = [p for p in plugins if _overrides(p, "produce") and any((k, p.name) in read for k in p.produces)]
        ordered: list[Plugin] = []
        while waiting:
            names = {p.name for p in waiting}
            ready = [p for p in waiting if names.isdisjoint(p.inputs.values())]
            if not ready:
                raise ValueError(f"plugins {', '.join(sorted(names))} read each other's data before they filter: no "
                                 "order runs each after its producers")
            ordered += ready
            waiting = [p for p in waiting if p not in ready]
        self._producers = ordered

    def produce(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState) -> None:
        """Run the linked producers' `produce` over `endpoints` (the candidates), those whose data the cycle does
        not hold yet (a fallback pass reuses the primary's)."""
        for p in self._producers:
            if not any((key, p.name) in cycle for key in p.produces):
                self._timed("produce", p, p.produce, request, endpoints, cycle)

    def snapshot(self, endpoints: list[EndpointState]) -> Snapshot:
        snap = self._snapshot
        if snap is None or snap.endpoints != endpoints:  # identity compare: cheap for unchanged states
            snap = self._snapshot = Snapshot(list(endpoints))
        return snap

    def run(self, request: LLMRequest, candidates: Sequence[EndpointState], cycle: CycleState | None = None,
            preferences: bool = True) -> list[EndpointState]:
        """Filter, score, pick; then the fallbacks from what preference filters dropped."""
        if cycle is None:
            cycle = CycleState()
        candidates = candidates if isinstance(candidates, list) else list(candidates)
        if self._producers:
            self.produce(request, candidates, cycle)
        endpoints, dropped, pinned = self._filter(request, candidates, cycle, preferences)
        if not endpoints:
            return []
        cap = self.picker.max_endpoints if self.picker is not None else 0
        if pinned:  # the filter's order is the answer, as long as the picker would give (a stock gateway parses one)
            return list(endpoints[:cap] if cap > 0 else endpoints)
        if self.picker is None:
            raise RuntimeError(f"scheduling profile {self.name!r} has no picker")
        snap = cycle.snapshot = self.snapshot(endpoints)
        totals = cycle.scores = self._score(request, snap, cycle)
        picked = self._timed("picker", self.picker, self.picker.pick, request, snap.endpoints, totals, cycle)
        if dropped and picked and (cap == 0 or len(picked) < cap):
            picked = list(picked) + self._fallbacks(request, dropped, cycle, cap - len(picked) if cap else 0)
        return picked

    def _timed(self, point: str, plugin: Plugin, call: Callable[..., Any], *args: Any) -> Any:
        """call(*args), its time recorded for (point, plugin) — the one timing path of every extension point."""
        timings = self.timings
        if not timings.enabled:
            return call(*args)
        t0 = _perf_ns()
        out = call(*args)
        timings.add(timings.record_for(point, plugin), point, plugin, _perf_ns() - t0)
        return out

    def _filter(self, request: LLMRequest, candidates: list[EndpointState], cycle: CycleState,
                preferences: bool) -> tuple[list[EndpointState], list[EndpointState], bool]:
        """(survivors, dropped by preference filters, whether a filter pinned the order)."""
        endpoints = candidates
        pinned = False
        dropped: list[EndpointState] = []  # by preference filters: fallbacks after the kept ones
        for f in self.filters:
            if f.preference and not preferences:
                continue
            before = endpoints
            endpoints = self._timed("filter", f, f.filter, request, endpoints, cycle)
            if f.preference and len(endpoints) < len(before):
                kept = set(map(id, endpoints))
                dropped += [e for e in before if id(e) not in kept]
            pinned = pinned or isinstance(endpoints, PinnedOrder)
            if not endpoints:
                return [], dropped, pinned
        return endpoints, dropped, pinned

    def _score(self, request: LLMRequest, snap: Snapshot, cycle: CycleState) -> np.ndarray:
        """Σ weight · clamp(score) per endpoint of the snapshot; a scorer's per-snapshot answer (the same array
        object again) is clamped and weighed once."""
        endpoints = snap.endpoints
        n = len(endpoints)
        totals = np.zeros(n)
        for ws in self.scorers:
            if ws.weight == 0:
                continue
            scorer = ws.scorer
            raw = self._timed("scorer", scorer, scorer.score, request, endpoints, cycle)
            last = snap.memo.get(id(ws))
            if last is not None and last[0] is raw:
                totals += last[1]
                continue
            if type(raw) is np.ndarray:
                scores = raw
            else:
                scores = dense_scores(raw, endpoints, snap.positions if isinstance(raw, Mapping) else None)
            if scores.shape != (n,):
                log.error("scorer %s returned %s scores for %d endpoints: ignored", scorer.name, scores.shape, n)
                continue
            weighted = ws.weight * clamp_scores(scores)
            if scores is raw:
                snap.memo[id(ws)] = (raw, weighted)
            totals += weighted
        return totals

    def _fallbacks(self, request: LLMRequest, dropped: list[EndpointState], cycle: CycleState, room: int
                   ) -> list[EndpointState]:
        """The endpoints preference filters dropped, through the hard filters again (filters are pure, so those
        before the preference pass them again; those after it must judge them too) and ranked by the same
        scorers, in a copy of the cycle: its request-level work (tokens, hashes) is reused, and what the
        fallbacks' scoring writes does not reach the primary's pick hooks. The snapshot cache stays the
        primary's. At most `room` (0 = all)."""
        fallback_cycle = CycleState(cycle.load)
        fallback_cycle.update(cycle)
        primary_snapshot = self._snapshot
        rest = self.run(request, dropped, fallback_cycle, preferences=False)
        self._snapshot = primary_snapshot
        return rest[:room] if room else rest


@dataclass
class SchedulerConfig:
    """Profiles to run (the first is primary) and every configured plugin instance by name."""

    profiles: list[SchedulingProfile]
    plugins: dict[str, Plugin] = field(default_factory=dict)


def configured_plugins(config: SchedulerConfig) -> list[Plugin]:
    """Every distinct plugin instance of `config`: those it names and those its profiles run."""
    unique: dict[int, Plugin] = {}
    for p in [*config.plugins.values(), *(pl for prof in config.profiles for pl in prof.plugins())]:
        unique.setdefault(id(p), p)
    return list(unique.values())


def needs_response_body(config: SchedulerConfig) -> bool:
    """A configured plugin learns from response bodies (Plugin.reads_response_body)."""
    return any(p.reads_response_body for p in configured_plugins(config))


class Scheduler:
    def __init__(self, config: SchedulerConfig) -> None:
        if not config.profiles:
            raise ValueError("a scheduler needs at least one scheduling profile")
        self.config = config
        self.primary = config.profiles[0]
        self.timings = PluginTimings()
        for profile in config.profiles:
            profile.timings = self.timings
        # Every distinct plugin instance, so that hooks run once per plugin even if shared by profiles.
        self.plugins: list[Plugin] = configured_plugins(config)
        self.reads_response_body = needs_response_body(config)
        for profile in config.profiles:
            profile.link()
        # the producers of each key, in plugin order (the order their pick hooks run in)
        self._producers: dict[DataKey, list[str]] = {}
        for p in self.plugins:
            for key in p.produces:
                self._producers.setdefault(key, []).append(p.name)
        hooks = ("start", "stop", "set_endpoints", "prepare", "pre_request", "response_complete", "remove_endpoint",
                 "stats", "share_pick", "peer_pick", "peer_done")
        self._hooks = {h: [p for p in self.plugins if _overrides(p, h)] for h in hooks}
        self._pre_request = self._hooks["pre_request"]
        self._started: list[Plugin] = []
        self._stopped = False
        self._quarantine: dict[str, float] = {}  # address → monotonic time its quarantine ends
        self.endpoint_faults: dict[str, int] = {}  # address → decisions a plugin failed on its data
        self._fault_said_at: dict[str, float] = {}

    # -- lifecycle ----------------------------------------------------------------------------------------------

    def start(self, ctx: PluginContext | None = None) -> None:
        """Start every plugin that has a start hook; one failing stops those already started, then raises."""
        ctx = ctx or PluginContext()
        for p in self._hooks["start"]:
            try:
                p.start(ctx)
            except BaseException:
                self.stop()
                raise
            self._started.append(p)

    def stop(self) -> None:
        """Stop every plugin with a stop hook, once: those started last first, then the others (a start that
        failed half-way may have left threads behind); errors are logged."""
        if self._stopped:
            return
        self._stopped = True
        started = {id(p) for p in self._started}
        order = list(reversed(self._started)) + [p for p in self._hooks["stop"] if id(p) not in started]
        self._started = []
        for p in order:
            if _overrides(p, "stop"):
                try:
                    p.stop()
                except Exception:  # noqa: BLE001 - one plugin failing to stop must not keep the others running
                    log.exception("plugin %s failed to stop", p.name)

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        for p in self._hooks["set_endpoints"]:
            p.set_endpoints(endpoints)

    def remove_endpoint(self, address: str) -> None:
        self._quarantine.pop(address, None)
        self.endpoint_faults.pop(address, None)
        self._fault_said_at.pop(address, None)
        for p in self._hooks["remove_endpoint"]:
            p.remove_endpoint(address)

    def needs_prepare(self, request: LLMRequest) -> bool:
        return any(p.needs_prepare(request) for p in self._hooks["prepare"])

    async def prepare(self, request: LLMRequest) -> None:
        """The plugins' slow per-request work, one after the other (each bounds its own)."""
        for p in self._hooks["prepare"]:
            if p.needs_prepare(request):
                await p.prepare(request)

    def produces(self, key: DataKey) -> bool:
        """Whether a configured plugin writes `key` into the scheduling cycle."""
        return key in self._producers

    def _first(self, cycle: CycleState, key: DataKey) -> Any:
        """What the first producer of `key` (in plugin order) that wrote it in `cycle` wrote; None if none did."""
        for name in self._producers.get(key, ()):
            value = cycle.get((key, name))
            if value is not None:
                return value
        return None

    def picked_uncached_tokens(self, cycle: CycleState, prompt_tokens: int) -> int:
        """What the pick adds to the endpoint's prefill backlog: the prompt tokens it must really prefill, as a
        prefix-aware plugin's pick hook worked them out (the first to), else the whole prompt."""
        value = self._first(cycle, PICKED_UNCACHED_TOKENS)
        return prompt_tokens if value is None else value

    def objectives_unmeetable(self, cycle: CycleState) -> bool:
        """Whether a plugin found that no endpoint is predicted to meet the request's latency objectives."""
        return bool(self._first(cycle, OBJECTIVES_UNMEETABLE))

    # -- decisions ----------------------------------------------------------------------------------------------

    def schedule(self, request: LLMRequest, candidates: Sequence[EndpointState], cycle: CycleState | None = None
                 ) -> list[EndpointState]:
        """All eligible candidates, best first (primary, then fallbacks); [] = none eligible (answer 503).

        Pass a CycleState and give the same one to on_picked: the pick hook then reuses this cycle's work.
        """
        if not candidates:
            return []
        if self._quarantine:
            candidates = self._outside_quarantine(candidates)
            if not candidates:
                return []
        try:
            return self.primary.run(request, candidates, cycle)
        except Exception as exc:
            rest = self._without_faulty(request, candidates, cycle, exc)
            if cycle is not None:
                cycle.clear()  # what the failed decision wrote
                cycle.snapshot = None
            return self.primary.run(request, rest, cycle) if rest else []

    def quarantine(self, address: str, exc: BaseException, where: str) -> None:
        """Take `address` out of picks for QUARANTINE_S: a plugin raised `exc` on its data (`where`: the step)."""
        now = time.monotonic()
        self._quarantine[address] = now + QUARANTINE_S
        self.endpoint_faults[address] = self.endpoint_faults.get(address, 0) + 1
        said = self._fault_said_at.get(address)
        if said is None or now - said >= QUARANTINE_LOG_S:
            self._fault_said_at[address] = now
            log.warning("endpoint %s out of picks for %gs: %s failed on its data (%s: %s); %d such decision(s) so far",
                        address, QUARANTINE_S, where, type(exc).__name__, str(exc)[:200],
                        self.endpoint_faults[address])

    def quarantined(self) -> list[str]:
        """The endpoints out of picks now."""
        now = time.monotonic()
        return [a for a, until in self._quarantine.items() if until > now]

    def _outside_quarantine(self, candidates: Sequence[EndpointState]) -> list[EndpointState]:
        now = time.monotonic()
        for address in [a for a, until in self._quarantine.items() if until <= now]:
            del self._quarantine[address]
        if not self._quarantine:
            return list(candidates)
        return [c for c in candidates if c.endpoint.address not in self._quarantine]

    def _without_faulty(self, request: LLMRequest, candidates: Sequence[EndpointState], cycle: CycleState | None,
                        exc: Exception) -> list[EndpointState]:
        """The candidates whose decision alone does not raise; those whose does go to quarantine. Re-raises `exc`
        when every one's does (the request's fault or a plugin's, not an endpoint's)."""
        profile = self.primary
        kept_snapshot = profile._snapshot  # the singletons' snapshots must not replace the round's
        rest, faulty = [], []
        try:
            for c in candidates:
                try:
                    profile.run(request, [c], CycleState(cycle.load if cycle is not None else None))
                    rest.append(c)
                except Exception as alone:  # noqa: BLE001 - this endpoint's data is what fails
                    faulty.append((c, alone))
        finally:
            profile._snapshot = kept_snapshot
        if not faulty or not rest:
            raise exc
        for c, alone in faulty:
            self.quarantine(c.endpoint.address, alone, "scheduling")
        return rest

    def on_picked(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None) -> None:
        """The pick hooks, with the cycle that scheduled `request`; without one, a cycle holding the data the hooks
        read, produced for `endpoint` alone."""
        if cycle is None:
            cycle = CycleState()
            self.primary.produce(request, [endpoint], cycle)
        run = self.primary._timed
        for p in self._pre_request:
            run("pre_request", p, p.pre_request, request, endpoint, cycle)

    def on_response_complete(self, request: LLMRequest, endpoint_address: str, prompt_tokens: int = 0,
                             completion_tokens: int = 0) -> None:
        for p in self._hooks["response_complete"]:
            p.response_complete(request, endpoint_address, prompt_tokens, completion_tokens)

    # -- active-active replicas (epp/peer_sync.py) -----------------------------------------------------------------

    def share_pick(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None
                   ) -> dict[str, list[int]]:
        """Plugin name → its share of this pick, for the plugins that share one."""
        shared = {}
        for p in self._hooks["share_pick"]:
            value = p.share_pick(request, endpoint, cycle)
            if value is not None:
                shared[p.name] = value
        return shared

    def apply_peer_pick(self, pick_id: str, address: str, shared: Mapping[str, list[int]]) -> None:
        """A peer's pick: each plugin of the same name that replays picks gets its share (unknown names are
        ignored: a peer of another version or config)."""
        for p in self._hooks["peer_pick"]:
            value = shared.get(p.name)
            if value is not None:
                p.peer_pick(pick_id, address, value)

    def apply_peer_done(self, pick_id: str, address: str) -> None:
        for p in self._hooks["peer_done"]:
            p.peer_done(pick_id, address)

    # -- introspection ------------------------------------------------------------------------------------------

    def plugins_of_type(self, type_name: str) -> list[Plugin]:
        return [p for p in self.plugins if p.type_name == type_name]

    def plugin_timings(self) -> dict[tuple[str, str, str], tuple[int, float]]:
        """(extension point, plugin type, plugin name) → (calls, total seconds) since start (or reset)."""
        return self.timings.totals()

    def stats(self) -> dict[str, dict[str, float]]:
        """The plugins' stats, summed per `stats_group` over the plugins of that group ({} when none has any)."""
        total: dict[str, dict[str, float]] = {}
        for p in self._hooks["stats"]:
            if not p.stats_group:
                continue
            group = total.setdefault(p.stats_group, {})
            for key, value in p.stats().items():
                group[key] = group.get(key, 0) + value
        return total


def _link_inputs(plugin: Plugin, producers: Mapping[DataKey, list[str]]) -> None:
    """`plugin.inputs`: for each key it reads, the producer of its profile (`producers`: key → plugin names) its
    config names, else the profile's only one. ValueError for a named producer that is not one of the profile's, for
    several producers none of which is named, and for a key it needs (`consumes`) that none produces."""
    plugin.inputs = {}
    for key in (*plugin.consumes, *plugin.consumes_optional):
        have = [name for name in producers.get(key, ()) if name != plugin.name]
        named = plugin.sources.get(key)
        if named:
            if named not in have:
                raise ValueError(f"plugin {plugin.name!r} reads {key} from {named!r}, which is not a plugin of this "
                                 f"profile that produces it (producers here: {', '.join(sorted(have)) or 'none'})")
            plugin.inputs[key] = named
        elif len(have) == 1:
            plugin.inputs[key] = have[0]
        elif have:
            raise ValueError(f"plugin {plugin.name!r} reads {key}, which several plugins of this profile produce "
                             f"({', '.join(sorted(have))}): {key.choose or 'name one'}")
        elif key in plugin.consumes:
            raise ValueError(f"plugin {plugin.name!r} reads {key} from the scheduling cycle, which no plugin of its "
                             "profile produces")


def _overrides(plugin: Plugin, method: str) -> bool:
    return getattr(type(plugin), method) is not getattr(Plugin, method)
