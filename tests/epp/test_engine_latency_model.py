"""The latency model a kvgate engine fits from its own requests and publishes (common/engine_latency_protocol.py): the
engine's fit recovers how its TTFT and TPOT follow its gauges, the /metrics page carries the weights and the EPP's
datalayer reads them back (refusing partial or absurd ones), and predicted-latency-scorer with learnFrom: engines
predicts each endpoint from its own model — the scraped gauges plus what it routed since — needing no response body,
and from the analytic prior where an endpoint publishes none."""

import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvgate.common import engine_latency_protocol as published
from kvgate.engine.config import EngineConfig
from kvgate.engine.llm_engine import EngineStats
from kvgate.engine.server.latency_fit import Arrival, EngineLatencyFit
from kvgate.engine.server.metrics import ServerMetrics, latency_gauges
from kvgate.epp.datalayer.dialects import DIALECTS
from kvgate.epp.datalayer.exposition import parse_metrics
from kvgate.epp.scheduling.config import ConfigError, parse_config
from kvgate.epp.scheduling.framework import CycleState, Scheduler
from kvgate.epp.scheduling.latency_model import TTFT_FEATURES
from kvgate.epp.scheduling.live_load import LoadTracker
from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState, LLMRequest
from tests.epp.test_load_plugins import PROMPT, config, produced, warmed

# how a simulated engine's latency follows its state: 0.2 ms per backlog or uncached token, 0.5 ms per running
# request, 30 ms of overhead; its TPOT 10 ms + 0.1 ms per running request
TRUE_TTFT = dict(bias=0.03, backlog=0.0002, uncached=0.0002, running=0.0005)
TRUE_TPOT = dict(bias=0.010, running=0.0001)


def true_ttft(backlog, uncached, running):
    t = TRUE_TTFT
    return t["bias"] + t["backlog"] * backlog + t["uncached"] * uncached + t["running"] * running


def fitted(requests: int = 600, seed: int = 0) -> EngineLatencyFit:
    rng = np.random.default_rng(seed)
    fit = EngineLatencyFit(lambda: (0, 0, 0, 0.0))
    for _ in range(requests):
        backlog, uncached, running = int(rng.integers(0, 8000)), int(rng.integers(0, 3000)), int(rng.integers(0, 64))
        arrival = Arrival(at=100.0, backlog=backlog, running=running, waiting=int(rng.integers(0, 4)),
                          kv_usage=float(rng.uniform(0, 1)))
        ttft = true_ttft(backlog, uncached, running) * float(rng.uniform(0.97, 1.03))
        fit.first_token(arrival, uncached, at=100.0 + ttft)
        tokens = int(rng.integers(2, 200))
        tpot = TRUE_TPOT["bias"] + TRUE_TPOT["running"] * running
        fit.finished(arrival, 100.0 + ttft, 100.0 + ttft + tpot * tokens, tokens)
    return fit


def test_the_engine_fit_recovers_how_its_latency_follows_its_gauges():
    fit = fitted()
    rows = [(0, 100, 0), (4000, 2000, 32), (8000, 0, 60), (200, 2900, 4)]
    x = np.vstack([published.ttft_features(b, u, r, 1) for b, u, r in rows])
    predicted = fit.ttft.predict(x)
    truth = np.array([true_ttft(b, u, r) for b, u, r in rows])
    assert predicted == pytest.approx(truth, rel=0.05)
    tpot = fit.tpot.predict(published.tpot_features([0, 60], 0.5))
    assert tpot == pytest.approx([0.010, 0.016], rel=0.02)
    ttft_weights, tpot_weights, ttft_count, tpot_count = fit.published()
    assert [f for f, _ in ttft_weights] == list(published.TTFT_FEATURES) and ttft_count == tpot_count == 600
    # a backlog token costs what the engine's steps cost it: 0.2 ms, i.e. 2 s per 10k
    assert dict(ttft_weights)["backlog_per_10k"] == pytest.approx(2.0, rel=0.05)
    # each TTFT after the first MIN_OBSERVATIONS was predicted before it was fitted: within the ±3% noise mostly
    assert fit.ttft_errors.count == 600 - published.MIN_OBSERVATIONS
    errors = fit.relative_errors()
    assert errors[0.5] < 0.03 and errors[0.9] < 0.08, errors


def test_nonsense_timings_are_not_fitted():
    fit = EngineLatencyFit(lambda: (0, 0, 0, 0.0))
    arrival = Arrival(at=10.0, backlog=0, running=0, waiting=0, kv_usage=0.0)
    fit.first_token(arrival, 100, at=9.0)  # before its arrival (a clock oddity)
    fit.first_token(arrival, 100, at=float("nan"))
    fit.finished(arrival, 10.5, 11.0, 0)  # no token after the first: no TPOT
    assert fit.ttft.count == 0 and fit.tpot.count == 0


def engine(pending=0, awaiting=0, age=0.0, computed=0, seconds=0.0, running=0, waiting=0, unfinished=0, kv=0.0):
    stats = EngineStats(num_running=running, num_waiting=waiting, kv_cache_usage=kv, num_blocks=7, block_size=16,
                        prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                        prefill_tokens_computed=computed, prefill_step_seconds=seconds)
    return SimpleNamespace(stats=stats, info=None, config=EngineConfig(model="m"), num_prefill_tokens_pending=pending,
                           num_prefill_tokens_awaiting_step=awaiting, step_age_s=age, num_unfinished=unfinished)


def test_a_requests_features_are_the_pages_gauges_at_its_arrival():
    # 3000 pending, 1000 of them awaiting a step; the running step has run 0.25 s at 4000 tokens/s: 1000 computed
    llm = engine(pending=3000, awaiting=1000, age=0.25, computed=40000, seconds=10.0, running=5, waiting=2,
                 unfinished=9, kv=0.4)
    assert latency_gauges(llm) == (2000, 5, 4, 0.4)  # 9 accepted, 5 running, 2 waiting: 2 more not yet taken
    metrics = ServerMetrics(llm, "m")
    tracker = metrics.track(num_prompt_tokens=300, num_samples=1)
    assert tracker.latency_arrival.backlog == 2000 and tracker.latency_arrival.waiting == 4
    assert metrics.track(300, 2).latency_arrival is None  # n = 2: the first token is not one sample's
    assert metrics.track(300, 1, num_prompts=2).latency_arrival is None
    tracker.on_tokens(1, cached_tokens=100)
    tracker.on_tokens(3)
    tracker.on_finished_sample("length", {})
    tracker.close()
    assert metrics.latency.ttft.count == 1 and metrics.latency.tpot.count == 1


def test_the_page_carries_the_model_and_the_epp_reads_it_back():
    llm = engine(running=1, unfinished=1)
    metrics = ServerMetrics(llm, "m")
    metrics.latency = fitted()
    metrics.stats.latency = metrics.latency
    page = metrics.page(frozenset(DIALECTS["vllm"].families())).decode()
    assert 'kvgate:ttft_model_weight{feature="backlog_per_10k",model_name="m"}' in page
    assert 'kvgate:latency_model_observations_total{kind="ttft",model_name="m"} 600.0' in page
    assert 'kvgate:ttft_model_relative_error{model_name="m",quantile="0.9"}' in metrics.page().decode()
    m = parse_metrics(page, DIALECTS["vllm"])
    ttft_weights, tpot_weights, _, _ = metrics.latency.published()
    assert m.ttft_model_weights == pytest.approx([w for _, w in ttft_weights])
    assert m.tpot_model_weights == pytest.approx([w for _, w in tpot_weights])
    assert m.ttft_model_observations == 600
    # a fresh engine publishes its prior (zeros) and a count of 0, which a router does not use
    fresh = parse_metrics(ServerMetrics(llm, "m").page().decode(), DIALECTS["vllm"])
    assert fresh.ttft_model_observations == 0 and fresh.ttft_model_weights == (0.0,) * len(published.TTFT_FEATURES)


@pytest.mark.parametrize("change", ["drop", "duplicate", "inf", "huge", "unknown"])
def test_a_partial_or_absurd_model_is_not_read(change):
    lines = [f'kvgate:ttft_model_weight{{feature="{f}",model_name="m"}} 0.5' for f in published.TTFT_FEATURES]
    if change == "drop":
        lines.pop()
    elif change == "duplicate":
        lines.append(lines[0])
    elif change == "inf":
        lines[1] = lines[1].replace("0.5", "+Inf")
    elif change == "huge":
        lines[1] = lines[1].replace("0.5", "1e12")
    else:
        lines[1] = lines[1].replace("backlog_per_10k", "moon_phase")
    tpot = [f'kvgate:tpot_model_weight{{feature="{f}",model_name="m"}} 0.01' for f in published.TPOT_FEATURES]
    page = "\n".join(["vllm:num_requests_running{model_name=\"m\"} 1.0", *lines, *tpot,
                      'kvgate:latency_model_observations_total{kind="ttft",model_name="m"} 50.0']) + "\n"
    m = parse_metrics(page, DIALECTS["vllm"])
    assert m.ttft_model_weights is None and m.tpot_model_weights is not None


def state(address, weights=None, observations=100, pending=0, running=0, waiting=0, kv=0.0, rate=None):
    m = EndpointMetrics(running_requests=running, waiting_queue_size=waiting, kv_cache_usage=kv,
                        prefill_tokens_pending=pending, prefill_tokens_per_s=rate, updated_at=time.monotonic())
    if weights is not None:
        m.ttft_model_weights, m.tpot_model_weights = weights
        m.ttft_model_observations = observations
    return EndpointState(Endpoint(address), m, stale=False)


def scheduler_for(learn_from: str, more: str = "") -> tuple[Scheduler, object]:
    text = config("type: prefix-cache-scorer", "type: predicted-latency-scorer\n  parameters: "
                  "{defaultPrefillTokensPerSecond: 1000, decodeMsPerRunningRequest: 2, learnFrom: " + learn_from + more
                  + "}")
    parsed = parse_config(text)
    scheduler = Scheduler(parsed.scheduler)
    return scheduler, scheduler.plugins_of_type("predicted-latency-scorer")[0]


def test_learning_from_engines_predicts_each_endpoint_from_its_own_model(caplog):
    caplog.set_level("INFO", logger="kvgate.epp.scheduling.plugins.predicted_latency_scorer")
    scheduler, scorer = scheduler_for("engines")
    assert not scorer.reads_response_body and not scheduler.reads_response_body
    slow = ((0.05, 4.0, 4.0, 0.1, 0.0), (0.02, 0.0, 0.0))  # 0.4 ms a token
    fast = ((0.01, 1.0, 1.0, 0.1, 0.0), (0.01, 0.0, 0.0))  # 0.1 ms a token
    states = [state("slow:1", slow, pending=1000, running=10), state("fast:1", fast, pending=3000, running=10),
              state("young:1", fast, observations=published.MIN_OBSERVATIONS - 1, pending=0),
              state("vllm:1", None, pending=500, rate=1000)]
    warmed(scheduler, states, {"fast:1": PROMPT})
    cycle = produced(scheduler, LLMRequest("r1", "m", "m", PROMPT), states, CycleState(LoadTracker().view(states)))
    _, ttft, _, tpot = scorer.predict(LLMRequest("r1", "m", "m", PROMPT), states, cycle)
    # slow: 0.05 + 4 × (1000 + 160 uncached) / 10^4 + 0.1 × 10/100; fast: the prompt cached there, 3000 backlog;
    # young and vllm: the analytic prior, (backlog + 160) / 1000 (the default rate for young) + running × 2 ms
    assert ttft == pytest.approx([0.05 + 0.464 + 0.01, 0.01 + 0.3 + 0.01, 0.16, 0.66])
    said = [r.getMessage() for r in caplog.records]
    assert said == ["predicted-latency-scorer: slow:1 publishes its latency model: predicting from it",
                    "predicted-latency-scorer: fast:1 publishes its latency model: predicting from it",
                    *(f"predicted-latency-scorer: {a} publishes no latency model fitted enough to use: predicting "
                      "from the analytic model" for a in ("young:1", "vllm:1"))]
    assert tpot == pytest.approx([0.02, 0.01, 0.0, 0.0])
    # what this EPP routed there since the scrape counts as that engine's backlog (and a waiting request)
    tracker = LoadTracker()
    tracker.add(LLMRequest("earlier", "m", "m", "x"), "slow:1", 2000, 2000)
    r2 = LLMRequest("r2", "m", "m", PROMPT)
    _, after, _, _ = scorer.predict(r2, states, produced(scheduler, r2, states, CycleState(tracker.view(states))))
    assert after[0] == pytest.approx(ttft[0] + 4.0 * 2000 / 1e4, rel=1e-6)
    assert scorer.counts["engine_model_predictions"] == 2
    # nothing tracked for learning: no response will reach this EPP
    scorer.pre_request(LLMRequest("r3", "m", "m", PROMPT), states[0], cycle)
    assert scorer.stats()["tracked_requests"] == 0


def test_learning_from_responses_stays_the_default_and_learn_from_is_checked():
    scheduler, scorer = scheduler_for("responses")
    assert scorer.reads_response_body and scheduler.reads_response_body
    with pytest.raises(ConfigError, match="learnFrom must be one of responses, engines"):
        scheduler_for("gossip")
    assert not parse_config(config("type: predicted-latency-scorer\n  parameters: {learnFrom: engines}")
                            ).needs_response_body


def test_measuring_the_engines_models_streams_responses_only_to_measure_them():
    """measureError: the EPP sees the responses again, and measures its predictions from the engines' models against
    them, without fitting a model of its own."""
    scheduler, scorer = scheduler_for("engines", ", measureError: true")
    assert scorer.reads_response_body and scheduler.reads_response_body
    fast = ((0.01, 1.0, 1.0, 0.1, 0.0), (0.01, 0.0, 0.0))
    states = [state("fast:1", fast, pending=3000, running=10), state("vllm:1", None, pending=500, rate=1000)]
    features = np.ones((1, len(TTFT_FEATURES)))
    prior = scorer.model.ttft.predict(features).copy()
    request, cycle = LLMRequest("r1", "m", "m", PROMPT, headers={"x-slo-ttft-ms": "500"}), CycleState()
    (picked,) = scheduler.schedule(request, states, cycle)
    assert picked.address == "fast:1"  # 0.01 + 0.3 + 0.01 + 0.016 uncached against 1.16 s
    scheduler.on_picked(request, picked, cycle)
    assert scorer.stats()["tracked_requests"] == 1
    request.first_token_at = time.monotonic() + 0.2  # as if its first token came ~0.2 s after the pick
    scorer.response_complete(request, picked.address, 160, 1)
    stats = scorer.stats()
    assert stats["ttft_observations"] == 1 and stats["tracked_requests"] == 0
    assert stats["ttft_abs_error_seconds"] == pytest.approx(0.336 - 0.2, abs=0.01)
    assert stats["objectives_met"] == 1
    assert np.array_equal(scorer.model.ttft.predict(features), prior)  # nothing fitted
    with pytest.raises(ConfigError, match="measureError must be"):
        scheduler_for("engines", ", measureError: 3")
