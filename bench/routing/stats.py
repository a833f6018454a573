"""Confidence intervals for `kvgate bench routing`: how far a cell's TTFT quantiles and output tok/s could move on
another run of the same shape, rate and configuration.

A cell runs R times (`--repeats`), each on a fresh stack with its own request stream. Its point estimates pool the
runs: the TTFT quantiles over every succeeded request of every run, the output tok/s as the runs' mean. Their
interval is a percentile bootstrap:

    R ≥ 2   hierarchical: draw R runs with replacement, then each drawn run's requests with replacement, and
            compute the pooled quantiles and the mean tok/s of that draw. The runs carry what one run's requests
            cannot show — which replica each prefix landed on, and how the queues met — so the spread between runs
            is counted, not assumed away.
    R = 1   within-run: the requests alone, with replacement. That counts the sampling of a tail from a few hundred
            requests but not the run-to-run placement spread (its requests queue together and share one placement),
            so it undercounts; the result says `within-run`.

A run's output tok/s in a draw is its resampled requests' tokens ÷ its own span (first arrival to last answer).

Few runs: a bootstrap over R runs sees (R − 1)/R of their spread and no more than R of them, so where the runs differ
more than their requests do, its percentile interval is too narrow (its coverage at R = 5: docs/benchmarks.md). Each
measure's draws are therefore widened around the point, on a log scale, by

    m = t(0.975, df) / z(0.975) × sqrt(1 + f / (R − 1)),      df = (R − 1) / f²  (Satterthwaite)

where f is the share of one run's variance (log scale) that lies between runs: the runs' own values' variance less
the mean of their within-run bootstrap variances, over the runs' variance. Runs that agree (f → 0) leave the
interval as drawn; runs that differ as much as a few clusters can (f → 1) get Student's t with R − 1 degrees of
freedom and the (R − 1)/R bias undone.

Each draw is counts over the requests (how often each was drawn), so the draws are weighted quantiles over the
runs' requests sorted once: B draws cost O(B × requests). `replicates` gives the draws themselves, for ratios of
two cells (lead.py bootstraps a lead from the two cells' draws, each cell drawn on its own).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

QUANTILES = {"p50": 0.50, "p90": 0.90, "p99": 0.99}
DEFAULT_DRAWS = 1000
LEVEL = 0.95


@dataclass(frozen=True)
class RunSample:
    """One run's succeeded requests: TTFT (s) and output tokens of each, and the run's span (s)."""
    ttft_s: np.ndarray
    tokens: np.ndarray
    span_s: float


def samples_of(run: dict) -> RunSample | None:
    """The RunSample of one run's result (its `samples` entry: runner.summarize); None when it has none (a result
    file from before samples were kept)."""
    s = run.get("samples") if isinstance(run, dict) else None
    if not isinstance(s, dict) or "ttft_s" not in s:
        return None
    ttft, tokens = np.asarray(s["ttft_s"], dtype=float), np.asarray(s.get("tokens", []), dtype=float)
    if len(tokens) != len(ttft):
        raise ValueError("a run's samples have ttft_s and tokens of different lengths")
    return RunSample(ttft, tokens, float(s.get("span_s") or 0.0))


def cell_samples(cell: dict) -> list[RunSample] | None:
    """Every run of a cell (one `runs` entry each, or the cell itself for one run); None when any lacks samples."""
    runs = cell.get("runs") or [cell]
    found = [samples_of(r) for r in runs]
    return None if any(s is None for s in found) else found


def point(runs: list[RunSample]) -> dict:
    """The pooled TTFT quantiles (np.percentile, as one run's table always had them) and the runs' mean tok/s."""
    pooled = np.concatenate([r.ttft_s for r in runs]) if runs else np.array([])
    out = {k: (float(np.percentile(pooled, 100 * q)) if len(pooled) else None) for k, q in QUANTILES.items()}
    out["output_tokens_per_s"] = float(np.mean([r.tokens.sum() / r.span_s if r.span_s > 0 else 0.0 for r in runs]))
    return out


def replicates(runs: list[RunSample], draws: int = DEFAULT_DRAWS,
               rng: np.random.Generator | None = None) -> dict[str, np.ndarray]:
    """`draws` bootstrap replicates of p50, p90, p99 (pooled TTFT, s) and output_tokens_per_s (mean over runs):
    hierarchical over the runs when there are two or more, within the one run otherwise (module doc)."""
    if not runs:
        raise ValueError("no runs to resample")
    rng = rng if rng is not None else np.random.default_rng(0)
    drawn = _draws(runs, draws, rng)
    if len(runs) > 1:
        center = point(runs)
        for name, factor in widening(runs, rng).items():
            drawn[name] = _widen(drawn[name], center[name], factor)
    return drawn


def _draws(runs: list[RunSample], draws: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The bootstrap draws as drawn (replicates, before widening)."""
    n_runs = len(runs)
    if n_runs == 1:
        picked = np.ones((draws, 1), dtype=np.int64)
    else:  # how often each run is drawn, per replicate
        rows = np.repeat(np.arange(draws), n_runs)
        picked = np.bincount(rows * n_runs + rng.integers(0, n_runs, size=draws * n_runs),
                             minlength=draws * n_runs).reshape(draws, n_runs)
    weights, tok_s = [], np.zeros(draws)
    for j, run in enumerate(runs):
        n = len(run.ttft_s)
        if n == 0:
            continue  # no request succeeded: no TTFT to draw, no tokens
        # each drawn copy of the run resampled on its own: picked × n draws of its requests, counted per replicate
        rows = np.repeat(np.arange(draws), picked[:, j] * n)
        counts = np.bincount(rows * n + rng.integers(0, n, size=len(rows)), minlength=draws * n).reshape(draws, n)
        weights.append(counts)
        if run.span_s > 0:
            tok_s += counts @ run.tokens / run.span_s
    out = {"output_tokens_per_s": tok_s / n_runs}
    if not weights:
        out.update({k: np.full(draws, np.nan) for k in QUANTILES})
        return out
    values = np.concatenate([r.ttft_s for r in runs])
    order = np.argsort(values, kind="stable")
    w = np.concatenate(weights, axis=1)[:, order]
    out.update(_weighted_percentiles(values[order], w, QUANTILES))
    return out


# Student's t at 0.975 for 1..30 degrees of freedom; beyond, interpolated in 1/df towards the normal's
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
_Z975 = 1.959964


def t975(df: float) -> float:
    """Student's t quantile at 0.975 for `df` ≥ 1 degrees of freedom (fractional: linear in 1/df between the table's
    entries)."""
    if df >= len(_T975):
        return _Z975 + (_T975[-1] - _Z975) * len(_T975) / df
    lo = max(1, int(np.floor(df)))
    if lo == df or lo == len(_T975):
        return _T975[lo - 1]
    hi, w = lo + 1, (1 / df - 1 / (lo + 1)) / (1 / lo - 1 / (lo + 1))
    return w * _T975[lo - 1] + (1 - w) * _T975[hi - 1]


def widening(runs: list[RunSample], rng: np.random.Generator, draws: int = 300) -> dict[str, float]:
    """Per measure, the factor m the draws of R ≥ 2 runs are widened by (module doc)."""
    per_run = [_draws([r], draws, rng) for r in runs]
    points = [point([r]) for r in runs]
    out = {}
    for name in (*QUANTILES, "output_tokens_per_s"):
        values = np.array([p[name] if p[name] is not None else np.nan for p in points], dtype=float)
        if not np.all(values > 0):
            out[name] = 1.0
            continue
        logs = np.log(values)
        within = np.mean([np.var(np.log(d[name][d[name] > 0])) if np.any(d[name] > 0) else 0.0 for d in per_run])
        total = np.var(logs, ddof=1)
        share = 0.0 if total <= 0 else max(0.0, total - within) / total
        if share == 0.0:
            out[name] = 1.0
            continue
        r = len(runs)
        out[name] = float(t975((r - 1) / share ** 2) / _Z975 * np.sqrt(1 + share / (r - 1)))
    return out


def _widen(draws: np.ndarray, center: float | None, factor: float) -> np.ndarray:
    """`draws` spread `factor` times as far from `center` on a log scale (as they are without a positive center)."""
    if factor == 1.0 or center is None or not center > 0:
        return draws
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(draws > 0, center * np.exp(factor * (np.log(draws) - np.log(center))), draws)


def _weighted_percentiles(sorted_values: np.ndarray, weights: np.ndarray, quantiles: dict[str, float]) -> dict:
    """Per row of integer weights, np.percentile's linear interpolation over the values each repeated its weight's
    times (NaN for a row with no weight)."""
    cum = np.cumsum(weights, axis=1)
    total = cum[:, -1]
    out = {}
    for name, q in quantiles.items():
        h = np.maximum(total - 1, 0) * q
        below = np.floor(h)
        lo = (cum > below[:, None]).argmax(axis=1)  # the sorted value at expanded position `below`
        hi = (cum > np.minimum(below + 1, np.maximum(total - 1, 0))[:, None]).argmax(axis=1)
        got = sorted_values[lo] + (h - below) * (sorted_values[hi] - sorted_values[lo])
        out[name] = np.where(total > 0, got, np.nan)
    return out


def interval(draws: np.ndarray, level: float = LEVEL) -> list[float] | None:
    """The percentile interval of some replicates (NaNs dropped); None without any."""
    draws = draws[np.isfinite(draws)]
    if len(draws) == 0:
        return None
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(draws, [tail, 100 - tail])
    return [round(float(lo), 4), round(float(hi), 4)]


def cell_seed(*key) -> int:
    """A stable bootstrap seed for a cell named by `key` (shape, rate, configuration): the same file, the same
    intervals."""
    return int.from_bytes(hashlib.sha256(repr(key).encode()).digest()[:8], "little")


def cell_intervals(runs: list[RunSample], seed: int, draws: int = DEFAULT_DRAWS, level: float = LEVEL) -> dict:
    """A cell's `ci` entry: the method, the runs, the level and the interval of each measure."""
    rng = np.random.default_rng(seed)
    got = replicates(runs, draws, rng)
    return {"method": "hierarchical" if len(runs) > 1 else "within-run", "runs": len(runs), "level": level,
            "draws": draws, "ttft_s": {k: interval(got[k], level) for k in QUANTILES},
            "output_tokens_per_s": interval(got["output_tokens_per_s"], level)}
