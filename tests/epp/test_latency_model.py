"""predicted-latency-scorer and its online model: the prior is the analytic TTFT model, responses teach it the
pool's real latency, per-request objectives (llm-d's x-slo-ttft-ms / x-slo-tpot-ms) steer the pick, and the
ext-proc response path times the first token."""

import time

import numpy as np
import pytest

from kvgate.epp.extproc import has_token
from kvgate.epp.scheduling.config import ConfigError, parse_config
from kvgate.epp.scheduling.framework import CycleState, Scheduler
from kvgate.epp.scheduling.live_load import LoadTracker
from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState, LLMRequest
from kvgate.common.online_ridge import TTFT_WEIGHT_FLOOR_S, OnlineRidge
from tests.epp.helpers import request
from tests.epp.test_load_plugins import PROMPT, config, warmed


def test_ridge_is_its_prior_without_data_and_learns_the_truth_with_it():
    prior = np.array([0.0, 1.0, 0.0])
    model = OnlineRidge(prior)
    assert np.allclose(model.weights, prior)
    rng = np.random.default_rng(0)
    truth = np.array([0.05, 2.0, 0.3])
    for _ in range(2000):
        x = np.array([1.0, rng.uniform(0, 2), rng.uniform(0, 1)])
        model.update(x, float(x @ truth + rng.normal(0, 0.01)))
    assert model.weights == pytest.approx(truth, abs=0.02)
    # The pool changes (a slower replica set): the forgetting model follows (old responses' weight halves every
    # ~350 newer ones: after 3000, 0.25% of it is left).
    changed = np.array([0.1, 3.0, 0.3])
    for _ in range(3000):
        x = np.array([1.0, rng.uniform(0, 2), rng.uniform(0, 1)])
        model.update(x, float(x @ changed))
    assert model.weights == pytest.approx(changed, abs=0.05)
    assert (model.predict(np.array([[1.0, -5.0, 0.0]])) == 0.0).all()  # a latency is never negative


def test_relative_weights_keep_the_many_short_ttfts_right():
    """Nine in ten responses are warm hits (TTFT 60 ms + the wait); one in ten is held up by what the features do
    not see (+0.5 s). Fitted on absolute error, those few drag the bias up and every short TTFT is over-predicted;
    weighted 1/TTFT² (LatencyModel's weights) the fit keeps the short ones right."""
    rng = np.random.default_rng(0)
    plain, relative = OnlineRidge(np.array([0.0, 1.0])), OnlineRidge(np.array([0.0, 1.0]))
    for _ in range(3000):
        x = np.array([1.0, rng.uniform(0, 0.05)])
        y = 0.06 + x[1] + (0.5 if rng.uniform() < 0.1 else 0.0)
        plain.update(x, y)
        relative.update(x, y, 1.0 / max(y, TTFT_WEIGHT_FLOOR_S) ** 2)
    short = np.column_stack([np.ones(100), np.linspace(0, 0.05, 100)])
    truth = 0.06 + short[:, 1]
    error = {name: np.median(np.abs(m.predict(short) / truth - 1)) for name, m in (("plain", plain),
                                                                                     ("relative", relative))}
    assert error["plain"] > 0.5 and error["relative"] < 0.15, error
    # The ridge counts in average responses whatever the weights: the same responses, each weighing 400 (a 50 ms
    # TTFT's weight), fit exactly as at weight 1, the prior's pull included.
    one, heavy = OnlineRidge(np.array([0.0, 1.0])), OnlineRidge(np.array([0.0, 1.0]))
    for i in range(5):
        x = np.array([1.0, i / 100])
        one.update(x, 0.2 + x[1])
        heavy.update(x, 0.2 + x[1], 400.0)
    assert np.allclose(one.weights, heavy.weights) and not np.allclose(one.weights, [0.2, 1.0], atol=1e-3)


def test_an_unexcited_direction_stays_at_the_prior():
    model = OnlineRidge(np.array([0.0, 1.0, 0.5]))
    for i in range(500):  # the third feature is always 0: nothing says what its weight is
        x = np.array([1.0, (i % 7) / 7, 0.0])
        model.update(x, float(0.2 + 1.5 * x[1]))
    assert model.weights[2] == pytest.approx(0.5, abs=1e-6)
    assert model.weights[:2] == pytest.approx([0.2, 1.5], abs=0.04)  # the prior still pulls a little


def lat_state(address, pending=0, rate=None, running=0, waiting=0, kv=0.0):
    m = EndpointMetrics(running_requests=running, waiting_queue_size=waiting, kv_cache_usage=kv,
                        prefill_tokens_pending=pending, prefill_tokens_per_s=rate, updated_at=time.monotonic())
    return EndpointState(Endpoint(address), m, stale=False)


def scorer_and_states(extra: str = ""):
    text = config("type: prefix-cache-scorer", "type: predicted-latency-scorer\n  parameters: "
                  "{defaultPrefillTokensPerSecond: 1000, decodeMsPerRunningRequest: 2" + extra + "}")
    scheduler = Scheduler(parse_config(text).scheduler)
    scorer = scheduler.plugins_of_type("predicted-latency-scorer")[0]
    states = [lat_state("a:1", pending=2000, rate=4000, running=10),
              lat_state("b:1", pending=0, running=0),
              lat_state("c:1", pending=0, rate=2000, running=50)]
    warmed(scheduler, states, {"a:1": PROMPT})
    return scheduler, scorer, states


def test_the_prior_is_the_analytic_ttft_model():
    _, scorer, states = scorer_and_states()
    _, ttft, _, tpot = scorer.predict(request(PROMPT), states, CycleState(LoadTracker().view(states)))
    # a: 2000 pending / 4000 + 10 × 2 ms; b: 160 uncached / 1000 (default rate); c: 160 / 2000 + 50 × 2 ms
    assert ttft == pytest.approx([0.52, 0.16, 0.18])
    assert list(tpot) == [0.0, 0.0, 0.0]  # unknown until measured


def test_objectives_prefer_endpoints_that_meet_them():
    _, scorer, states = scorer_and_states()
    cycle = CycleState(LoadTracker().view(states))
    plain = scorer.score(request(PROMPT), states, cycle)
    assert int(np.argmax(plain)) == 1  # b: lowest predicted TTFT
    met = scorer.score(request(PROMPT, headers={"x-slo-ttft-ms": "200"}), states, cycle)
    assert met[1] == 1.0 and met[2] >= 0.5 and met[0] < 0.5  # a misses 200 ms, b and c meet it
    none = scorer.score(request(PROMPT, headers={"x-slo-ttft-ms": "10"}), states, cycle)
    assert (none < 0.5).all() and int(np.argmax(none)) == 1  # no one meets it: the smallest miss wins
    assert scorer.counts["objectives"] == 2 and scorer.counts["objectives_unmeetable"] == 1
    bad = scorer.score(request(PROMPT, headers={"x-slo-ttft-ms": "soon", "x-slo-tpot-ms": "-3"}), states, cycle)
    assert list(bad) == list(plain) and scorer.counts["objectives_bad"] == 1


def test_stated_objectives_filter_out_the_candidates_predicted_to_miss_them():
    _, scorer, states = scorer_and_states(", objectivesFilter: true")
    cycle = CycleState(LoadTracker().view(states))
    addresses = lambda kept: [e.address for e in kept]  # noqa: E731
    assert scorer.filter(request(PROMPT), states, cycle) is states  # no objective: every candidate
    met = request(PROMPT, headers={"x-slo-ttft-ms": "200"})
    assert addresses(scorer.filter(met, states, cycle)) == ["b:1", "c:1"]
    assert scorer.filter(request(PROMPT, headers={"x-slo-ttft-ms": "10"}), states, cycle) is states  # none meets it
    assert scorer.filter(request(PROMPT, headers={"x-slo-ttft-ms": "1000"}), states, cycle) is states  # all meet it
    # not an objective
    assert scorer.filter(request(PROMPT, headers={"x-slo-ttft-ms": "soon"}), states, cycle) is states
    _, off, states = scorer_and_states()  # off by default
    assert off.filter(request(PROMPT, headers={"x-slo-ttft-ms": "200"}), states, cycle) is states


def test_an_objective_outweighs_the_cache_scorers_that_would_miss_it():
    """In a profile where the prefix scorer outweighs the latency scorer (kvgate's), a request stating a TTFT
    objective leaves the replica holding its prompt when that replica's backlog would make it miss; without one it
    stays. The replica it left remains a fallback."""
    text = config("type: prefix-cache-scorer", "type: predicted-latency-scorer\n  parameters: "
                  "{defaultPrefillTokensPerSecond: 1000, decodeMsPerRunningRequest: 2, objectivesFilter: true}",
                  "type: max-score-picker\n  parameters: {maxNumOfEndpoints: 3}")
    text += ("schedulingProfiles:\n- name: default\n  plugins:\n  - {pluginRef: predicted-latency-scorer, weight: 1}\n"
             "  - {pluginRef: prefix-cache-scorer, weight: 10}\n  - {pluginRef: max-score-picker}\n")
    scheduler = Scheduler(parse_config(text).scheduler)
    states = [lat_state("a:1", pending=2000, rate=4000, running=10), lat_state("b:1"),
              lat_state("c:1", rate=2000, running=50)]
    warmed(scheduler, states, {"a:1": PROMPT})
    plain = scheduler.schedule(request(PROMPT), states, CycleState(LoadTracker().view(states)))
    assert plain[0].address == "a:1"  # 0.52 s predicted, but it holds the prompt
    hurried = scheduler.schedule(request(PROMPT, headers={"x-slo-ttft-ms": "200"}), states,
                                 CycleState(LoadTracker().view(states)))
    assert [e.address for e in hurried] == ["b:1", "c:1", "a:1"]


def test_responses_teach_the_model_the_pool_s_real_ttft():
    """The pool is twice as slow as the analytic model thinks, plus 50 ms: after a few hundred streamed responses
    the predictions follow the measurements, and the errors it reports shrink."""
    scheduler, scorer, _ = scorer_and_states()
    rng = np.random.default_rng(1)
    errors = []
    for i in range(600):
        states = [lat_state(f"e{j}:1", pending=int(rng.integers(0, 8000)), rate=4000,
                            running=int(rng.integers(0, 60))) for j in range(3)]
        r = request(PROMPT, request_id=f"q{i}")
        cycle = CycleState(LoadTracker().view(states))
        ordered = scheduler.schedule(r, states, cycle)
        scheduler.on_picked(r, ordered[0], cycle)
        pick = scorer._picks[r.request_id]
        true_ttft = 0.05 + 2.0 * pick.ttft_x[1] + 0.002 * 100 * pick.ttft_x[2]
        errors.append(abs(pick.ttft - true_ttft) / true_ttft)
        r.first_token_at = pick.picked_at + true_ttft
        scheduler.on_response_complete(r, ordered[0].address, 160, 1)
    assert errors[0] > 0.3 and np.mean(errors[-100:]) < 0.05  # the prior: about half the real TTFT
    stats = scorer.stats()
    assert stats["ttft_observations"] == 600 and stats["tracked_requests"] == 0


def test_learn_false_keeps_the_prior_but_measures_its_error():
    scheduler, scorer, states = scorer_and_states(", learn: false")
    r = request(PROMPT)
    cycle = CycleState(LoadTracker().view(states))
    ordered = scheduler.schedule(r, states, cycle)
    scheduler.on_picked(r, ordered[0], cycle)
    r.first_token_at = scorer._picks["r1"].picked_at + 1.0
    scheduler.on_response_complete(r, ordered[0].address, 160, 1)
    assert scorer.model.ttft.count == 0 and scorer.stats()["ttft_observations"] == 1


def test_a_request_without_a_first_token_teaches_nothing():
    scheduler, scorer, states = scorer_and_states()
    r = request(PROMPT)
    cycle = CycleState(LoadTracker().view(states))
    scheduler.on_picked(r, scheduler.schedule(r, states, cycle)[0], cycle)
    scheduler.on_response_complete(r, "b:1", 0, 0)  # an error answer, or not streamed
    assert scorer.model.ttft.count == 0 and scorer.stats()["tracked_requests"] == 0


@pytest.mark.parametrize("params, message", [("{learn: 3}", "learn"), ("{x: 1}", "unknown parameter"),
                                             ("{defaultPrefillTokensPerSecond: 0}", "defaultPrefillTokensPerSecond")])
def test_bad_parameters_are_named(params, message):
    with pytest.raises(ConfigError, match=f"predicted-latency-scorer.*{message}"):
        parse_config(config(f"type: predicted-latency-scorer\n  parameters: {params}"))


@pytest.mark.parametrize("chunk, token", [
    (b'data: {"choices":[{"index":0,"text":" Apache"}]}\n\n', True),
    (b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n', False),
    (b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n', True),
    (b'data: {"choices":[{"index":0,"delta":{"content":"\\"q"}}]}\n\n', True),
    (b'data: {"choices":[{"index":0,"text":""}]}\n\n', False),
    (b'data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c1"}]}}]}\n\n', True),
    (b'data: [DONE]\n\n', False),
])
def test_the_first_token_is_found_in_streamed_chunks(chunk, token):
    assert has_token(chunk) is token


def test_a_sheddable_request_whose_objectives_no_endpoint_meets_is_shed():
    from kvgate.epp.admission import Admission
    from kvgate.epp.datalayer import Datalayer
    from kvgate.epp.datastore import Datastore
    from kvgate.epp.director import Director, RoutingError
    from kvgate.common.epp_protocol import OBJECTIVE_HEADER

    layer = Datalayer()
    addresses = ["10.0.0.1:8000", "10.0.0.2:8000"]
    layer.set_endpoints([Endpoint(a) for a in addresses])
    for a in addresses:  # scraped just now: 4000 prompt tokens to prefill at the default 1000 tokens/s = 4 s
        c = layer._collectors[a]
        c.metrics = EndpointMetrics(updated_at=time.monotonic(), prefill_tokens_pending=4000)
        c.scrapes += 1
    datastore = Datastore()
    datastore.set_policies({"batch": -1, "chat": 0}, [])
    text = config("type: predicted-latency-scorer\n  parameters: {defaultPrefillTokensPerSecond: 1000}")
    d = Director(datastore, layer, Scheduler(parse_config(text).scheduler), Admission(), seed=1)

    def ask(objective, ttft_ms):
        return d.pick(LLMRequest("r", "m", "m", "hello", headers={OBJECTIVE_HEADER: objective,
                                                                   "x-slo-ttft-ms": ttft_ms}))

    with pytest.raises(RoutingError) as err:
        ask("batch", "500")  # sheddable, 4 s predicted against 500 ms: shed
    assert err.value.status == 429 and "latency objectives" in str(err.value)
    assert ask("chat", "500")  # not sheddable: routed where it misses least
    assert ask("batch", "10000")  # sheddable, but its objective can be met


@pytest.mark.parametrize("value, expected", [
    ("3600000", 3_600_000.0),  # the bound: an hour
    ("3600000.5", "bad"), ("0", "bad"), ("-5", "bad"), ("nan", "bad"), ("inf", "bad"), ("1e400", "bad"),
    ("12abc", "bad"), ("9" * 60_000, "bad"),  # a header as long as Envoy lets through: refused, cheaply
])
def test_an_objective_header_is_a_positive_number_of_ms_up_to_an_hour(value, expected):
    from kvgate.epp.scheduling.plugins.predicted_latency_scorer import objective_ms

    started = time.perf_counter()
    assert objective_ms({"x-slo-ttft-ms": value}, "x-slo-ttft-ms") == expected
    assert time.perf_counter() - started < 1.0  # linear in the header (Envoy bounds it at 60 KiB by default)
    assert objective_ms({}, "x-slo-ttft-ms") is None
