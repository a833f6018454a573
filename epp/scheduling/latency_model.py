"""A latency model learned online from the pool's own responses: TTFT and TPOT as linear functions of what the EPP
knows about an endpoint when it picks (llm-d's predicted-latency scheduling trains XGBoost in sidecars,
this is the in-process, bounded-CPU counterpart on kvgate's exact signals).

Features of endpoint e for a request, at pick time (`ttft_features`, `tpot_features`):

    TTFT:  1,  W(e) = (P(e) + U(e) + prompt - cached(e)) / R(e)   the prefill wait of the analytic model (seconds),
           decoding(e) / 100,  waiting(e) / 100,  kv(e),  (prompt - cached(e)) / 10^4
    TPOT:  1,  decoding(e) / 100,  kv(e)

(P the scraped prefill backlog, U/u what this EPP routed there since that scrape, R the estimated prefill rate,
decoding = running + u, waiting the scraped queue, kv the KV-cache use: see predicted_ttft_scorer.py.) Features are
scaled to comparable ranges so that one ridge strength suits them all.

The fit is common/online_ridge.py's `OnlineRidge` (exponentially weighted ridge regression, TTFTs weighed for
relative error). With no data w = w₀: the TTFT prior is the analytic model (W + decoding × decodeMs), so a fresh EPP
routes as predicted-ttft-scorer does and learns from there.
"""

from __future__ import annotations

import math
import numpy as np

from kvgate.common.online_ridge import ErrorStats, OnlineRidge, ttft_weight

TTFT_FEATURES = ("bias", "prefill_wait_s", "decoding_per_100", "waiting_per_100", "kv_usage", "uncached_per_10k")
TPOT_FEATURES = ("bias", "decoding_per_100", "kv_usage")


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
            self.ttft.update(ttft_x, ttft_s, ttft_weight(ttft_s))
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
