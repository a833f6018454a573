"""An engine's /metrics page is input: whatever one endpoint serves, picks among the others go on.

Pages reach a real Datalayer's collector as its connection delivers them (EndpointCollector.on_answer), and a
real Director with kvgate's profile (and upstream's default) picks over the result, as the EPP does.
"""

from __future__ import annotations

import functools
import logging
import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.epp.admission import Admission
from kvgate.epp.datalayer import Datalayer
from kvgate.epp.datalayer import value_bounds as bounds
from kvgate.epp.datalayer.exposition import parse_metrics
from kvgate.epp.datalayer.dialects import DIALECTS
from kvgate.epp.datalayer.prefill_rate import PrefillRateEstimator
from kvgate.epp.datastore import Datastore
from kvgate.epp.director import Director
from kvgate.epp.scheduling import framework
from kvgate.epp.scheduling.config import KVGATE_PROFILE_YAML, default_config, parse_config
from kvgate.epp.scheduling.framework import PluginContext, Scheduler, SchedulerConfig, SchedulingProfile, \
    WeightedScorer
from kvgate.epp.scheduling.plugins.pickers import MaxScorePicker
from kvgate.epp.types import Endpoint, EndpointMetrics
from kvgate.common.online_ridge import OnlineRidge
from tests.epp.helpers import request

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def page(*, waiting=0, running=1, usage=0.2, block_size="16", blocks="4096", queries=1000.0, hits=400.0,
         pending=300, awaiting=100, age=0.05, computed=5000.0, seconds=2.0, extra="") -> str:
    """A kvgate engine's page (vLLM's families and kvgate's own), with any value replaceable by text; without
    `computed` (None), a vLLM engine's, whose prefill rate the EPP estimates from its prefix-cache counters."""
    timing = "" if computed is None else (
        f'kvgate:prefill_tokens_computed_total{{model_name="m"}} {computed}\n'
        f'kvgate:prefill_step_seconds_total{{model_name="m"}} {seconds}\n')
    return (f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
            f'vllm:num_requests_running{{model_name="m"}} {running}\n'
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {usage}\n'
            f'vllm:cache_config_info{{block_size="{block_size}",model_name="m",num_gpu_blocks="{blocks}"}} 1.0\n'
            f'vllm:lora_requests_info{{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""}} 1.7e9\n'
            f'vllm:prefix_cache_queries_total{{model_name="m"}} {queries}\n'
            f'vllm:prefix_cache_hits_total{{model_name="m"}} {hits}\n'
            f'kvgate:num_prefill_tokens_pending{{model_name="m"}} {pending}\n'
            f'kvgate:num_prefill_tokens_awaiting_step{{model_name="m"}} {awaiting}\n'
            f'kvgate:engine_step_age_seconds{{model_name="m"}} {age}\n' + timing + extra)


class Clock:
    """The datalayer's clock, moved on by SCRAPE_S at every page served: seconds of scraping in milliseconds."""

    SCRAPE_S = 0.1

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset


class Pool:
    """A datalayer over A and B fed pages by hand (its clock moving on a scrape interval with each), and a director
    with `config`'s scheduler."""

    def __init__(self, config_text: str | None = KVGATE_PROFILE_YAML) -> None:
        self.clock = Clock()
        self.layer = Datalayer()
        self.layer.set_endpoints([Endpoint(A), Endpoint(B)])
        self.layer._started = True  # collectors take answers (no ticker: this test delivers them)
        config = parse_config(config_text) if config_text else default_config()
        self.scheduler = Scheduler(config.scheduler)
        self.scheduler.start(PluginContext())
        self.director = Director(Datastore(), self.layer, self.scheduler, Admission(), seed=1)
        self.picks = 0

    def serve(self, address: str, text: str | bytes) -> None:
        c = self.layer._collectors[address]
        c.not_before = 0.0  # the parse backoff is the ticker's business
        self.clock.offset += Clock.SCRAPE_S
        c.on_answer(200, text if isinstance(text, bytes) else text.encode(), None)

    def pick(self, prompt: str = "hello world") -> str:
        self.picks += 1
        self.layer._snapshot = None  # a new round: states as scraped now
        ordered = self.director.pick(request(prompt, request_id=f"r{self.picks}"))
        return ordered[0].address

    def close(self) -> None:
        self.scheduler.stop()


@pytest.fixture(autouse=True)
def datalayer_clock(monkeypatch):
    """Pool's clock stands in for the collector's: scrapes seconds apart, staleness judged on the same clock."""
    from kvgate.epp.datalayer import collector

    clocks = []

    def monotonic():
        return clocks[-1].monotonic() if clocks else time.monotonic()

    monkeypatch.setattr(collector, "time", type("Time", (), {"monotonic": staticmethod(monotonic),
                                                             "thread_time": staticmethod(time.thread_time)}))
    real_init = Pool.__init__

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        clocks.append(self.clock)

    monkeypatch.setattr(Pool, "__init__", init)


@pytest.fixture
def pool():
    p = Pool()
    yield p
    p.close()


# name -> the bad page, given the engine's page builder (a kvgate engine's, or a vLLM engine's without its timing)
BAD_PAGES = {
    "400-digit block count": lambda pg: pg(blocks="1" * 400),
    "400-digit block size": lambda pg: pg(block_size="9" * 400),
    "+Inf prefix counters": lambda pg: pg(queries="+Inf", hits="+Inf"),
    "NaN everywhere": lambda pg: pg(waiting="NaN", running="NaN", usage="NaN", queries="NaN", age="NaN",
                                    computed="NaN"),
    "+Inf step age": lambda pg: pg(age="+Inf"),
    "-Inf gauges": lambda pg: pg(waiting="-Inf", running="-Inf", pending="-Inf", awaiting="-Inf"),
    "1e308 everywhere": lambda pg: pg(waiting="1e308", running="1e308", usage="1e308", pending="1e308",
                                      awaiting="1e308", age="1e308", queries="1e308", hits="1e308", computed="1e308",
                                      seconds="1e308"),
    "negative counters": lambda pg: pg(queries=-5, hits=-10, computed=-1, seconds=-1),
    "usage 7": lambda pg: pg(usage=7),
    "garbage bytes": lambda pg: bytes(range(256)) * 64,
    "garbage values": lambda pg: pg(waiting="abc", running="0x10", usage="--1", age="1e", blocks="-16", block_size="x"),
    "lora bomb": lambda pg: pg(extra='vllm:lora_requests_info{max_lora="99999999999999",running_lora_adapters="' +
                      ",".join(f"a{i}" for i in range(5000)) + '",waiting_lora_adapters=""} 1.8e9\n'),
    "50k label sets": lambda pg: "".join(f'vllm:num_requests_waiting{{x="{i}"}} 1\n' for i in range(50_000)) + pg(),
    "model weights out of range": lambda pg: pg(extra="".join(
        f'kvgate:ttft_model_weight{{feature="f{i}"}} 1e300\n' for i in range(3))),
}


def busy(i: int, timed: bool, **kw) -> str:
    """A page of scrape `i` of an engine prefilling all along: its counters move on."""
    return page(queries=1000.0 + 500 * i, hits=400.0, computed=(5000.0 + 500 * i) if timed else None,
                seconds=2.0 + 0.1 * i, **kw)


@pytest.mark.parametrize("timed", [True, False], ids=["kvgate-engine", "vllm-engine"])
@pytest.mark.parametrize("name", list(BAD_PAGES))
def test_a_bad_page_costs_only_its_endpoint(pool, name, timed):
    """A's page is normal and busier; B's prefill rate is measured, then B serves a bad page for 3 s of scrapes:
    every pick succeeds; once B's page is normal again (and B the idler), B is picked again."""
    i = 0
    for i in range(10):
        pool.serve(A, busy(i, timed, waiting=8, running=8, usage=0.7, pending=3000))
        pool.serve(B, busy(i, timed))
    assert pool.layer.metrics(B).prefill_tokens_per_s  # measured
    assert pool.pick() == B  # the idler one
    for i in range(i + 1, i + 16):
        pool.serve(A, busy(i, timed, waiting=8, running=8, usage=0.7, pending=3000))
        pool.serve(B, BAD_PAGES[name](page if timed else functools.partial(page, computed=None)))
        assert pool.pick() in (A, B)
    out = pool.scheduler.quarantined()
    assert out in ([], [B])
    time.sleep(framework.QUARANTINE_S if out else 0)
    for i in range(i + 1, i + 11):
        pool.serve(A, busy(i, timed, waiting=8, running=8, usage=0.7, pending=3000))
        pool.serve(B, busy(i, timed))
    assert pool.pick() == B
    rate = pool.layer.metrics(B).prefill_tokens_per_s
    assert rate is not None and math.isfinite(rate)


def test_out_of_range_values_are_dropped_counted_and_logged(pool, caplog):
    pool.serve(A, page())
    caplog.set_level(logging.WARNING, "kvgate.epp.datalayer")
    pool.serve(B, page(blocks="1" * 400, queries="+Inf", hits="+Inf", age="+Inf", usage=3))
    m = pool.layer.metrics(B)
    assert (m.num_kv_blocks, m.kv_block_size, m.step_age_s, m.prefix_cache_queries, m.kv_cache_usage) == (
        None, None, None, None, 0.0)  # what was dropped reads as not exported
    pool.serve(B, page(queries="+Inf"))  # within LOG_EVERY_S: counted, not logged again
    c = pool.layer._collectors[B]
    assert c.rejected == {("vllm:cache_config_info", "bad_label"): 1,
                          ("vllm:prefix_cache_queries_total", "non_finite"): 2,
                          ("vllm:prefix_cache_hits_total", "non_finite"): 1,
                          ("kvgate:engine_step_age_seconds", "non_finite"): 1,
                          ("vllm:kv_cache_usage_perc", "out_of_range"): 1}
    lines = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == 1 and B in lines[0] and "kv_cache_usage_perc 3.0" in lines[0] and len(lines[0]) < 300
    assert ("vllm:prefix_cache_queries_total", "non_finite") in dict(
        (a, r) for a, _, r, _ in pool.layer.endpoint_counts())[B]
    assert not pool.layer._collectors[A].rejected


def test_each_value_has_a_range():
    d = DIALECTS["vllm"]
    ok = parse_metrics(page(), d)
    assert (ok.num_kv_blocks, ok.kv_block_size, ok.step_age_s) == (4096, 16, 0.05)
    assert parse_metrics(page(block_size="0"), d).kv_block_size is None
    assert parse_metrics(page(blocks=str(bounds.MAX_KV_BLOCKS + 1)), d).num_kv_blocks is None
    assert parse_metrics(page(usage=1 + 1e-9), d).kv_cache_usage == 1.0  # rounding, read as full
    assert parse_metrics(page(usage=-0.5), d).kv_cache_usage == 0.0  # dropped: as if not exported
    assert parse_metrics(page(age=bounds.MAX_STEP_AGE_S * 2), d).step_age_s is None
    assert parse_metrics(page(pending=-1), d).prefill_tokens_pending is None
    assert parse_metrics(page(waiting=bounds.MAX_REQUESTS + 1, running=3), d).waiting_queue_size == 0
    many = "".join(f'vllm:num_requests_running{{x="{i}"}} 1\n' for i in range(bounds.MAX_SERIES + 1)) + page()
    assert parse_metrics(many, d).running_requests == 0  # the family had more label sets than any engine's
    assert parse_metrics(many.split("\n", 1)[1], d).running_requests == bounds.MAX_SERIES


def test_estimators_refuse_non_finite_input_and_recover():
    rate = PrefillRateEstimator()
    t = 0.0
    for tokens, seconds in [(0, 0), (1000, 0.5), (math.inf, 0.7), (math.nan, math.nan), (3000, 1.5), (4000, 2.0)]:
        t += 0.1
        est = rate.update(EndpointMetrics(prefill_tokens_computed=tokens, prefill_step_seconds=seconds,
                                          updated_at=t))
        assert est is None or math.isfinite(est)
    assert est == pytest.approx(2000, rel=0.05)
    untimed = PrefillRateEstimator()
    for i, (q, h) in enumerate([(0, 0), (math.inf, math.inf), (500, 0), (1500, 0)] + [(2000 + 1000 * i, 0)
                                                                                       for i in range(10)]):
        est = untimed.update(EndpointMetrics(prefix_cache_queries=q, prefix_cache_hits=h,
                                             prefill_tokens_pending=100, updated_at=0.1 * (i + 1)))
        assert est is None or math.isfinite(est)
    assert est is not None and math.isfinite(est)
    ridge = OnlineRidge(prior=np.array([1.0, 2.0]))
    ridge.update(np.array([math.inf, 1.0]), 1.0)
    ridge.update(np.array([1.0, 1.0]), math.nan)
    ridge.update(np.array([1e200, 1e200]), 1e200)  # overflows the sums: starts over
    assert ridge.skipped == 3 and all(math.isfinite(w) for w in ridge.weights)
    for _ in range(50):
        ridge.update(np.array([1.0, 0.0]), 3.0)
    assert ridge.weights[0] == pytest.approx(3.0, rel=0.1)


class _FailsOn(framework.Scorer):
    """A scorer that raises when `bad` is among the endpoints it scores (one endpoint's data failing it)."""

    type_name = "fails-on"

    def __init__(self, bad: str) -> None:
        super().__init__()
        self.bad = bad

    def score(self, req, endpoints, cycle=None):
        if any(e.address == self.bad for e in endpoints):
            raise OverflowError("int too large to convert to float")
        return [0.5] * len(endpoints)


def _scheduler(bad: str) -> Scheduler:
    return Scheduler(SchedulerConfig([SchedulingProfile("p", scorers=[WeightedScorer(_FailsOn(bad), 1.0)],
                                                        picker=MaxScorePicker())]))


def test_a_plugin_failing_on_one_endpoints_data_takes_that_endpoint_out(monkeypatch, caplog):
    monkeypatch.setattr(framework, "QUARANTINE_S", 0.2)
    layer = Datalayer()
    layer.set_endpoints([Endpoint(A), Endpoint(B)])
    for c in layer._collectors.values():
        c.metrics, c.scrapes = EndpointMetrics(updated_at=time.monotonic()), 1
    scheduler = _scheduler(B)
    director = Director(Datastore(), layer, scheduler, Admission(), seed=1)
    caplog.set_level(logging.WARNING, "kvgate.epp.scheduling.framework")
    for i in range(20):
        assert director.pick(request(request_id=f"r{i}"))[0].address == A
    assert scheduler.endpoint_faults == {B: 1} and scheduler.quarantined() == [B]
    assert len([r for r in caplog.records if B in r.getMessage()]) == 1
    time.sleep(0.25)  # out of quarantine: tried again, fails again, out again
    assert director.pick(request(request_id="again"))[0].address == A
    assert scheduler.endpoint_faults == {B: 2}
    scheduler.remove_endpoint(B)
    assert scheduler.endpoint_faults == {} and scheduler.quarantined() == []


def test_a_plugin_failing_on_every_endpoint_is_not_blamed_on_them():
    layer = Datalayer()
    layer.set_endpoints([Endpoint(A)])
    layer._collectors[A].metrics, layer._collectors[A].scrapes = EndpointMetrics(updated_at=time.monotonic()), 1
    scheduler = _scheduler(A)
    director = Director(Datastore(), layer, scheduler, Admission(), seed=1)
    with pytest.raises(OverflowError):
        director.pick(request())
    assert scheduler.quarantined() == []


# --------------------------------------------------------------------------------------------- any page at all

_FAMILIES = [*DIALECTS["vllm"].families(), "vllm:num_requests_waiting_by_reason", "other"]
_NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.integers(min_value=-(10 ** 30), max_value=10 ** 400).map(str),
    st.sampled_from(["NaN", "+Inf", "-Inf", "1e400", "-0", "0x1p3", "", "nan", "1_000", "\u0661"]),
    st.text(max_size=8))
_LABEL_VALUES = st.one_of(_NUMBERS, st.text(max_size=30), st.just("a," * 3000))
_LABELS = st.dictionaries(st.sampled_from(["model_name", "block_size", "num_gpu_blocks", "max_lora", "feature",
                                           "running_lora_adapters", "waiting_lora_adapters", "kind", "le"]),
                          _LABEL_VALUES, max_size=4)


@st.composite
def _sample_line(draw) -> str:
    labels = draw(_LABELS)
    text = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return f"{draw(st.sampled_from(_FAMILIES))}{{{text}}} {draw(_NUMBERS)}"


_PAGES = st.one_of(
    st.lists(_sample_line(), max_size=40).map("\n".join),
    st.binary(max_size=2000).map(lambda b: b.decode("latin-1")),
    st.builds(lambda lines, base: base + "\n".join(lines), st.lists(_sample_line(), max_size=20),
              st.sampled_from([page(), page(waiting=3), ""])))


@pytest.mark.parametrize("config", ["kvgate", "default"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                      HealthCheck.too_slow])
@pytest.mark.slow
@given(pages=st.lists(_PAGES, min_size=1, max_size=4))
def test_any_page_leaves_the_other_endpoint_picked(config, pages):
    pool = Pool(KVGATE_PROFILE_YAML if config == "kvgate" else None)
    try:
        pool.serve(A, page(waiting=2))
        for text in pages:
            pool.serve(B, text)
            assert pool.pick() in (A, B)
            pool.serve(A, page(waiting=2, queries=1000.0 + len(text)))
            assert pool.pick() in (A, B)
        for address in (A, B):
            m = pool.layer.metrics(address)
            for value in (m.kv_cache_usage, m.step_age_s, m.prefill_tokens_per_s, m.prefix_cache_queries):
                assert value is None or math.isfinite(value)
    finally:
        pool.close()


def test_what_a_page_cost_its_endpoint_is_exported(pool):
    from prometheus_client import generate_latest

    from kvgate.epp.metrics import EppMetrics

    metrics = EppMetrics()
    metrics.watch(pool.director)
    pool.serve(A, page())
    pool.serve(B, page(usage=7, age="+Inf"))
    pool.layer._collectors[B].on_answer(0, b"", TimeoutError("no answer in 1.0s"))
    pool.scheduler.quarantine(B, OverflowError("x"), "scheduling")
    metrics.gauges.publish(force=True)
    text = generate_latest(metrics.registry).decode()
    assert (f'kvgate_epp_endpoint_metric_values_rejected_total{{endpoint="{B}",metric="vllm:kv_cache_usage_perc",'
            f'reason="out_of_range"}} 1.0') in text
    assert (f'kvgate_epp_endpoint_metric_values_rejected_total{{endpoint="{B}",'
            f'metric="kvgate:engine_step_age_seconds",reason="non_finite"}} 1.0') in text
    assert f'kvgate_epp_endpoint_scrape_failures_total{{endpoint="{B}",reason="timeout"}} 1.0' in text
    assert f'kvgate_epp_endpoint_scheduling_faults_total{{endpoint="{B}"}} 1.0' in text
    assert f'kvgate_epp_endpoint_scrape_cpu_seconds_total{{endpoint="{B}"}} ' in text
    assert f'endpoint="{A}",metric' not in text


class _HookFailsOn(framework.Scorer):
    """Scores `bad` best, then fails in its pick hook on it (the data a hook reads, not the scorer's)."""

    type_name = "hook-fails-on"

    def __init__(self, bad: str) -> None:
        super().__init__()
        self.bad = bad
        self.recorded: list[str] = []

    def score(self, req, endpoints, cycle=None):
        return [1.0 if e.address == self.bad else 0.5 for e in endpoints]

    def pre_request(self, req, endpoint, cycle=None):
        if endpoint.address == self.bad:
            raise ValueError("cannot convert float NaN to integer")
        self.recorded.append(endpoint.address)


@pytest.mark.parametrize("answers", [0, 1], ids=["with-fallbacks", "one-endpoint"])
def test_a_pick_hook_failing_on_the_picked_endpoint_picks_again_without_it(answers):
    """The next endpoint of the answer takes its place; an answer of one endpoint is decided again without it."""
    layer = Datalayer()
    layer.set_endpoints([Endpoint(A), Endpoint(B)])
    for c in layer._collectors.values():
        c.metrics, c.scrapes = EndpointMetrics(updated_at=time.monotonic()), 1
    scorer = _HookFailsOn(B)
    scheduler = Scheduler(SchedulerConfig([SchedulingProfile("p", scorers=[WeightedScorer(scorer, 1.0)],
                                                             picker=MaxScorePicker(answers))]))
    director = Director(Datastore(), layer, scheduler, Admission(), seed=1)
    assert [e.address for e in director.pick(request(request_id="r1"))] == [A]  # B scored best; its hook failed
    assert scheduler.quarantined() == [B] and scorer.recorded == [A]
    assert director.pick(request(request_id="r2"))[0].address == A  # B sits out
