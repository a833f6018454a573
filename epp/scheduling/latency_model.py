"""A latency model learned online from the pool's own responses: TTFT and TPOT as linear functions of what the EPP
knows about an endpoint when it picks (issue 23; llm-d's predicted-latency scheduling trains XGBoost in sidecars,
this is the in-process, bounded-CPU counterpart on kvgate's exact signals).

Features of endpoint e for a request, at pick time (`ttft_features`, `tpot_features`):

    TTFT:  1,  W(e) = (P(e) + U(e) + prompt - cached(e)) / R(e)   the prefill wait of the analytic model (seconds),
           decoding(e) / 100,  waiting(e) / 100,  kv(e),  (prompt - cached(e)) / 10^4
    TPOT:  1,  decoding(e) / 100,  kv(e)

(P the scraped prefill backlog, U/u what this EPP routed there since that scrape, R the estimated prefill rate,
decoding = running + u, waiting the scraped queue, kv the KV-cache use: see predicted_ttft_scorer.py.) Features are
scaled to comparable ranges so that one ridge strength suits them all.

`OnlineRidge` fits y ≈ w·x by exponentially weighted least squares with a ridge pull toward prior weights:

    A = Σ λ^age v x xᵀ,  b = Σ λ^age v x y,  w = (A + ρ v̄ I)⁻¹ (b + ρ v̄ w₀)

v a response's weight, v̄ the responses' mean weight (so ρ counts in average responses whatever the weights). TTFTs
weigh v = 1 / max(TTFT, 50 ms)²: the fit minimises the relative error, so the many short TTFTs of warm requests
count as much as the few long ones of queued or cold requests, which otherwise pull the bias and the slopes their
way.

With no data w = w₀: the TTFT prior is the analytic model (W + decoding × decodeMs), so a fresh EPP routes as
predicted-ttft-scorer does and learns from there. λ forgets (a changed pool is followed within ~1/(1-λ)
responses); ρ keeps directions the data never excites at the prior instead of letting them drift. An update is O(k²)
and a refit one k×k solve (k ≤ 6), done lazily before the next prediction: microseconds per response.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# Cycle key predicted-latency-scorer sets when a request states objectives and no endpoint is predicted to meet
# them: the director sheds such a request when it is sheddable (priority < 0), as llm-d's SLO scorer does.
OBJECTIVES_UNMEETABLE = "kvgate.latency-objectives-unmeetable"
TTFT_FEATURES = ("bias", "prefill_wait_s", "decoding_per_100", "waiting_per_100", "kv_usage", "uncached_per_10k")
TPOT_FEATURES = ("bias", "decoding_per_100", "kv_usage")
FORGET = 0.998  # λ: a response's weight halves after ~350 newer ones
RIDGE = 2.0  # ρ: the prior counts as ~2 responses in every direction
TTFT_WEIGHT_FLOOR_S = 0.05  # TTFTs weigh 1 / max(TTFT, floor)²: the fit minimises relative error above 50 ms


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

    def update(self, x: np.ndarray, y: float, weight: float = 1.0) -> None:
        self._a *= self.forget
        self._b *= self.forget
        self._a += weight * np.outer(x, x)
        self._b += (weight * y) * x
        self._weight_sum = self._weight_sum * self.forget + weight
        self._decayed_count = self._decayed_count * self.forget + 1.0
        self._dirty = True
        self.count += 1

    @property
    def weights(self) -> np.ndarray:
        if self._dirty:
            k = self.prior.size
            ridge = self.ridge * (self._weight_sum / self._decayed_count if self._decayed_count else 1.0)
            self._w = np.linalg.solve(self._a + ridge * np.eye(k), self._b + ridge * self.prior)
            self._dirty = False
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


class LatencyModel:
    """The pool's TTFT and TPOT models and how well they predicted what was then measured."""

    def __init__(self, decode_s_per_running_request: float) -> None:
        # Prior: TTFT = the analytic prefill wait + each decoding request's share of a step.
        self.ttft = OnlineRidge(np.array([0.0, 1.0, decode_s_per_running_request * 100, 0.0, 0.0, 0.0]))
        # TPOT prior: unknown (0) until measured; it matters only to requests with a TPOT objective.
        self.tpot = OnlineRidge(np.zeros(len(TPOT_FEATURES)))
        self.ttft_errors = ErrorStats()
        self.tpot_errors = ErrorStats()

    def observe(self, ttft_x: np.ndarray, ttft_predicted: float, ttft_s: float | None,
                tpot_x: np.ndarray, tpot_predicted: float, tpot_s: float | None) -> None:
        """What a finished request measured (None: not measured), with the features and predictions of its pick."""
        if ttft_s is not None and math.isfinite(ttft_s) and ttft_s >= 0:
            self.ttft_errors.add(ttft_predicted, ttft_s)
            self.ttft.update(ttft_x, ttft_s, 1.0 / max(ttft_s, TTFT_WEIGHT_FLOOR_S) ** 2)
        if tpot_s is not None and math.isfinite(tpot_s) and tpot_s >= 0:
            self.tpot_errors.add(tpot_predicted, tpot_s)
            self.tpot.update(tpot_x, tpot_s)


def ttft_features(prefill_wait_s: np.ndarray, decoding: np.ndarray, waiting: np.ndarray, kv_usage: np.ndarray,
                  uncached: np.ndarray) -> np.ndarray:
    """[n, len(TTFT_FEATURES)] for n endpoints."""
    return np.column_stack([np.ones_like(prefill_wait_s), prefill_wait_s, decoding / 100.0, waiting / 100.0,
                            kv_usage, uncached / 1e4])


def tpot_features(decoding: np.ndarray, kv_usage: np.ndarray) -> np.ndarray:
    """[n, len(TPOT_FEATURES)] for n endpoints."""
    return np.column_stack([np.ones_like(decoding), decoding / 100.0, kv_usage])
