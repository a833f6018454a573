"""The saturation search of `kvgate bench routing --find-saturation` (bench/routing/saturation.py), on
measured-p90 functions whose answer is known."""

from __future__ import annotations

import json
import math

import pytest

from kvgate.bench.routing.cli import _rates_per_shape, _shapes
from kvgate.bench.routing.saturation import SATURATION_RATES, cell_p90, find_saturation, rates_from_result
from kvgate.bench.routing.workloads import SHAPES


def queue(capacity: float, light: float = 0.1):
    """TTFT p90 of an M/M/1-like pool: light at low rates, growing without bound as the rate nears capacity."""
    calls = []

    def measure(rate: float) -> float:
        calls.append(rate)
        return light / max(1e-6, 1 - rate / capacity) if rate < capacity else 1e3
    return measure, calls


def test_the_ramp_then_bisection_lands_between_the_last_rate_below_and_the_first_above():
    measure, calls = queue(capacity=20.0)
    found = find_saturation(measure, factor=10, light_rate=1, start_rate=4, growth=1.5, bisect_steps=3)
    # p90 reaches 10x light (0.1 / 0.95 s at 1 req/s) from rate 18.1: the ramp goes 4, 6, 9, 13.5, 20.25 (past
    # it), then bisects
    assert calls[:6] == [1, 4, 6, 9, 13.5, 20.25]
    assert found.target_p90_s == pytest.approx(10 * 0.1 / 0.95)
    assert 18.1 <= found.rate <= 20.25
    assert all(p >= found.target_p90_s for r, p in found.probes if r >= found.rate)
    assert found.as_dict()["saturation_rate"] == found.rate and len(found.as_dict()["probes"]) == len(calls)


def test_no_saturation_within_the_bounds_is_said_not_guessed():
    measure, calls = queue(capacity=1e6)
    found = find_saturation(measure, max_rate=50, max_probes=5)
    assert found.rate is None and len(calls) == 5  # bounded by max_probes
    found = find_saturation(queue(capacity=1e6)[0], max_rate=10, max_probes=10)
    assert found.rate is None and max(r for r, _ in found.probes) <= 10  # bounded by max_rate


def test_a_failed_cell_is_not_saturation():
    answers = iter([0.2, None, 0.5, 3.0, 2.5])
    found = find_saturation(lambda rate: next(answers), bisect_steps=1)
    assert found.probes[1][1] is None and found.rate is not None and found.probes[3][1] == 3.0
    found = find_saturation(lambda rate: None)
    assert found.rate is None and found.target_p90_s is None and len(found.probes) == 1


def test_bad_bounds_are_refused():
    for kwargs in ({"factor": 1}, {"light_rate": 5, "start_rate": 4}, {"growth": 1}, {"max_probes": 1}):
        with pytest.raises(ValueError):
            find_saturation(lambda rate: 1.0, **kwargs)


def test_a_cell_that_left_requests_queued_is_past_capacity_not_failed():
    base = {"requests": 10, "sent": 10, "succeeded": 10, "errors": {}, "ttft_s": {"p90": 0.4}}
    assert cell_p90(base) == 0.4
    drained = {**base, "succeeded": 7, "errors": {"unfinished 60 s after the last arrival": 3}}
    assert math.isinf(cell_p90(drained))
    assert cell_p90({**drained, "errors": {"unfinished 60 s after the last arrival": 2, "HTTP 503": 1}}) is None
    assert cell_p90({**base, "sent": 9}) is None and cell_p90({**base, "requests": 0, "sent": 0}) is None
    answers = iter([0.2, 0.5, float("inf"), 1.0, 1.5])
    found = find_saturation(lambda rate: next(answers), bisect_steps=2)
    assert found.rate == 6.0 and found.as_dict()["probes"][2] == {"rate": 6.0, "ttft_p90_s": None, "unfinished": True}
    json.dumps(found.as_dict(), allow_nan=False)  # strict JSON: no Infinity


def test_rates_saturation_runs_each_shape_at_its_own_rate(tmp_path):
    shapes = _shapes("multi-tenant,no-reuse", None)
    found = tmp_path / "found.json"
    found.write_text(json.dumps({"find_saturation": {"factor": 10}, "workloads": {
        "multi-tenant": {"saturation_rate": 14.9}, "no-reuse": {"saturation_rate": 18.3},
        "multi-turn": {"saturation_rate": None}, "bad": {"saturation_rate": True}}}))
    assert rates_from_result(found) == {"multi-tenant": 14.9, "no-reuse": 18.3}
    assert _rates_per_shape(f"saturation:{found}", shapes) == {"multi-tenant": [14.9], "no-reuse": [18.3]}
    assert _rates_per_shape("2,6", shapes) == {"multi-tenant": [2.0, 6.0], "no-reuse": [2.0, 6.0]}
    with pytest.raises(SystemExit, match="no saturation rate for multi-turn"):
        _rates_per_shape(f"saturation:{found}", _shapes("multi-turn", None))
    for text in ('{"workloads": {}}', "[1, 2]", "not json"):
        found.write_text(text)
        with pytest.raises(SystemExit, match="saturation:"):
            _rates_per_shape(f"saturation:{found}", shapes)
    with pytest.raises(SystemExit, match="--rates"):
        _rates_per_shape(f"saturation:{tmp_path / 'missing.json'}", shapes)
    with pytest.raises(SystemExit, match="saturation or saturation:FILE"):
        _rates_per_shape("saturation=x", shapes)


def test_every_named_shape_has_a_frozen_saturation_rate():
    assert set(SATURATION_RATES) == set(SHAPES) and all(0 < r <= 1000 for r in SATURATION_RATES.values())
