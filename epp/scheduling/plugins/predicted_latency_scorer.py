"""predicted-latency-scorer (kvgate's own; llm-d's predicted-latency `slo-scorer` is the anchor): prefer the endpoint
with the lowest TTFT as predicted by a model learned online — from the pool's own responses, or each engine's own
(learnFrom, below) — within the request's latency objectives when it states them.

Prediction (scheduling/latency_model.py): TTFT(e) and TPOT(e) are linear in the endpoint's features at pick time —
the analytic prefill wait of predicted-ttft-scorer, decoding and waiting requests, KV use, the request's uncached
tokens there — with weights fitted by exponentially weighted ridge regression on every streamed response: its TTFT
(pick to the first token the EPP sees in the response body) and TPOT ((end - first token) / (completion tokens -
1), from the response's usage). Until responses arrive the TTFT model is the analytic one (the prior).

Objectives (llm-d's headers): `x-slo-ttft-ms` and `x-slo-tpot-ms` (positive numbers, milliseconds; a header that is
not one is ignored and counted). Endpoints predicted to meet every stated objective score in [0.5, 1] by predicted
TTFT; the others in [0, 0.5) by how far they miss (the sum of the relative misses), so a request goes where its
objectives are met if anywhere, else where it misses them least — unless it is sheddable (priority < 0, from its
InferenceObjective): then the director answers 429 (llm-d's rule). Without objectives: by predicted TTFT alone.

With objectivesFilter true it is also a preference filter, where it stands in the profile: a request that states
objectives keeps the candidates predicted to meet them all, when some are and some are not (none or all: every
candidate); the dropped candidates stay fallbacks, and the scores then order the kept ones. Why: as one scorer among
several, weighed below the cache scorers, the score's [0.5, 1] band is outvoted, and a request with an objective
still queues behind the replica holding its prefix; llm-d's SLO-aware routing picks among the pods with headroom.
Why off by default: in kvgate's profile it meets no more objectives than the profile without it, which ignores
them, and on bursty traffic fewer (`kvgate bench routing --workloads 'S:ttft_objective_ms=600,objective_share=0.25'
--configs kvgate,kvgate-learned --rates 20` for S = hot-tenant and bursty-tenants; docs/benchmarks.md). The
predictions are right for the request it moves, and the move is wrong for the others: the request goes cold on a
replica whose tenants' prefixes it then evicts, which lowers the hit rate and raises everyone's TTFT.

Where the model comes from (learnFrom):
- `responses` (default, any engine; llm-d's way): the EPP fits one model for the pool from the responses it sees, so
  the gateway must stream every response body through the EPP (FULL_DUPLEX_STREAMED), about twice the gateway tier's
  CPU per request of kvgate's profile (docs/benchmarks.md).
- `engines` (kvgate engines): each engine fits its own model from the requests it serves, on its exact gauges at
  each request's arrival and its exact timings, and publishes the weights on its /metrics page
  (common/engine_latency_protocol.py); the EPP evaluates them on the scraped gauges plus what it routed since, and
  needs no response body. An endpoint that does not publish a model (another engine, or one that has fitted fewer
  than MIN_OBSERVATIONS requests) is predicted by the prior, the analytic model; the EPP logs, per endpoint, which
  one it predicts from whenever that changes. The EPP measures no prediction error of its own then (no response
  reaches it), and counts no objectives met — unless measureError is true: then the responses stream through the
  EPP again (the CPU that learnFrom engines saves), only to measure how far its predictions from the engines'
  models were from each response's TTFT and TPOT, and how many objectives were met (a diagnostic: `kvgate bench
  routing --configs kvgate-engines-measured`).

Parameters: defaultPrefillTokensPerSecond, decodeMsPerRunningRequest, prefixScorer (as predicted-ttft-scorer's, for
the prior and the features), learn (default true; false keeps the prior: the analytic model, for comparison),
objectivesFilter (default false), learnFrom (responses | engines, default responses), measureError (default false;
with learnFrom engines, see above).
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict

import numpy as np

from kvgate.common import engine_latency_protocol as published
from kvgate.common.epp_protocol import TPOT_OBJECTIVE_HEADER, TTFT_OBJECTIVE_HEADER
from kvgate.epp.scheduling import live_load
from kvgate.epp.scheduling.data import (OBJECTIVES_UNMEETABLE, PICKED_UNCACHED_TOKENS, PREDICTED_TTFT, Deferred,
                                        PerEndpoint)
from kvgate.epp.scheduling.framework import CycleState, Filter
from kvgate.epp.scheduling.latency_model import LatencyModel, tpot_features, ttft_features
from kvgate.epp.scheduling.plugins._normalize import attribute_values, lower_is_better, per_snapshot
from kvgate.epp.scheduling.plugins._params import bool_param, check_keys, choice_param
from kvgate.epp.scheduling.plugins.predicted_ttft_scorer import (ANALYTIC_PARAMETERS,
                                                                 DEFAULT_DECODE_MS_PER_RUNNING_REQUEST,
                                                                 DEFAULT_PREFILL_TOKENS_PER_SECOND,
                                                                 PredictedTTFTScorer, analytic_params)
from kvgate.epp.scheduling.prefix_match import PREFIX_MATCH
from kvgate.epp.types import EndpointState, LLMRequest

log = logging.getLogger(__name__)

LEARN_FROM = ("responses", "engines")
MAX_TRACKED = 65536  # requests picked and not yet finished whose features are kept (a bound, not a working size)
MAX_OBJECTIVE_MS = 3_600_000.0


def objective_ms(headers, name: str) -> float | None | str:
    """A header's objective in ms; None when absent; "bad" when present but not a positive finite number."""
    value = headers.get(name)
    if value is None:
        return None
    try:
        ms = float(value)
    except (TypeError, ValueError):
        return "bad"
    return ms if math.isfinite(ms) and 0 < ms <= MAX_OBJECTIVE_MS else "bad"


class _Pick:
    __slots__ = ("ttft_x", "ttft", "tpot_x", "tpot", "picked_at", "objectives_met")

    def __init__(self, ttft_x, ttft, tpot_x, tpot, picked_at, objectives_met):
        self.ttft_x, self.ttft, self.tpot_x, self.tpot = ttft_x, ttft, tpot_x, tpot
        self.picked_at, self.objectives_met = picked_at, objectives_met


class PredictedLatencyScorer(PredictedTTFTScorer, Filter):
    """predicted-ttft-scorer's terms (and parameters) as the model's features, its formula as the model's prior."""

    type_name = "predicted-latency-scorer"
    preference = True  # the objectives filter's (objectivesFilter): the candidates it drops stay fallbacks
    stats_group = "latency_model"
    reads_response_body = True  # it learns from each response's first-token time and token count
    consumes_optional = (PREFIX_MATCH,)  # prompt and cached tokens, as predicted-ttft-scorer reads them
    # what its pick adds to the endpoint's prefill backlog; that no endpoint is predicted to meet the request's
    # objectives (the director sheds a sheddable one); each candidate's predicted TTFT, for a filter that weighs it
    produces = (PICKED_UNCACHED_TOKENS, OBJECTIVES_UNMEETABLE, PREDICTED_TTFT)

    def __init__(self, default_prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_SECOND,
                 decode_ms_per_running_request: float = DEFAULT_DECODE_MS_PER_RUNNING_REQUEST,
                 prefix_source_name: str = "", learn: bool = True, objectives_filter: bool = False,
                 learn_from: str = "responses", measure_error: bool = False) -> None:
        super().__init__(default_prefill_tokens_per_s, decode_ms_per_running_request, prefix_source_name)
        self.learn = learn
        self.objectives_filter = objectives_filter
        self.from_engines = learn_from == "engines"
        self.tracks_responses = not self.from_engines or measure_error
        if not self.tracks_responses:
            self.reads_response_body = False  # the engines time their own requests
        self.model = LatencyModel(self.decode_s)
        self._queue_key = (self, "queue")
        self._published_key = (self, "published")
        self._said: dict[str, bool] = {}  # endpoint address -> predicted from its own published model (as last logged)
        self._cycle_key = (self, "predictions")
        self._picks: OrderedDict[str, _Pick] = OrderedDict()
        self.counts = {"objectives": 0, "objectives_bad": 0, "objectives_unmeetable": 0, "objectives_met": 0,
                       "objectives_missed": 0, "untracked": 0,
                       "engine_model_predictions": 0}

    @staticmethod
    def _queue(endpoints: list[EndpointState]) -> tuple[np.ndarray, np.ndarray]:
        """(waiting, KV use) columns of the scraped metrics: once per snapshot."""
        return attribute_values(endpoints, "metrics.waiting_queue_size"), attribute_values(
            endpoints, "metrics.kv_cache_usage")

    def predict(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None):
        """(TTFT features, predicted TTFT s, TPOT features, predicted TPOT s) per endpoint."""
        wait, decoding, uncached = self.terms(request, endpoints, cycle)
        waiting, kv = per_snapshot(self._queue_key, cycle, endpoints, self._queue)
        tx = ttft_features(wait, decoding, waiting, kv, uncached)
        px = tpot_features(decoding, kv)
        ttft, tpot = self.model.ttft.predict(tx), self.model.tpot.predict(px)
        if self.from_engines:
            self._predict_published(endpoints, cycle, uncached, decoding, waiting, kv, ttft, tpot)
        return tx, ttft, px, tpot

    def produce(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState) -> None:
        """Each candidate's predicted TTFT (PREDICTED_TTFT), computed only for the cycles that read it (Deferred):
        the affinity filter's second home weighs a busy home against a cold start elsewhere on it."""
        cycle.put(self, PREDICTED_TTFT,
                  Deferred(lambda: PerEndpoint(endpoints, self.predict(request, endpoints, cycle)[1], float("inf"))))

    def _published(self, endpoints: list[EndpointState]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per endpoint, once per snapshot: whether it publishes a model fitted enough to use, and its TTFT and TPOT
        weights."""
        n = len(endpoints)
        has = np.zeros(n, dtype=bool)
        ttft_w = np.zeros((n, len(published.TTFT_FEATURES)))
        tpot_w = np.zeros((n, len(published.TPOT_FEATURES)))
        for i, e in enumerate(endpoints):
            m = e.metrics
            if (m.ttft_model_weights is not None and m.tpot_model_weights is not None
                    and (m.ttft_model_observations or 0) >= published.MIN_OBSERVATIONS):
                has[i] = True
                ttft_w[i], tpot_w[i] = m.ttft_model_weights, m.tpot_model_weights
            if self._said.get(e.address) != has[i]:
                self._said[e.address] = bool(has[i])
                log.info("predicted-latency-scorer: %s %s", e.address, "publishes its latency model: predicting "
                         "from it" if has[i] else "publishes no latency model fitted enough to use: predicting "
                         "from the analytic model")
        return has, ttft_w, tpot_w

    def _predict_published(self, endpoints: list[EndpointState], cycle: CycleState | None, uncached: np.ndarray,
                           decoding: np.ndarray, waiting: np.ndarray, kv: np.ndarray, ttft: np.ndarray,
                           tpot: np.ndarray) -> None:
        """Overwrite, in place, the predictions of the endpoints that publish their own model with theirs: the
        scraped gauges plus what this EPP routed there since the scrape (`decoding` = running + those requests),
        the request's uncached tokens there."""
        has, ttft_w, tpot_w = per_snapshot(self._published_key, cycle, endpoints, self._published)
        if not has.any():
            return
        backlog, _, running = per_snapshot(self._scraped_key, cycle, endpoints, self._scraped)
        unseen_prompt = live_load.live_column(cycle, endpoints, "unseen_prompt")
        unseen = decoding - running
        tx = published.ttft_features(backlog + unseen_prompt, uncached, running, waiting + unseen)
        px = published.tpot_features(decoding, kv)
        ttft[has] = np.maximum((tx * ttft_w).sum(axis=1), 0.0)[has]
        tpot[has] = np.maximum((px * tpot_w).sum(axis=1), 0.0)[has]
        self.counts["engine_model_predictions"] += 1

    @staticmethod
    def _objectives(request: LLMRequest) -> tuple[float | None, float | None, bool]:
        """The request's (TTFT, TPOT) objectives in ms, None where not stated or not a positive number, and whether
        a header was present but bad."""
        ttft_obj = objective_ms(request.headers, TTFT_OBJECTIVE_HEADER)
        tpot_obj = objective_ms(request.headers, TPOT_OBJECTIVE_HEADER)
        bad = "bad" in (ttft_obj, tpot_obj)
        return (None if ttft_obj == "bad" else ttft_obj), (None if tpot_obj == "bad" else tpot_obj), bad

    @staticmethod
    def _miss(ttft: np.ndarray, tpot: np.ndarray, ttft_obj: float | None, tpot_obj: float | None) -> np.ndarray:
        """Per endpoint, the sum of the relative misses of the stated objectives (0: every one met)."""
        miss = np.zeros_like(ttft)
        if ttft_obj is not None:
            miss += np.maximum(ttft / (ttft_obj / 1000.0) - 1.0, 0.0)
        if tpot_obj is not None:
            miss += np.maximum(tpot / (tpot_obj / 1000.0) - 1.0, 0.0)
        return miss

    def filter(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
               ) -> list[EndpointState]:
        """The objectives filter: the candidates predicted to meet the request's stated objectives."""
        if not self.objectives_filter or len(endpoints) <= 1:
            return endpoints
        ttft_obj, tpot_obj, _ = self._objectives(request)
        if ttft_obj is None and tpot_obj is None:
            return endpoints
        _, ttft, _, tpot = self.predict(request, endpoints, cycle)
        met = self._miss(ttft, tpot, ttft_obj, tpot_obj) == 0.0
        if met.all() or not met.any():
            return endpoints
        return [e for e, ok in zip(endpoints, met) if ok]

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> np.ndarray:
        tx, ttft, px, tpot = self.predict(request, endpoints, cycle)
        met = None
        ttft_obj, tpot_obj, bad = self._objectives(request)
        if bad:
            self.counts["objectives_bad"] += 1
        if ttft_obj is None and tpot_obj is None:
            scores = lower_is_better(ttft)
        else:
            self.counts["objectives"] += 1
            miss = self._miss(ttft, tpot, ttft_obj, tpot_obj)
            met = miss == 0.0
            scores = np.empty_like(ttft)
            if met.any():
                scores[met] = 0.5 + 0.5 * lower_is_better(ttft[met])
            else:
                self.counts["objectives_unmeetable"] += 1
                if cycle is not None:
                    cycle.put(self, OBJECTIVES_UNMEETABLE, True)
            if (~met).any():
                scores[~met] = 0.499 * lower_is_better(miss[~met])
        if cycle is not None:
            cycle[self._cycle_key] = (endpoints, tx, ttft, px, tpot, met)
        return scores

    def pre_request(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None) -> None:
        super().pre_request(request, endpoint, cycle)
        if not self.tracks_responses:  # no response reaches this EPP to learn from or measure by
            return
        saved = cycle.get(self._cycle_key) if cycle is not None else None
        if saved is None:
            return
        endpoints, tx, ttft, px, tpot, met = saved
        i = next((i for i, e in enumerate(endpoints) if e is endpoint), None)
        if i is None:
            return
        picks = self._picks
        picks[request.request_id] = _Pick(tx[i], float(ttft[i]), px[i], float(tpot[i]), time.monotonic(),
                                          None if met is None else bool(met[i]))
        if len(picks) > MAX_TRACKED:  # responses that never reported (should not happen: extproc always releases)
            picks.popitem(last=False)
            self.counts["untracked"] += 1

    def response_complete(self, request: LLMRequest, endpoint_address: str, prompt_tokens: int,
                          completion_tokens: int) -> None:
        pick = self._picks.pop(request.request_id, None)
        if pick is None:
            return
        first = request.first_token_at
        ttft = first - pick.picked_at if first is not None else None
        tpot = None
        if first is not None and completion_tokens >= 2:
            tpot = (time.monotonic() - first) / (completion_tokens - 1)
        if pick.objectives_met is not None and ttft is not None:
            met = self._objectives_met(request, ttft, tpot)
            self.counts["objectives_met" if met else "objectives_missed"] += 1
        if self.learn and not self.from_engines:
            self.model.observe(pick.ttft_x, pick.ttft, ttft, pick.tpot_x, pick.tpot, tpot)
        else:  # the errors are still measured, so that a fixed model (or the engines') can be compared
            self.model.ttft_errors.add(pick.ttft, ttft) if ttft is not None else None
            self.model.tpot_errors.add(pick.tpot, tpot) if tpot is not None else None

    @classmethod
    def _objectives_met(cls, request: LLMRequest, ttft: float, tpot: float | None) -> bool:
        ttft_obj, tpot_obj, _ = cls._objectives(request)
        ok = ttft_obj is None or ttft * 1000.0 <= ttft_obj
        return ok and (tpot_obj is None or tpot is None or tpot * 1000.0 <= tpot_obj)

    def stats(self) -> dict[str, float]:
        t, p = self.model.ttft_errors, self.model.tpot_errors
        return {"ttft_observations": t.count, "ttft_abs_error_seconds": t.abs_error, "ttft_measured_seconds":
                t.measured, "tpot_observations": p.count,
                "tpot_abs_error_seconds": p.abs_error, "tpot_measured_seconds": p.measured,
                "tracked_requests": len(self._picks), **self.counts,
                **{f"{kind}_relative_error_p{round(100 * q)}": v for kind, errors in (("ttft", t), ("tpot", p))
                   for q, v in errors.recent_relative_errors().items()}}


def factory(parameters: dict | None) -> PredictedLatencyScorer:
    t = PredictedLatencyScorer.type_name
    params = check_keys(parameters, ANALYTIC_PARAMETERS | {"learn", "objectivesFilter", "learnFrom", "measureError"},
                        t)
    return PredictedLatencyScorer(**analytic_params(params, t), learn=bool_param(params, "learn", True, t),
                                  objectives_filter=bool_param(params, "objectivesFilter", False, t),
                                  learn_from=choice_param(params, "learnFrom", "responses", LEARN_FROM, t),
                                  measure_error=bool_param(params, "measureError", False, t))
