"""The framework: profiles of filters, weighted scorers and a picker; the Scheduler's ordering and hooks."""

import collections

import numpy as np
import pytest

from kvgate.conformance.epp_config import CONFORMANCE_EPP_CONFIG
from kvgate.epp.scheduling.config import default_config, parse_config
from kvgate.epp.scheduling.framework import (
    CycleState,
    PluginContext,
    Filter,
    Scheduler,
    SchedulerConfig,
    SchedulingProfile,
    Scorer,
    WeightedScorer,
)
from kvgate.epp.scheduling.data import PICKED_UNCACHED_TOKENS, DataKey, Deferred, PerEndpoint
from kvgate.epp.scheduling.plugins import create_plugin
from tests.epp.helpers import addresses, request, state

A, B, C = "10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"
PROMPT = "System: answer briefly and precisely. " * 30


class FixedScorer(Scorer):
    type_name = "fixed"

    def __init__(self, scores):
        super().__init__()
        self.scores = scores

    def score(self, request, endpoints, cycle=None):
        return {e.address: self.scores[e.address] for e in endpoints if e.address in self.scores}


class DropFilter(Filter):
    type_name = "drop"

    def __init__(self, drop):
        super().__init__()
        self.drop = drop

    def filter(self, request, endpoints, cycle=None):
        return [e for e in endpoints if e.address not in self.drop]


class Recorder(Scorer):
    type_name = "recorder"

    def __init__(self):
        super().__init__()
        self.calls = []

    def score(self, request, endpoints, cycle=None):
        return {}

    def pre_request(self, request, endpoint, cycle=None):
        self.calls.append(("picked", request.request_id, endpoint.address))

    def response_complete(self, request, endpoint_address, prompt_tokens, completion_tokens):
        self.calls.append(("done", request.request_id, endpoint_address, prompt_tokens, completion_tokens))

    def remove_endpoint(self, address):
        self.calls.append(("removed", address))


def scheduler(filters=(), scorers=(), picker="max-score-picker", max_endpoints=3):
    profile = SchedulingProfile("p", list(filters), [WeightedScorer(s, w) for s, w in scorers],
                                create_plugin(picker, {"maxNumOfEndpoints": max_endpoints}))
    return Scheduler(SchedulerConfig([profile]))


def test_weighted_sum_orders_primary_then_fallbacks():
    s = scheduler(scorers=[(FixedScorer({A: 1.0, B: 0.0, C: 0.5}), 1.0),
                           (FixedScorer({A: 0.0, B: 1.0, C: 0.5}), 3.0)])
    # totals: A = 1, B = 3, C = 2
    assert addresses(s.schedule(request(), [state(A), state(B), state(C)])) == [B, C, A]


def test_zero_weight_scorer_is_ignored_and_missing_scores_count_zero():
    s = scheduler(scorers=[(FixedScorer({A: 1.0}), 0.0), (FixedScorer({B: 0.4}), 1.0)])
    assert addresses(s.schedule(request(), [state(A), state(B), state(C)]))[0] == B


def test_filters_run_in_order_and_empty_result_means_no_endpoint():
    s = scheduler(filters=[DropFilter({A}), DropFilter({B})], scorers=[(FixedScorer({C: 1.0}), 1.0)])
    assert addresses(s.schedule(request(), [state(A), state(B), state(C)])) == [C]
    assert scheduler(filters=[DropFilter({A})]).schedule(request(), [state(A)]) == []
    assert scheduler().schedule(request(), []) == []


def test_default_config_prefers_short_queue_and_free_kv():
    s = Scheduler(default_config().scheduler)
    endpoints = [state(A, queue=4, kv=0.9), state(B, queue=0, kv=0.1), state(C, queue=2, kv=0.5)]
    assert addresses(s.schedule(request(), endpoints)) == [B]  # one endpoint, as upstream's default


def test_default_config_ignores_the_test_selection_header():
    s = Scheduler(default_config().scheduler)
    endpoints = [state(A, queue=9, kv=0.9), state(B), state(C, queue=9, kv=0.9)]
    steered = request(headers={"test-epp-endpoint-selection": f"{A},{C}"})
    assert addresses(s.schedule(steered, endpoints)) == [B]
    assert addresses(s.schedule(request(headers={"test-epp-endpoint-selection": "10.9.9.9"}), endpoints)) == [B]


def test_conformance_config_header_selection_overrides_scores():
    s = Scheduler(parse_config(CONFORMANCE_EPP_CONFIG).scheduler)
    endpoints = [state(A, queue=9, kv=0.9), state(B), state(C)]
    selected = request(headers={"test-epp-endpoint-selection": f"{A},{C}"})
    # The listed order wins over scores, as long as the picker gives: one endpoint (a stock gateway parses one).
    assert addresses(s.schedule(selected, endpoints)) == [A]
    assert s.schedule(request(headers={"test-epp-endpoint-selection": "10.9.9.9"}), endpoints) == []
    listing = Scheduler(parse_config(CONFORMANCE_EPP_CONFIG.replace(
        "- type: max-score-picker", "- type: max-score-picker\n  parameters: {maxNumOfEndpoints: 3}")).scheduler)
    assert addresses(listing.schedule(selected, endpoints)) == [A, C]


def test_default_config_prefix_affinity_after_on_picked():
    s = Scheduler(default_config().scheduler)
    endpoints = [state(A), state(B), state(C)]  # equal load: prefix decides
    first = request(PROMPT + "question one", request_id="1")
    primary = s.schedule(first, endpoints)[0]
    s.on_picked(first, primary)
    for i in range(2, 8):
        follow = request(PROMPT + f"question {i}", request_id=str(i))
        picked = s.schedule(follow, endpoints)[0]
        assert picked.address == primary.address
        s.on_picked(follow, picked)
    stats = s.stats()["prefix_index"]
    assert stats["index_size"] > 0 and 0.5 < stats["hit_blocks"] / stats["total_blocks"] < 1.0


def test_prefix_affinity_yields_to_a_long_queue():
    s = Scheduler(default_config().scheduler)
    first = request(PROMPT, request_id="1")
    s.on_picked(first, state(A))
    s.schedule(first, [state(A)])
    # A: queue 2·0 + kv 2·0.05 + prefix 3·1 = 3.1;  B: 2·1 + 2·0.9 + 0 = 3.8.
    endpoints = [state(A, queue=8, kv=0.95), state(B, queue=0, kv=0.1)]
    assert addresses(s.schedule(request(PROMPT, request_id="2"), endpoints)) == [B]


def test_ties_spread_across_equal_endpoints():
    s = Scheduler(default_config().scheduler)
    endpoints = [state(A), state(B), state(C)]
    firsts = collections.Counter(s.schedule(request("x", request_id=str(i)), endpoints)[0].address
                                 for i in range(300))
    assert set(firsts) == {A, B, C} and min(firsts.values()) > 60


def test_hooks_fan_out_once_per_plugin_instance():
    recorder = Recorder()
    shared = SchedulingProfile("a", [], [WeightedScorer(recorder, 1.0)], create_plugin("max-score-picker"))
    second = SchedulingProfile("b", [], [WeightedScorer(recorder, 2.0)], create_plugin("max-score-picker"))
    s = Scheduler(SchedulerConfig([shared, second], {"recorder": recorder}))
    r = request(request_id="q")
    s.on_picked(r, state(A))
    s.on_response_complete(r, A, 10, 5)
    s.remove_endpoint(B)
    assert recorder.calls == [("picked", "q", A), ("done", "q", A, 10, 5), ("removed", B)]


def test_remove_endpoint_reaches_prefix_scorer():
    s = Scheduler(default_config().scheduler)
    s.on_picked(request(PROMPT, request_id="1"), state(A))
    assert s.stats()["prefix_index"]["indexed_endpoints"] == 1
    s.remove_endpoint(A)
    assert s.stats()["prefix_index"]["indexed_endpoints"] == 0


def test_scheduler_needs_a_profile():
    with pytest.raises(ValueError):
        Scheduler(SchedulerConfig([]))


# ------------------------------------------------------------------------------------------- framework bounds

class ConstantScorer(Scorer):
    """A scorer answering the same raw values (any range, NaN included) for every request: a buggy plugin."""

    type_name = "constant"

    def __init__(self, values):
        super().__init__()
        self.values = values

    def score(self, request, endpoints, cycle=None):
        return np.array([self.values[e.address] for e in endpoints], dtype=float)


def test_scores_are_clamped_so_a_buggy_scorer_cannot_dominate():
    buggy = ConstantScorer({A: 1000.0, B: float("nan"), C: -50.0})
    honest = FixedScorer({A: 0.0, B: 1.0, C: 1.0})
    s = scheduler(scorers=[(buggy, 1.0), (honest, 2.0)])
    # clamped: A = 1 + 0 = 1, B = 0 + 2 = 2, C = 0 + 2 = 2: the honest scorer's preference wins.
    assert addresses(s.schedule(request(), [state(A), state(B), state(C)]))[-1] == A


def test_dense_and_sparse_answers_weigh_the_same():
    endpoints = [state(A), state(B), state(C)]
    sparse = scheduler(scorers=[(FixedScorer({B: 0.25, C: 0.75}), 1.0)])
    dense = scheduler(scorers=[(ConstantScorer({A: 0.0, B: 0.25, C: 0.75}), 1.0)])
    assert addresses(sparse.schedule(request(), endpoints)) == addresses(dense.schedule(request(), endpoints)) \
        == [C, B, A]


def test_scorer_answer_of_the_wrong_length_is_ignored(caplog):
    class Short(Scorer):
        type_name = "short"

        def score(self, request, endpoints, cycle=None):
            return np.ones(len(endpoints) - 1)

    s = scheduler(scorers=[(Short(), 5.0), (FixedScorer({C: 1.0}), 1.0)])
    assert addresses(s.schedule(request(), [state(A), state(B), state(C)]))[0] == C
    assert "returned" in caplog.text


def test_every_plugin_call_is_timed_and_observable():
    s = scheduler(filters=[DropFilter(set())], scorers=[(create_plugin("queue-scorer"), 2.0),
                                                         (create_plugin("kv-cache-utilization-scorer"), 2.0),
                                                         (create_plugin("prefix-cache-scorer"), 3.0)])
    seen = []
    s.timings.observer = lambda point, type_name, name, seconds: seen.append((point, name, seconds))
    r = request(PROMPT, request_id="t")
    cycle = CycleState()
    primary = s.schedule(r, [state(A), state(B)], cycle)[0]
    s.on_picked(r, primary, cycle)
    totals = s.plugin_timings()
    for key in [("scorer", "queue-scorer", "queue-scorer"), ("scorer", "prefix-cache-scorer", "prefix-cache-scorer"),
                ("picker", "max-score-picker", "max-score-picker"),
                ("pre_request", "prefix-cache-scorer", "prefix-cache-scorer")]:
        calls, seconds = totals[key]
        assert calls == 1 and 0 < seconds < 1
    assert {(p, n) for p, n, _ in seen} >= {("scorer", "kv-cache-utilization-scorer"), ("filter", "drop")}
    assert all(0 < sec < 1 for _, _, sec in seen)


def test_cycle_state_flows_from_scoring_to_pre_request():
    class Remembering(Scorer):
        type_name = "remembering"

        def __init__(self):
            super().__init__()
            self.picked = []

        def score(self, request, endpoints, cycle=None):
            cycle[self] = f"scored {len(endpoints)} for {request.request_id}"
            return {}

        def pre_request(self, request, endpoint, cycle=None):
            self.picked.append((endpoint.address, cycle.get(self) if cycle is not None else None))

    plugin = Remembering()
    s = scheduler(scorers=[(plugin, 1.0)])
    for rid in ("a", "b"):
        cycle = CycleState()
        primary = s.schedule(request(request_id=rid), [state(A), state(B)], cycle)[0]
        s.on_picked(request(request_id=rid), primary, cycle)
    s.on_picked(request(request_id="c"), state(A))  # no cycle: nothing carried over from "b"
    assert [note for _, note in plugin.picked] == ["scored 2 for a", "scored 2 for b", None]


def test_metric_columns_are_reused_for_one_snapshot_and_recomputed_for_new_states():
    s = Scheduler(default_config().scheduler)
    snapshot = [state(A, queue=5), state(B, queue=0)]
    assert addresses(s.schedule(request(request_id="1"), snapshot))[0] == B
    memo = s.primary._snapshot.memo
    assert addresses(s.schedule(request(request_id="2"), snapshot))[0] == B
    assert s.primary._snapshot.memo is memo  # same states: the cached scores served
    fresh = [state(A, queue=0), state(B, queue=5)]  # a new scrape round: new objects, new numbers
    assert addresses(s.schedule(request(request_id="3"), fresh))[0] == A


def test_max_score_picker_single_pick_agrees_with_the_full_order():
    endpoints = [state(f"10.0.1.{i}:8000") for i in range(7)]
    totals = np.array([0.5, 2.0, 1.0, 2.0, 0.0, 2.0, 1.5])
    one = create_plugin("max-score-picker", {"maxNumOfEndpoints": 1})
    every = create_plugin("max-score-picker")
    firsts = collections.Counter()
    for i in range(300):
        r = request(request_id=f"r{i}")
        picked = one.pick(r, endpoints, totals)
        assert addresses(picked) == addresses(every.pick(r, endpoints, totals)[:1])
        firsts[picked[0].address] += 1
    assert set(firsts) == {endpoints[1].address, endpoints[3].address, endpoints[5].address}
    assert min(firsts.values()) > 60


class Lifecycle(Scorer):
    """Records its lifecycle hooks in a shared log; `fail_start` makes its start raise."""

    type_name = "lifecycle"
    stats_group = "things"

    def __init__(self, name, log, fail_start=False, produces=(), consumes=()):
        super().__init__()
        self.name, self.log, self.fail_start = name, log, fail_start
        self.produces, self.consumes = produces, consumes

    def score(self, request, endpoints, cycle=None):
        return {}

    def start(self, ctx):
        self.log.append(("start", self.name, ctx.tokenizer))
        if self.fail_start:
            raise RuntimeError(f"{self.name} cannot start")

    def stop(self):
        self.log.append(("stop", self.name))

    def set_endpoints(self, endpoints):
        self.log.append(("endpoints", self.name, [e.address for e in endpoints]))

    def stats(self):
        return {"seen": 1.0, self.name: 2.0}

    def needs_prepare(self, request):
        return request.prompt.startswith("slow")

    async def prepare(self, request):
        self.log.append(("prepare", self.name, request.request_id))


def lifecycle_scheduler(*plugins):
    return Scheduler(SchedulerConfig([SchedulingProfile("p", [], [WeightedScorer(p, 1.0) for p in plugins],
                                                        create_plugin("max-score-picker"))]))


def test_lifecycle_hooks_start_stop_endpoints_stats_and_prepare():
    import asyncio

    from kvgate.epp.types import Endpoint

    log = []
    s = lifecycle_scheduler(Lifecycle("a", log), Lifecycle("b", log), Recorder())
    s.start(PluginContext(tokenizer="/tok"))
    s.set_endpoints([Endpoint(A), Endpoint(B)])
    assert s.stats() == {"things": {"seen": 2.0, "a": 2.0, "b": 2.0}}   # summed per group; Recorder has none
    fast, slow = request("quick", request_id="f"), request("slow prompt", request_id="s")
    assert not s.needs_prepare(fast) and s.needs_prepare(slow)
    asyncio.run(s.prepare(slow))
    s.stop()
    s.stop()                                                            # a second stop stops nothing twice
    assert log == [("start", "a", "/tok"), ("start", "b", "/tok"), ("endpoints", "a", [A, B]),
                   ("endpoints", "b", [A, B]), ("prepare", "a", "s"), ("prepare", "b", "s"),
                   ("stop", "b"), ("stop", "a")]


def test_a_failing_start_stops_what_started_and_raises():
    log = []
    s = lifecycle_scheduler(Lifecycle("a", log), Lifecycle("b", log, fail_start=True), Lifecycle("c", log))
    with pytest.raises(RuntimeError, match="b cannot start"):
        s.start()
    assert log == [("start", "a", None), ("start", "b", None), ("stop", "a"), ("stop", "b"), ("stop", "c")]


def test_cycle_keys_consumed_must_be_produced():
    log = []
    x, y = DataKey("key.x"), DataKey("key.y")
    with pytest.raises(ValueError, match="'reader' reads key.x from the scheduling cycle, which no plugin of its profile "
                                         "produces"):
        lifecycle_scheduler(Lifecycle("reader", log, consumes=(x,)))
    s = lifecycle_scheduler(Lifecycle("reader", log, consumes=(x,)), Lifecycle("writer", log, produces=(x,)))
    assert s.produces(x) and not s.produces(y)
    assert s.plugins[0].inputs == {x: "writer"}


def test_kvgates_profile_declares_the_picked_uncached_tokens_the_director_reads():
    from kvgate.epp.scheduling.config import KVGATE_PROFILE_YAML

    assert Scheduler(parse_config(KVGATE_PROFILE_YAML).scheduler).produces(PICKED_UNCACHED_TOKENS)
    assert not Scheduler(default_config().scheduler).produces(PICKED_UNCACHED_TOKENS)   # upstream's: no producer


COUNT = DataKey("test.count")


class Counter(Scorer):
    """Produces, per cycle, how many candidates it started with."""

    type_name = "test-counter"
    produces = (COUNT,)

    def produce(self, request, endpoints, cycle):
        cycle.put(self, COUNT, len(endpoints))

    def score(self, request, endpoints, cycle=None):
        return np.zeros(len(endpoints))


class NeedsCount(Scorer):
    """Cannot score without the counter's data: prefers the endpoint at position COUNT - 1."""

    type_name = "test-needs-count"
    consumes = (COUNT,)

    def score(self, request, endpoints, cycle=None):
        n = cycle.read(self, COUNT)
        return np.array([1.0 if i == n - 1 else 0.0 for i in range(len(endpoints))])


def test_a_profile_whose_plugin_needs_data_nothing_produces_is_refused_at_config_load(monkeypatch):
    from kvgate.epp.scheduling import plugins
    from kvgate.epp.scheduling.config import ConfigError

    monkeypatch.setitem(plugins.REGISTRY, "test-counter", lambda parameters: Counter())
    monkeypatch.setitem(plugins.REGISTRY, "test-needs-count", lambda parameters: NeedsCount())
    head = "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\nplugins:\n"
    alone = head + "- type: test-needs-count\n"
    with pytest.raises(ConfigError, match=r"schedulingProfiles\[0\] \(default\): plugin 'test-needs-count' reads "
                                          "test.count from the scheduling cycle, which no plugin of its profile produces"):
        parse_config(alone)
    outside = (head + "- type: test-needs-count\n- type: test-counter\nschedulingProfiles:\n- name: default\n"
               "  plugins:\n  - pluginRef: test-needs-count\n")  # the producer is configured, in no profile
    with pytest.raises(ConfigError, match="'test-needs-count' reads test.count"):
        parse_config(outside)
    both = parse_config(head + "- type: test-needs-count\n- type: test-counter\n")
    scheduler = Scheduler(both.scheduler)
    assert [p.name for p in scheduler.primary._producers] == ["test-counter"]
    assert addresses(scheduler.schedule(request(), [state(A), state(B), state(C)])) == [C]  # it read 3


def test_data_per_endpoint_reads_for_any_list_of_the_candidates():
    candidates = [state(f"10.0.0.{i}:8000") for i in range(40)]
    values = PerEndpoint(candidates, np.arange(40.0), missing=-1.0)
    assert values.of(candidates) is values.values
    assert values.of(list(candidates)).tolist() == list(range(40))  # a copy: the same objects
    assert values.of([candidates[3], candidates[30]]).tolist() == [3, 30]  # a few of many
    assert values.of(candidates[::2]).tolist() == list(range(0, 40, 2))  # many
    other = state("10.0.0.7:8000")  # another state object of a candidate's address, and a stranger
    assert values.of([other, state("10.9.9.9:8000")]).tolist() == [7, -1]
    assert values.of(candidates[::2] + [other]).tolist() == [*range(0, 40, 2), 7]


def test_deferred_data_is_computed_at_its_first_read_once():
    calls = []
    log = []
    writer, reader = Lifecycle("writer", log, produces=(COUNT,)), Lifecycle("reader", log, consumes=(COUNT,))
    lifecycle_scheduler(reader, writer)
    cycle = CycleState()
    cycle.put(writer, COUNT, Deferred(lambda: calls.append(1) or 7))
    assert calls == []
    assert cycle.read(reader, COUNT) == 7 and cycle.read(reader, COUNT) == 7 and calls == [1]
