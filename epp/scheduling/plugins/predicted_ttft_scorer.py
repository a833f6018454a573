"""predicted-ttft-scorer (kvgate's own): prefer the endpoint that would give this request its first token soonest.

    T(e) = (P(e) + U(e) + prompt - cached(e)) / R(e)  +  (running(e) + u(e)) × d

    P(e)       prompt tokens the engine still has to prefill, as last scraped (kvgate:num_prefill_tokens_pending;
               0 for engines that do not export it), less what its running step had computed of them by then
               (EndpointMetrics.prefill_backlog)
    U(e), u(e) uncached prompt tokens / requests this EPP routed to e after that scrape, still in flight (exact:
               scheduling/live_load.py)
    prompt, cached(e)   this request's prompt tokens and those e holds, from the profile's prefix scorer
               (the cycle's PREFIX_MATCH; without one nothing is cached)
    R(e)       e's prefill rate in tokens/s, estimated online by the datalayer (datalayer/prefill_rate.py), else
               defaultPrefillTokensPerSecond
    d          decodeMsPerRunningRequest: what each running (decoding) request adds to the wait

    score(e) = (max_T - T(e)) / (max_T - min_T)      lower is better; all equal → every score is 1.0

Parameters: defaultPrefillTokensPerSecond > 0 = 25000 (kvgate's sim profile of Llama-3.1-8B on an H100:
0.035 ms per prompt token + a 6 ms step per 2048-token chunk ≈ 26k tokens/s), decodeMsPerRunningRequest ≥ 0 =
0.05 (the same profile's per-sequence decode cost in a step), prefixScorer = the profile's only prefix scorer.
"""

from __future__ import annotations

import numpy as np

from kvgate.epp.scheduling import live_load
from kvgate.epp.scheduling.data import PICKED_UNCACHED_TOKENS
from kvgate.epp.scheduling.framework import CycleState, Scorer
from kvgate.epp.scheduling.plugins._normalize import lower_is_better, per_snapshot
from kvgate.epp.scheduling.plugins._params import check_keys, float_param, str_param
from kvgate.epp.scheduling.plugins._prefix_source import prefix_tokens, record_picked_uncached
from kvgate.epp.scheduling.prefix_match import PREFIX_MATCH
from kvgate.epp.types import EndpointState, LLMRequest

DEFAULT_PREFILL_TOKENS_PER_SECOND = 25000.0
DEFAULT_DECODE_MS_PER_RUNNING_REQUEST = 0.05


class PredictedTTFTScorer(Scorer):
    type_name = "predicted-ttft-scorer"
    consumes_optional = (PREFIX_MATCH,)  # prompt and cached tokens (without: the prompt's estimate, nothing cached)
    produces = (PICKED_UNCACHED_TOKENS,)  # what its pick adds to the endpoint's prefill backlog (the director reads it)

    def __init__(self, default_prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_SECOND,
                 decode_ms_per_running_request: float = DEFAULT_DECODE_MS_PER_RUNNING_REQUEST,
                 prefix_source_name: str = "") -> None:
        super().__init__()
        self.default_rate = default_prefill_tokens_per_s
        self.decode_s = decode_ms_per_running_request / 1000.0
        if prefix_source_name:
            self.sources[PREFIX_MATCH] = prefix_source_name
        self._scraped_key = (self, "scraped")

    def _scraped(self, endpoints: list[EndpointState]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(P, R, running) columns of the scraped metrics: once per snapshot."""
        n = len(endpoints)
        pending = np.fromiter((e.metrics.prefill_backlog or 0 for e in endpoints), dtype=float, count=n)
        rate = np.fromiter((e.metrics.prefill_tokens_per_s or self.default_rate for e in endpoints), dtype=float,
                           count=n)
        running = np.fromiter((e.metrics.running_requests for e in endpoints), dtype=float, count=n)
        return pending, rate, running

    def terms(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per endpoint: (the prefill wait (P + U + prompt - cached) / R in seconds, running + u, prompt - cached)."""
        pending, rate, running = per_snapshot(self._scraped_key, cycle, endpoints, self._scraped)
        prompt, cached = prefix_tokens(self, request, endpoints, cycle)
        uncached = prompt - cached
        wait = (pending + live_load.live_column(cycle, endpoints, "unseen_prompt") + uncached) / rate
        decoding = running + live_load.live_column(cycle, endpoints, "unseen_requests")
        return wait, decoding, uncached

    def predict(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
                ) -> np.ndarray:
        """T(e) in seconds for each endpoint."""
        wait, decoding, _ = self.terms(request, endpoints, cycle)
        return wait + decoding * self.decode_s

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> np.ndarray:
        return lower_is_better(self.predict(request, endpoints, cycle))

    def pre_request(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None) -> None:
        record_picked_uncached(self, request, endpoint, cycle)


ANALYTIC_PARAMETERS = {"defaultPrefillTokensPerSecond", "decodeMsPerRunningRequest", "prefixScorer"}


def analytic_params(params, plugin_type: str) -> dict:
    """The analytic model's parameters (this scorer's, and predicted-latency-scorer's prior) as keyword arguments."""
    return {
        "default_prefill_tokens_per_s": float_param(params, "defaultPrefillTokensPerSecond",
                                                    DEFAULT_PREFILL_TOKENS_PER_SECOND, plugin_type, 0.0, 1e9,
                                                    min_inclusive=False),
        "decode_ms_per_running_request": float_param(params, "decodeMsPerRunningRequest",
                                                     DEFAULT_DECODE_MS_PER_RUNNING_REQUEST, plugin_type, 0.0, 60_000.0),
        "prefix_source_name": str_param(params, "prefixScorer", "", plugin_type),
    }


def factory(parameters: dict | None) -> PredictedTTFTScorer:
    t = PredictedTTFTScorer.type_name
    return PredictedTTFTScorer(**analytic_params(check_keys(parameters, ANALYTIC_PARAMETERS, t), t))
