"""prefill-interference-scorer: the delay a request's prefill puts on the other requests of each candidate."""

import time

import numpy as np
import pytest

from kvgate.epp.scheduling.config import ConfigError, parse_config
from kvgate.epp.scheduling.framework import CycleState, Scheduler
from kvgate.epp.scheduling.live_load import LoadTracker
from kvgate.epp.scheduling.plugins import create_plugin
from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState, LLMRequest
from tests.epp.test_load_plugins import PROMPT, config, warmed
from tests.epp.helpers import request

SCORER = "type: prefill-interference-scorer\n  parameters: {windowSeconds: 10}"


def ep(address, *, running=0, waiting=0, rate=None, kv_blocks=512):
    m = EndpointMetrics(running_requests=running, waiting_queue_size=waiting, prefill_tokens_per_s=rate,
                        prefill_rate_timed=rate is not None, updated_at=time.monotonic(), kv_block_size=16,
                        num_kv_blocks=kv_blocks)
    return EndpointState(Endpoint(address), m, stale=False)


def scorer_with_prefix(states, holds, clock=time.monotonic):
    """(scheduler, scorer): an approximate prefix scorer as the source, `holds` warmed into it (one pick each)."""
    scheduler = Scheduler(parse_config(config("type: prefix-cache-scorer", SCORER)).scheduler)
    scorer = scheduler.plugins_of_type("prefill-interference-scorer")[0]
    scorer.clock = clock
    warmed(scheduler, states, holds)
    return scheduler, scorer


def test_harm_is_the_prefill_time_times_the_requests_held_and_arriving():
    """PROMPT is 160 tokens: a caches all of it, b 64, c none. harm = T × (n + λT/2), T = uncached / rate."""
    states = [ep("a:1", running=9, rate=1000), ep("b:1", running=2, waiting=1, rate=1000), ep("c:1", rate=2000)]
    now = [50.0]
    _, scorer = scorer_with_prefix(states, {"a:1": PROMPT, "b:1": PROMPT[:256] + "x" * 384}, lambda: now[0])
    scorer.capacity_shares = False  # the formula itself (c is 2x faster: its share is tested below)
    for _ in range(40):  # 40 picks in the 10 s window: λ(c) = 4/s; a and b had one each (warming): 0.1/s
        scorer.pre_request(request(PROMPT), states[2], None)
    cycle = CycleState(LoadTracker().view(states))
    t_b, t_c = 96 / 1000, 160 / 2000
    harm = scorer.harm(request(PROMPT), states, cycle)
    assert harm == pytest.approx([0.0, t_b * (3 + 0.1 * t_b / 2), t_c * (0 + 4 * t_c / 2)])
    scores = scorer.score(request(PROMPT), states, cycle)
    assert scores == pytest.approx(1 - (harm - harm.min()) / harm.max())
    assert scores[0] == 1.0 and scores[1] == 0.0  # a computes nothing: it holds nobody up however busy it is
    now[0] += 10.5  # the window passed: c's arrivals are forgotten
    assert scorer.harm(request(PROMPT), states, cycle)[2] == 0.0


def test_picks_since_the_scrape_count_as_held_and_scores_stay_proportional():
    """n(e) adds this EPP's picks the scrape has not seen; two candidates a few percent apart score a few percent
    apart (scaled by the largest harm, not min-max)."""
    states = [ep("a:1", running=50), ep("b:1", running=48)]
    scheduler, scorer = scorer_with_prefix(states, {})
    tracker = LoadTracker()
    cycle = CycleState(tracker.view(states))
    scores = scorer.score(request(PROMPT), states, cycle)
    assert scores == pytest.approx([1 - 2 / 50, 1.0])  # no rates timed: uncached × held, in tokens
    for i in range(4):
        tracker.add(LLMRequest(f"x{i}", "m", "m", ""), "b:1", tokens=10, prompt_tokens=5)
    assert scorer.score(request(PROMPT), states, CycleState(tracker.view(states))) == pytest.approx([1.0, 1 - 2 / 52])
    idle = [ep("a:1"), ep("b:1")]
    assert list(scorer.score(request(PROMPT), idle, CycleState(LoadTracker().view(idle)))) == [1.0, 1.0]


def hot_pool(config_name: str):
    """A bench profile over a: one hot tenant's stream (12 held, 10 picks/s, all cached) and b, c: two quiet tenants
    each (2 held). By footprint a carries the least, so the group balance alone gives a new tenant to a."""
    from kvgate.bench.routing.configurations import BY_NAME

    text = BY_NAME[config_name].epp_config
    scheduler = Scheduler(parse_config(text.replace("precise-prefix-cache-scorer", "prefix-cache-scorer")).scheduler)
    states = [ep("a:1", running=12, rate=5000), ep("b:1", running=2, rate=5000), ep("c:1", running=2, rate=5000)]
    quiet = {f"{s.address}/{k}": f"Quiet tenant {s.address} {k}. " * 40 for s in states[1:] for k in range(2)}
    for key, prompt in quiet.items():
        scheduler.on_picked(request(prompt), states[1] if key.startswith("b") else states[2])
    for i in range(100):  # the hot tenant: 100 picks in the last 10 s
        scheduler.on_picked(request(PROMPT, request_id=f"hot{i}"), states[0])
    return scheduler, states


def cold_picks(scheduler, states, n=12) -> list[str]:
    picked = []
    for i in range(n):
        cold = request(f"Tenant {i} arrives cold. " * 30, request_id=f"cold{i}")
        best = scheduler.schedule(cold, states)[0]
        scheduler.on_picked(cold, best)
        picked.append(best.address)
    return picked


def test_a_cold_prompt_leaves_the_busy_replica_a_warm_one_stays():
    """With the scorer (kvgate's profile) a new tenant's cold prompt goes to b or c, not to the replica a hot tenant
    keeps busy; the hot tenant's own cached request still goes to a. Without it the first cold tenant goes to a."""
    scheduler, states = hot_pool("kvgate-no-interference")
    assert cold_picks(scheduler, states)[0] == "a:1"
    scheduler, states = hot_pool("kvgate")
    assert "a:1" not in cold_picks(scheduler, states)
    assert scheduler.schedule(request(PROMPT, request_id="hot"), states)[0].address == "a:1"


def test_peers_picks_count_and_memory_is_bounded():
    scorer = create_plugin("prefill-interference-scorer", {"maxPicksPerEndpoint": 5, "windowSeconds": 2})
    now = [0.0]
    scorer.clock = lambda: now[0]
    a = ep("a:1")
    assert scorer.share_pick(request(PROMPT), a, None) == []
    for i in range(8):
        scorer.peer_pick(f"p{i}", "a:1", [] if i % 2 else [1, 2, 3])  # the content is not read
    assert len(scorer._picks["a:1"]) == 5 and scorer.arrival_rate("a:1", now[0]) == 2.5
    scorer.remove_endpoint("a:1")
    assert scorer.arrival_rate("a:1", now[0]) == 0.0 and "a:1" not in scorer._picks


@pytest.mark.parametrize("params, message", [
    ("{windowSeconds: 0}", "windowSeconds"),
    ("{maxPicksPerEndpoint: 0}", "maxPicksPerEndpoint"),
    ("{decay: 1}", "unknown parameter"),
    ("{prefixScorer: nope}", "nope"),
    ("{capacityShares: 1}", "capacityShares"),
])
def test_bad_parameters_are_named(params, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(config("type: prefix-cache-scorer", f"type: prefill-interference-scorer\n  parameters: {params}"))


def test_rates_unmeasured_take_the_measured_median():
    from kvgate.epp.scheduling.plugins.prefill_interference_scorer import _seconds_per_token

    got = _seconds_per_token([ep("a:1", rate=1000), ep("b:1"), ep("c:1", rate=3000), ep("d:1", rate=2000)])
    assert got == pytest.approx([1 / 1000, 1 / 2000, 1 / 3000, 1 / 2000])
    assert np.isnan(_seconds_per_token([ep("a:1"), ep("b:1")])).all()


def test_on_mixed_hardware_harm_counts_beyond_each_replicas_capacity_share():
    """At the placement the group balance aims for, a replica with half the KV holds half the requests, and one half
    as fast holds as many for twice as long: harm ∝ c(e) / s(e)². The scorer weighs harm × s² / c — only what is
    beyond the shares moves a prompt — and in a uniform pool that factor is 1."""
    plain = create_plugin("prefill-interference-scorer", {"capacityShares": False})
    shared = create_plugin("prefill-interference-scorer")
    for scorer in (plain, shared):
        scorer.clock = lambda: 0.0

    def harms(states):
        cycle = CycleState(LoadTracker().view(states))
        return plain.harm(request(PROMPT), states, cycle), shared.harm(request(PROMPT), states, cycle)

    # cards of two memory sizes, as fast: the big one holds twice the requests of the small one, as meant
    kv = [ep("big:1", running=8, rate=4000, kv_blocks=512), ep("small:1", running=4, rate=4000, kv_blocks=256)]
    without, with_shares = harms(kv)
    assert without[0] == pytest.approx(2 * without[1])  # plain harm: the big card looks twice as busy
    assert with_shares[0] == pytest.approx(with_shares[1])  # beyond its share: not at all
    # ... and when the big one holds more than its share, it still counts
    assert harms([ep("big:1", running=12, rate=4000), ep("small:1", running=4, rate=4000, kv_blocks=256)])[1][0] \
        == pytest.approx(1.5 * with_shares[1])
    # two speeds, as much KV: the slow one holds as many requests (half the arrivals, each twice as long) and its
    # prefill takes twice as long
    speed = [ep("fast:1", running=6, rate=4000), ep("slow:1", running=6, rate=2000)]
    without, with_shares = harms(speed)
    assert without[1] == pytest.approx(2 * without[0]) and with_shares[1] == pytest.approx(with_shares[0])
    # a uniform pool (rates within 1.25x count as one speed): the factor is exactly 1
    uniform = [ep("a:1", running=9, rate=4000), ep("b:1", running=3, rate=3600), ep("c:1", running=1, rate=4200)]
    without, with_shares = harms(uniform)
    assert list(with_shares) == list(without)
