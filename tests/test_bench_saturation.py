"""The saturation search of `kvgate bench routing --find-saturation` (kvgate/bench_routing/saturation.py), on
measured-p90 functions whose answer is known."""

from __future__ import annotations

import pytest

from kvgate.bench_routing.saturation import find_saturation


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
