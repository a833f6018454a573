"""The confidence intervals of `kvgate bench routing` (bench/routing/stats.py, repeats.py) and their use by `--lead`,
on synthetic runs whose truth is known: no process starts.

The synthetic cell: each run's TTFTs are lognormal around a run effect of its own (the placement a run happened to
get moves its whole distribution), so the truth a cell estimates — the TTFT quantile over every run it could have
had — is the quantile of the lognormal with both spreads added."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvgate.bench.routing.lead import leads
from kvgate.bench.routing.repeats import combine_runs, repeat_seed
from kvgate.bench.routing.runner import _percentiles
from kvgate.bench.routing.stats import (RunSample, _weighted_percentiles, cell_intervals, cell_samples, interval,
                                        point, replicates)
from kvgate.bench.routing.workloads import WORKLOADS, arrivals

Z90 = 1.2815515655446004
MEDIAN = 0.4


def synthetic(rng, runs: int, n: int, between: float, within: float, tokens: float = 32.0) -> list[RunSample]:
    out = []
    for _ in range(runs):
        effect = rng.normal(0.0, between)
        ttft = MEDIAN * np.exp(effect + rng.normal(0.0, within, n))
        out.append(RunSample(ttft, np.full(n, tokens), 20.0 * np.exp(-effect / 4)))  # a slow run: fewer tok/s
    return out


def true_p90(between: float, within: float) -> float:
    return MEDIAN * np.exp(Z90 * np.hypot(between, within))


def coverage(runs: int, n: int, between: float, within: float, trials: int, *, pool_as_one: bool = False) -> float:
    rng = np.random.default_rng(7)
    truth, covered = true_p90(between, within), 0
    for _ in range(trials):
        sample = synthetic(rng, runs, n, between, within)
        if pool_as_one:  # what a bootstrap over requests alone would say of the same runs
            sample = [RunSample(np.concatenate([r.ttft_s for r in sample]),
                                np.concatenate([r.tokens for r in sample]), 20.0)]
        lo, hi = interval(replicates(sample, 300, rng)["p90"])
        covered += lo <= truth <= hi
    return covered / trials


def test_a_within_run_interval_covers_an_identically_distributed_run_at_about_its_level():
    assert 0.88 <= coverage(runs=1, n=300, between=0.0, within=0.8, trials=150) <= 0.99


@pytest.mark.slow
def test_the_hierarchical_interval_counts_the_spread_between_runs_that_one_runs_requests_cannot_show():
    # runs whose placement moves the whole distribution: the requests of five runs pooled as one say far too little,
    # and five runs drawn as they are somewhat too little (the widening for few runs makes up the rest)
    hierarchical = coverage(runs=5, n=100, between=0.3, within=0.5, trials=150)
    naive = coverage(runs=5, n=100, between=0.3, within=0.5, trials=150, pool_as_one=True)
    assert 0.88 <= hierarchical <= 0.99 and naive <= 0.6, (hierarchical, naive)
    # runs that agree: about the level still, not widened into uselessness
    assert 0.88 <= coverage(runs=5, n=100, between=0.0, within=0.5, trials=150) <= 0.995


def test_weighted_replicates_are_np_percentile_over_the_expanded_draw():
    rng = np.random.default_rng(3)
    values = np.sort(rng.exponential(size=40))
    weights = rng.integers(0, 4, size=(25, 40))
    weights[0] = 0
    weights[0, 7] = 1  # a draw of a single request
    got = _weighted_percentiles(values, weights, {"p50": 0.5, "p90": 0.9, "p99": 0.99})
    for row, w in enumerate(weights):
        expanded = np.repeat(values, w)
        for name, q in (("p50", 50), ("p90", 90), ("p99", 99)):
            assert got[name][row] == pytest.approx(np.percentile(expanded, q)), (row, name)
    assert np.isnan(_weighted_percentiles(values, np.zeros((1, 40), dtype=int), {"p90": 0.9})["p90"][0])


def test_intervals_are_deterministic_with_a_seed_and_hold_the_pooled_point():
    runs = synthetic(np.random.default_rng(1), 4, 200, 0.2, 0.6)
    a, b = cell_intervals(runs, seed=11), cell_intervals(runs, seed=11)
    assert a == b and cell_intervals(runs, seed=12) != a
    assert a["method"] == "hierarchical" and a["runs"] == 4 and a["level"] == 0.95
    pooled = point(runs)
    for name in ("p50", "p90", "p99"):
        lo, hi = a["ttft_s"][name]
        assert lo <= pooled[name] <= hi, name
    lo, hi = a["output_tokens_per_s"]
    assert lo < pooled["output_tokens_per_s"] < hi
    one = cell_intervals(runs[:1], seed=11)
    assert one["method"] == "within-run" and one["runs"] == 1
    # one run's point is what the runner always reported
    assert {k: round(v, 4) for k, v in point(runs[:1]).items() if k != "output_tokens_per_s"} == \
        _percentiles(list(runs[0].ttft_s))


def test_output_tok_s_interval_comes_from_the_runs():
    # a run's tok/s is its tokens over its span: with every request the same size, only the runs' spans vary it
    rng = np.random.default_rng(5)
    runs = [RunSample(np.full(100, 0.3), np.full(100, 32.0), span) for span in (19.0, 20.0, 21.0, 22.0)]
    lo, hi = interval(replicates(runs, 2000, rng)["output_tokens_per_s"])
    rates = [3200 / s for s in (19.0, 20.0, 21.0, 22.0)]
    # all of the spread is between runs: about Student's t interval of the runs' mean, 3 degrees of freedom
    half = 3.182 * np.std(rates, ddof=1) / 2
    assert lo < np.mean(rates) < hi
    assert np.mean(rates) - lo == pytest.approx(half, rel=0.2) and hi - np.mean(rates) == pytest.approx(half, rel=0.2)
    lo, hi = interval(replicates(runs[:1], 500, rng)["output_tokens_per_s"])
    assert lo == hi == pytest.approx(3200 / 19.0)  # within one run nothing moves it: said, not hidden


def run_result(sample: RunSample, failed: int = 0) -> dict:
    """One run as runner.run_cell reports it, from a synthetic sample."""
    ttft = [round(float(t), 4) for t in sample.ttft_s]
    return {"requests": len(ttft) + failed, "sent": len(ttft) + failed, "succeeded": len(ttft), "failed": failed,
            "errors": {"HTTP 503": failed} if failed else {},
            "output_tokens_per_s": round(float(sample.tokens.sum() / sample.span_s), 2),
            "ttft_s": _percentiles(ttft), "prefix_cache_hit_rate": 0.5, "prefix_cache_queries": 1000,
            "prefix_cache_hits": 500, "load_spread": 1.1, "seconds": sample.span_s,
            "samples": {"ttft_s": ttft, "tokens": [int(t) for t in sample.tokens], "span_s": sample.span_s},
            "cpu": {"gateway_ms_per_request": 2.0, "engines_ms_per_request": 4.0},
            "epp_time": {"request_path": {"requests": len(ttft), "mean_ms": 0.5}}}


def test_runs_pool_into_one_cell_and_repeat_zero_is_the_seed_itself():
    runs = [run_result(s, failed=i) for i, s in enumerate(synthetic(np.random.default_rng(2), 3, 100, 0.2, 0.5))]
    cell = combine_runs(runs)
    assert (cell["requests"], cell["succeeded"], cell["failed"]) == (303, 300, 3)
    assert cell["errors"] == {"HTTP 503": 3} and cell["runs"] == runs
    pooled = [t for r in runs for t in r["samples"]["ttft_s"]]
    assert cell["ttft_s"] == _percentiles(pooled)
    assert cell["output_tokens_per_s"] == pytest.approx(np.mean([r["output_tokens_per_s"] for r in runs]), abs=0.01)
    assert cell["epp_time"]["request_path"] == {"requests": 300, "mean_ms": 0.5}
    assert len(cell_samples(cell)) == 3 and combine_runs(runs[:1]) == runs[0]
    assert cell_samples({"ttft_s": {"p90": 1.0}}) is None  # a cell from an older file: no interval
    # repeat 0 sends --seed's stream, so one-repeat result files stay comparable; the others their own seeds
    assert repeat_seed(0, 0) == 0 and repeat_seed(3, 0) == 3
    seeds = [repeat_seed(s, k) for s in range(3) for k in range(1, 6)]
    assert len(set(seeds)) == len(seeds) and not set(seeds) & set(range(1000))
    assert repeat_seed(0, 1) == repeat_seed(0, 1)  # derived, not drawn: the same file, the same streams
    shape = WORKLOADS["multi-tenant"]
    assert arrivals(shape, 6, 10, repeat_seed(0, 0)) == arrivals(shape, 6, 10, 0)
    assert arrivals(shape, 6, 10, repeat_seed(0, 1))[0].prompt != arrivals(shape, 6, 10, 0)[0].prompt


def lead_file(seed: int, runs: int = 3) -> dict:
    rng = np.random.default_rng(seed)

    def cell(config: str, p90: float) -> dict:
        median = p90 / np.exp(Z90 * 0.5)
        samples = [RunSample(median * np.exp(rng.normal(0, 0.1) + rng.normal(0, 0.5, 250)), np.full(250, 32.0),
                             20.0) for _ in range(runs)]
        return {"configuration": config, "rate": 10.0, **combine_runs([run_result(s) for s in samples])}
    return {"seed": seed, "workloads": {
        "ahead": {"what": "", "cells": [cell("kvgate", 0.2), cell("sglang-router", 0.8), cell("vllm-router", 1.2)]},
        "barely": {"what": "", "cells": [cell("kvgate", 0.5), cell("sglang-router", 0.8)]},
        "even": {"what": "", "cells": [cell("kvgate", 1.0), cell("sglang-router", 1.0)]}}}


def test_a_lead_gets_an_interval_and_a_verdict_with_95_percent_confidence(tmp_path):
    results = [lead_file(seed) for seed in (0, 1)]
    found = leads(json.loads(json.dumps(results)))  # as read back from the files
    ahead, barely, even = found["ahead"], found["barely"], found["even"]
    for s in ahead["seeds"].values():  # 4x ahead: the interval clears the bar; tok/s even, as both serve all
        lo, hi = s["p90_lead_ci"]
        assert 1.5 < lo <= s["p90_lead"] <= hi and s["ci_method"] == "hierarchical" and s["runs"] == 3
        assert s["tok_lead"] == 1.0 and s["tok_lead_ci"] == [1.0, 1.0]
    assert ahead["leads"] and ahead["leads_95"] is True
    # 1.6x ahead on three runs of a few hundred requests: not told apart from a lead under the bar
    assert all(s["p90_lead_ci"][0] < 1.5 < s["p90_lead_ci"][1] for s in barely["seeds"].values())
    assert barely["leads_95"] is False
    # identical sides: no lead, and the interval says it could go either way
    for s in even["seeds"].values():
        lo, hi = s["p90_lead_ci"]
        assert lo < 1.0 < hi and lo < s["p90_lead"] < hi
    assert even["leads_95"] is False and not even["leads"]
    assert leads(json.loads(json.dumps(results))) == found  # the same files, the same intervals


def test_repeats_are_bounded_before_anything_starts():
    from kvgate.cli import main

    for bad in ("0", "51"):
        with pytest.raises(SystemExit, match="--repeats"):
            main(["bench", "routing", "--workloads", "multi-tenant", "--repeats", bad])
