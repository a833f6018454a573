"""The affinity filter's second home decided from the latency models (secondHome latency): a busy prefix group opens a
second home where a cold start there, plus the delay it puts on that endpoint's requests, costs less than the wait
at home saves; a group with two homes goes to the one predicted to start it sooner; a home not picked for a window
lapses, and one whose cache lost the prompt is forgotten."""

import time

import pytest

from kvgate.bench.routing.configurations import BY_NAME
from kvgate.epp.scheduling.config import ConfigError, parse_config
from kvgate.epp.scheduling.data import PREDICTED_TTFT, PREFILL_HARM
from kvgate.epp.scheduling.framework import Scheduler
from kvgate.epp.scheduling.kv_fit import KV_ROOM
from kvgate.epp.scheduling.plugins import create_plugin
from kvgate.epp.scheduling.plugins._prefix_rates import prefix_key
from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState, LLMRequest
from tests.epp.test_affinity_spill import Clock, tenant_prompt
from tests.epp.test_load_plugins import addresses, config, cycle_for, decide

RATE = 1000.0  # every endpoint prefills 1000 tokens/s, as it times itself: a token of backlog is a millisecond
FILTER = ("type: prefix-cache-affinity-filter\n  parameters: {explorationProbability: 0, loadTolerance: 4, "
          "loadSignal: backlog, secondHome: latency}")
PROFILE = [FILTER, "type: prefix-cache-scorer",
           # the analytic model as the prediction (the engines' models where they publish theirs: the same key)
           "type: predicted-latency-scorer\n  parameters: {learn: false, defaultPrefillTokensPerSecond: 1000, "
           "decodeMsPerRunningRequest: 0}",
           "type: prefill-interference-scorer"]


def ep(address: str, pending: int = 0, running: int = 0) -> EndpointState:
    m = EndpointMetrics(running_requests=running, prefill_tokens_pending=pending, prefill_tokens_per_s=RATE,
                        prefill_rate_timed=True, updated_at=time.monotonic())
    return EndpointState(Endpoint(address), m, stale=False)


def pool(*plugins: str):
    """(scheduler, filter, clock): the profile over a shared clock (the filter's homes and its prefix rates)."""
    scheduler = Scheduler(parse_config(config(*(plugins or PROFILE))).scheduler)
    f = scheduler.plugins_of_type("prefix-cache-affinity-filter")[0]
    clock = Clock()
    f.clock = f._rates.clock = clock
    elapse(f, 32)  # a whole window of the pool's requests: a second home may open from now on
    return scheduler, f, clock


def elapse(f, seconds: float) -> None:
    """`seconds` pass, with the pool's other requests arriving at ~6/s (none of the group's)."""
    for _ in range(round(seconds / 0.16)):
        f.clock.now += 0.16
        f._rates.add(None)


def picked(scheduler, states, address: str, user: int) -> None:
    """Tenant 0's request of `user` was routed to `address` (the prefix scorer and the filter record it)."""
    by_address = {s.address: s for s in states}
    request = LLMRequest(f"pick-{address}-{user}", "m", "m", tenant_prompt(0, user))
    scheduler.on_picked(request, by_address[address], cycle_for(scheduler, request, states))


def ask(scheduler, f, states, user: int = 9) -> list[str]:
    request = LLMRequest(f"ask-{user}", "m", "m", tenant_prompt(0, user))
    return addresses(decide(scheduler, f.filter, request, states))


def test_a_busy_home_opens_a_second_home_where_a_cold_start_and_its_harm_cost_less():
    """a holds tenant 0's system prompt (its user part, ~24 tokens, is new everywhere) and has 400 tokens of backlog:
    its request starts in ~0.42 s there, a cold start of the whole prompt (~0.17 s) on an idle b in less, and it
    holds nobody up there: b is the group's second home. With ten requests running on b and c, the cold prefill
    would delay each of them by as long: the home's wait does not pay for that, and the group stays (the sticky
    rule keeps a: 400 tokens of backlog are within 4 × what the hit saves)."""
    scheduler, f, _ = pool()
    states = [ep("a:1", pending=400), ep("b:1"), ep("c:1")]
    picked(scheduler, states, "a:1", 1)
    assert ask(scheduler, f, states) == ["b:1"]
    assert f.stats()["second_homes_opened"] == 1

    scheduler, f, _ = pool()
    states = [ep("a:1", pending=400), ep("b:1", running=10), ep("c:1", running=10)]
    picked(scheduler, states, "a:1", 1)
    assert ask(scheduler, f, states) == ["a:1"]
    assert f.stats()["second_homes_declined"] == 1 and f.stats()["second_homes_opened"] == 0

    scheduler, f, _ = pool()  # no busier at home than a cold start elsewhere: nothing to weigh, nothing counted
    states = [ep("a:1", pending=100), ep("b:1"), ep("c:1")]
    picked(scheduler, states, "a:1", 1)
    assert ask(scheduler, f, states) == ["a:1"]
    assert f.stats()["second_homes_declined"] == 0 and f.stats()["second_homes_opened"] == 0


def test_no_second_home_before_a_whole_window_has_passed():
    """The KV room knows only the groups picked so far: a cell's first seconds open no second home."""
    scheduler = Scheduler(parse_config(config(*PROFILE)).scheduler)
    f = scheduler.plugins_of_type("prefix-cache-affinity-filter")[0]
    f.clock = f._rates.clock = clock = Clock()
    states = [ep("a:1", pending=400), ep("b:1"), ep("c:1")]
    picked(scheduler, states, "a:1", 1)
    for _ in range(150):  # 24 s of the group's requests: the home stays busy, the first window has not passed
        assert ask(scheduler, f, states) == ["a:1"]
        clock.now += 0.16
    clock.now += 7
    assert ask(scheduler, f, states) == ["b:1"]
    assert f.stats()["second_homes_opened"] == 1 and f.stats()["second_homes_declined"] == 0


def test_the_groups_rate_counts_the_wait_a_second_home_saves_its_next_requests():
    """Two requests running on b and c: the cold start delays them ~0.34 request-seconds, more than the ~0.25 s the
    request itself saves. A group asking ~6 requests a second would send ~0.6 more during the home's ~0.2 s wait,
    each saving about half as much: then it pays."""
    scheduler, f, clock = pool()
    states = [ep("a:1", pending=400), ep("b:1", running=2), ep("c:1", running=2)]
    picked(scheduler, states, "a:1", 1)
    assert ask(scheduler, f, states) == ["a:1"]
    key = prefix_key(tenant_prompt(0, 9), f.affinity_threshold)
    for _ in range(200):  # ~170 decayed requests in the 30 s window: ~5.7/s
        clock.now += 0.05
        f._rates.add(key)
    assert f._rates.rate(key) == pytest.approx(5.7, abs=0.3)
    assert ask(scheduler, f, states, user=10) == ["b:1"]


def test_a_group_with_two_homes_goes_to_the_one_predicted_to_start_it_sooner():
    scheduler, f, _ = pool()
    states = [ep("a:1", pending=300), ep("b:1", pending=100), ep("c:1")]
    picked(scheduler, states, "a:1", 1)
    picked(scheduler, states, "b:1", 2)
    assert ask(scheduler, f, states) == ["b:1"]
    states[0].metrics.prefill_tokens_pending, states[1].metrics.prefill_tokens_pending = 100, 300
    assert ask(scheduler, f, states) == ["a:1"]
    states[1].metrics.prefill_tokens_pending = 100  # a tie: the home opened first
    assert ask(scheduler, f, states) == ["a:1"]


def test_a_cooled_groups_second_home_lapses():
    """b, a home of the group, sees no pick of it for a window: it is a home no more. It still holds the prompt, so
    reopening it costs only the user part's prefill, and the delay that puts on b's fifty running requests (~1.2
    request-seconds) is more than the ~0.1 s the request would save: the group stays on a, where as a home b would
    have been preferred."""
    scheduler, f, clock = pool()
    states = [ep("a:1", pending=100), ep("b:1", running=50), ep("c:1")]
    picked(scheduler, states, "a:1", 1)
    picked(scheduler, states, "b:1", 2)
    assert ask(scheduler, f, states) == ["b:1"]  # both homes: b starts it sooner (its backlog is empty)
    elapse(f, 20)
    picked(scheduler, states, "a:1", 3)
    elapse(f, 15)  # 35 s since b's last pick, 15 since a's
    assert ask(scheduler, f, states) == ["a:1"]
    assert f.stats()["homes_lapsed"] == 1 and f.stats()["second_homes_declined"] == 1


def test_a_home_whose_cache_lost_the_prompt_is_forgotten():
    """The prefix match says b no longer holds the prompt (the KV events' removals): b is no home of the group, and
    its request is weighed as a cold start there."""
    scheduler, f, _ = pool()
    states = [ep("a:1", pending=100), ep("b:1"), ep("c:1")]
    picked(scheduler, states, "a:1", 1)
    picked(scheduler, states, "b:1", 2)
    prefix = scheduler.plugins_of_type("prefix-cache-scorer")[0]
    prefix.remove_endpoint("b:1")  # what the index holds for b is gone
    assert ask(scheduler, f, states) == ["a:1"]  # 0.1 s at home against a cold ~0.17 s on b
    assert f.stats()["homes_evicted"] == 1


def kv_pool(spill_fit: bool = True):
    """The profile with the group balance's fit check, over a, b and c of 512 tokens of KV each, the check at half of
    it (fitKvCapacity 0.5: one tenant's prompt fits, not two, while the prefix index still holds both): a is tenant
    0's home, with 400 tokens of backlog; b idle; c far busier than a."""
    balance = "type: prefix-group-balance-scorer\n  parameters: {balanceBy: tokens, fitKvCapacity: 0.5}"
    fit = FILTER.replace("secondHome: latency", f"secondHome: latency, spillFit: {str(spill_fit).lower()}")
    scheduler, f, clock = pool(fit, *PROFILE[1:], balance)
    assert (KV_ROOM in f.inputs) is spill_fit
    states = [ep("a:1", pending=400), ep("b:1"), ep("c:1", pending=1000)]
    for s in states:
        s.metrics.num_kv_blocks, s.metrics.kv_block_size = 32, 16
    picked(scheduler, states, "a:1", 1)
    return scheduler, f, states


def serves(scheduler, states, address: str, tenant: int) -> None:
    other = LLMRequest(f"other-{tenant}", "m", "m", tenant_prompt(tenant, 0))
    scheduler.on_picked(other, {s.address: s for s in states}[address], cycle_for(scheduler, other, states))


def test_a_second_home_opens_only_where_its_copy_fits_and_is_dropped_once_crowded():
    """With the group balance's fit check (spillFit): b and c, serving tenants 5 and 6, have no room for tenant 0's
    prompt beside theirs, and a second home would evict them at each turn — none opens (counted as a spill without room); with
    b free it opens. When a group comes to b after the copy, the copy no longer fits: b is dropped as a home (never
    the home opened first), and the request weighs b as any cold endpoint again."""
    scheduler, f, states = kv_pool()
    serves(scheduler, states, "b:1", 5)
    serves(scheduler, states, "c:1", 6)
    assert ask(scheduler, f, states) == ["a:1"]
    assert f.stats()["spills_without_room"] == 1 and f.stats()["second_homes_opened"] == 0
    scheduler, f, states = kv_pool(spill_fit=False)
    serves(scheduler, states, "b:1", 5)
    assert ask(scheduler, f, states) == ["b:1"]  # without the fit check the copy goes where it pays

    scheduler, f, states = kv_pool()
    assert ask(scheduler, f, states) == ["b:1"]
    picked(scheduler, states, "b:1", 2)  # the second home's first request
    states[1].metrics.prefill_tokens_pending = 0
    assert ask(scheduler, f, states, user=11) == ["b:1"]  # two homes: b starts it sooner
    serves(scheduler, states, "b:1", 5)  # tenant 5 arrives at b: no room for both
    assert ask(scheduler, f, states, user=12) == ["a:1"]
    assert f.stats()["homes_crowded"] == 1
    assert list(f._home_picks[prefix_key(tenant_prompt(0, 1), f.affinity_threshold)]) == ["a:1"]


def test_second_home_needs_the_latency_and_interference_data_and_is_off_in_kvgates_profile():
    with pytest.raises(ConfigError, match="predicted-ttft-seconds"):
        parse_config(config(FILTER, "type: prefix-cache-scorer", "type: prefill-interference-scorer"))
    with pytest.raises(ConfigError, match="prefill-harm-request-seconds"):
        parse_config(config(FILTER, *PROFILE[1:3]))
    with pytest.raises(ValueError, match="secondHome"):
        create_plugin("prefix-cache-affinity-filter", {"secondHome": "always"})

    def affinity(name):
        return Scheduler(parse_config(BY_NAME[name].epp_config).scheduler).plugins_of_type(
            "prefix-cache-affinity-filter")[0]

    default = affinity("kvgate")
    assert not default.by_latency and default.spill_share == 1.25
    assert PREDICTED_TTFT not in default.inputs and PREFILL_HARM not in default.inputs
    second = affinity("kvgate-second-home")
    assert second.by_latency and second.spill_share == 0
    assert {PREDICTED_TTFT, PREFILL_HARM, KV_ROOM} <= set(second.inputs)
