"""The framework: profiles of filters, weighted scorers and a picker; the Scheduler's ordering and hooks."""

import collections

import pytest

from kvgate.epp.scheduling.config import default_config
from kvgate.epp.scheduling.framework import (
    Filter,
    Scheduler,
    SchedulerConfig,
    SchedulingProfile,
    Scorer,
    WeightedScorer,
)
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


def scheduler(filters=(), scorers=(), picker="max-score-picker"):
    profile = SchedulingProfile("p", list(filters), [WeightedScorer(s, w) for s, w in scorers],
                                create_plugin(picker))
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
    assert addresses(s.schedule(request(), endpoints)) == [B, C, A]


def test_default_config_header_selection_overrides_scores():
    s = Scheduler(default_config().scheduler)
    endpoints = [state(A, queue=9, kv=0.9), state(B), state(C)]
    selected = request(headers={"test-epp-endpoint-selection": f"{A},{C}"})
    assert addresses(s.schedule(selected, endpoints)) == [A, C]
    assert s.schedule(request(headers={"test-epp-endpoint-selection": "10.9.9.9"}), endpoints) == []


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
    stats = s.prefix_stats()
    assert stats["index_size"] > 0 and 0.5 < stats["hit_ratio"] < 1.0


def test_prefix_affinity_yields_to_a_long_queue():
    s = Scheduler(default_config().scheduler)
    first = request(PROMPT, request_id="1")
    s.on_picked(first, state(A))
    s.schedule(first, [state(A)])
    # A: queue 2·0 + kv 2·0.05 + prefix 3·1 = 3.1;  B: 2·1 + 2·0.9 + 0 = 3.8.
    endpoints = [state(A, queue=8, kv=0.95), state(B, queue=0, kv=0.1)]
    assert addresses(s.schedule(request(PROMPT, request_id="2"), endpoints)) == [B, A]


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
    assert s.prefix_stats()["indexed_endpoints"] == 1
    s.remove_endpoint(A)
    assert s.prefix_stats()["indexed_endpoints"] == 0


def test_scheduler_needs_a_profile():
    with pytest.raises(ValueError):
        Scheduler(SchedulerConfig([]))
