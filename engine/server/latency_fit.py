"""The engine's own latency model: TTFT and TPOT fitted online from the requests this server serves, for routers to
read off the /metrics page (features, names and why: common/engine_latency_protocol.py).

Each request's features are the engine's gauges at its arrival (`Arrival`, taken when the server admits it: the
prefill backlog after the running step's phase, running and waiting requests; KV use for TPOT) and its uncached
prompt tokens, known from its first output. Its TTFT (admission to first token) is fitted then, its TPOT ((last token -
first token) / (tokens after the first)) when it ends. Only requests of one prompt and one sample are fitted: their
first token is theirs alone. The fit is common/online_ridge.py's, TTFTs weighed for relative error, with a prior of
zero weights (a router ignores the model until it has fitted MIN_OBSERVATIONS TTFTs). Cost: an O(k²) update per
request (k ≤ 5) and one k×k solve per scrape that follows new requests.

How well the model predicts: once it has fitted MIN_OBSERVATIONS TTFTs (a router uses it from then on), each new
TTFT is first predicted from the request's features at arrival, and the relative errors of the last 1000 are
published as quantiles (kvgate:ttft_model_relative_error{quantile}). That is the model's error on the engine's exact
gauges; a router evaluating it on a scrape up to 50 ms old adds its own.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvgate.common.engine_latency_protocol import (MIN_OBSERVATIONS, TPOT_FEATURES, TTFT_FEATURES, tpot_features,
                                            ttft_features)
from kvgate.common.online_ridge import ErrorStats, OnlineRidge, ttft_weight


# The ridge's pull toward the zero prior, in average observations: only there to keep the solve well posed (a
# direction the requests never excite, such as a backlog that is always 0, stays at 0; features that move together
# share their weight). With TTFTs weighed for relative error the short TTFTs weigh most and the long ones, which
# excite the slopes, least, so a pull of the EPP's size (ρ = 2, toward its analytic prior) drags the slopes to 0 and
# the bias up; a pull this small lets the slopes reach the engine's true costs (tests/epp/test_engine_latency_model.py
# and tests/server/test_engine_latency_model.py fit known engines and check them).
RIDGE = 1e-4


@dataclass(frozen=True)
class Arrival:
    """The engine's gauges when a request arrived, and when."""

    at: float  # time.monotonic()
    backlog: int
    running: int
    waiting: int
    kv_usage: float


class EngineLatencyFit:
    """`gauges()` -> (backlog after the step's phase, running, waiting, KV use): the values this server's /metrics
    page would show now."""

    def __init__(self, gauges: Callable[[], tuple[int, int, int, float]]) -> None:
        self.gauges = gauges
        self.ttft = OnlineRidge(np.zeros(len(TTFT_FEATURES)), ridge=RIDGE)
        self.tpot = OnlineRidge(np.zeros(len(TPOT_FEATURES)), ridge=RIDGE)
        self.ttft_errors = ErrorStats()
        self._quantiles: tuple[int, dict[float, float]] = (0, {})  # (errors count, quantiles) as last computed

    def arrival(self) -> Arrival:
        backlog, running, waiting, kv = self.gauges()
        return Arrival(time.monotonic(), backlog, running, waiting, kv)

    def first_token(self, arrival: Arrival, uncached: int, at: float) -> None:
        ttft = at - arrival.at
        if not (math.isfinite(ttft) and ttft >= 0):
            return
        x = ttft_features(arrival.backlog, max(uncached, 0), arrival.running, arrival.waiting)[0]
        if self.ttft.count >= MIN_OBSERVATIONS:
            self.ttft_errors.add(float(self.ttft.predict(x[None, :])[0]), ttft)
        self.ttft.update(x, ttft, ttft_weight(ttft))

    def finished(self, arrival: Arrival, first_at: float, last_at: float, tokens_after_first: int) -> None:
        if tokens_after_first <= 0:
            return
        tpot = (last_at - first_at) / tokens_after_first
        if math.isfinite(tpot) and tpot >= 0:
            self.tpot.update(tpot_features(arrival.running, arrival.kv_usage)[0], tpot)

    def relative_errors(self) -> dict[float, float]:
        """p50 and p90 of the TTFT model's relative error over its last 1000 predictions (empty before any),
        recomputed only when new ones came."""
        count, quantiles = self._quantiles
        if count != self.ttft_errors.count:
            self._quantiles = (self.ttft_errors.count, self.ttft_errors.recent_relative_errors())
        return self._quantiles[1]

    def published(self) -> tuple[list[tuple[str, float]], list[tuple[str, float]], int, int]:
        """(TTFT weights by feature, TPOT weights by feature, TTFTs fitted, TPOTs fitted) for the page."""
        return (list(zip(TTFT_FEATURES, map(float, self.ttft.weights))),
                list(zip(TPOT_FEATURES, map(float, self.tpot.weights))), self.ttft.count, self.tpot.count)
