"""Exponentially weighted ridge regression, updated one observation at a time: the latency models' fit, in the EPP
(epp/scheduling/latency_model.py, from the responses it streams) and in each kvgate engine (engine/server/
latency_fit.py, from the requests it serves).

`OnlineRidge` fits y ≈ w·x by exponentially weighted least squares with a ridge pull toward prior weights:

    A = Σ λ^age v x xᵀ,  b = Σ λ^age v x y,  w = (A + ρ v̄ I)⁻¹ (b + ρ v̄ w₀)

v an observation's weight, v̄ the observations' mean weight (so ρ counts in average observations whatever the
weights). λ forgets (a changed pool is followed within ~1/(1-λ) observations); ρ keeps directions the data never
excites at the prior instead of letting them drift. An update is O(k²) and a refit one k×k solve (k ≤ 6), done
lazily before the next prediction: microseconds per observation. `ErrorStats` keeps how well a model predicted what
was then measured.

TTFTs weigh v = `ttft_weight(TTFT)` = 1 / max(TTFT, 50 ms)²: the fit minimises the relative error, so the many short
TTFTs of warm requests count as much as the few long ones of queued or cold requests, which otherwise pull the bias
and the slopes their way (docs/benchmarks.md, "The learned model fitted on relative error").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

FORGET = 0.998  # λ: an observation's weight halves after ~350 newer ones
RIDGE = 2.0  # ρ: the prior counts as ~2 observations in every direction
TTFT_WEIGHT_FLOOR_S = 0.05  # TTFTs weigh 1 / max(TTFT, floor)²: the fit minimises relative error above 50 ms


def ttft_weight(ttft_s: float) -> float:
    """An observed TTFT's weight in the fit (relative error above TTFT_WEIGHT_FLOOR_S)."""
    return 1.0 / max(ttft_s, TTFT_WEIGHT_FLOOR_S) ** 2


class OnlineRidge:
    def __init__(self, prior: np.ndarray, forget: float = FORGET, ridge: float = RIDGE) -> None:
        self.prior = np.asarray(prior, dtype=float)
        k = self.prior.size
        self.forget, self.ridge = forget, ridge
        self._a = np.zeros((k, k))
        self._b = np.zeros(k)
        self._weight_sum = 0.0  # Σ λ^age v and Σ λ^age: their ratio is v̄
        self._decayed_count = 0.0
        self._w = self.prior.copy()
        self._dirty = False
        self.count = 0
        self.skipped = 0  # observations refused, or that overflowed the sums

    def _start_over(self) -> None:
        k = self.prior.size
        self._a, self._b = np.zeros((k, k)), np.zeros(k)
        self._weight_sum = self._decayed_count = 0.0
        self._w, self._dirty = self.prior.copy(), False

    def update(self, x: np.ndarray, y: float, weight: float = 1.0) -> None:
        """One observation; one that is not finite (or of a negative weight) is skipped, and sums that would stop
        being finite start over from the prior, so any state recovers with the next good observations."""
        if not (math.isfinite(y) and math.isfinite(weight) and weight >= 0 and np.isfinite(x).all()):
            self.skipped += 1
            return
        with np.errstate(over="ignore", invalid="ignore"):  # checked below
            self._a *= self.forget
            self._b *= self.forget
            self._a += weight * np.outer(x, x)
            self._b += (weight * y) * x
        self._weight_sum = self._weight_sum * self.forget + weight
        self._decayed_count = self._decayed_count * self.forget + 1.0
        self._dirty = True
        self.count += 1
        if not (np.isfinite(self._a).all() and np.isfinite(self._b).all()):
            self.skipped += 1
            self._start_over()

    @property
    def weights(self) -> np.ndarray:
        if self._dirty:
            k = self.prior.size
            ridge = self.ridge * (self._weight_sum / self._decayed_count if self._decayed_count else 1.0)
            try:
                w = np.linalg.solve(self._a + ridge * np.eye(k), self._b + ridge * self.prior)
            except np.linalg.LinAlgError:
                w = None
            self._dirty = False
            if w is None or not np.isfinite(w).all():
                self._start_over()
            else:
                self._w = w
        return self._w

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Rows of features -> predictions (never below 0: a latency)."""
        return np.maximum(features @ self.weights, 0.0)


@dataclass
class ErrorStats:
    """Running sums of |predicted - measured| and of the measured values, and counts, for metrics and tests."""

    count: int = 0
    abs_error: float = 0.0
    measured: float = 0.0
    recent: list[tuple[float, float]] = field(default_factory=list)  # (predicted, measured), the last RECENT
    RECENT = 1000

    def add(self, predicted: float, measured: float) -> None:
        self.count += 1
        self.abs_error += abs(predicted - measured)
        self.measured += measured
        self.recent.append((predicted, measured))
        if len(self.recent) > 2 * self.RECENT:
            del self.recent[: len(self.recent) - self.RECENT]

    def recent_relative_errors(self, quantiles=(0.5, 0.9)) -> dict[float, float]:
        """Quantiles of |predicted - measured| / measured over the last RECENT samples (empty before any)."""
        pairs = [(p, m) for p, m in self.recent[-self.RECENT:] if m > 0]
        if not pairs:
            return {}
        errors = np.abs(np.array([p for p, _ in pairs]) / np.array([m for _, m in pairs]) - 1.0)
        return {q: float(np.quantile(errors, q)) for q in quantiles}
