"""The group balance eviction-aware (evictionAware): a group whose prefix no cache holds any longer counts at its old
home like any group there, so its next cold start goes to the least loaded endpoint, not back to the home that could
not keep it; a group whose prefix is still resident is not moved."""

import time

import pytest

from kvgate.bench.routing.configurations import BY_NAME
from kvgate.epp.scheduling.config import parse_config
from kvgate.epp.scheduling.framework import Scheduler
from kvgate.epp.scheduling.plugins import create_plugin
from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState, LLMRequest
from tests.epp.test_affinity_spill import tenant_prompt
from tests.epp.test_load_plugins import config, decide


def kv_state(address: str, blocks: int = 64) -> EndpointState:
    m = EndpointMetrics(num_kv_blocks=blocks, kv_block_size=16, updated_at=time.monotonic())
    return EndpointState(Endpoint(address), m, stale=False)


def balance(aware: bool, fit: float = 0.0):
    text = config("type: prefix-cache-scorer", "type: prefix-group-balance-scorer\n  parameters: "
                  f"{{balanceBy: tokens, evictionAware: {str(aware).lower()}, fitKvCapacity: {fit}}}")
    scheduler = Scheduler(parse_config(text).scheduler)
    return scheduler, scheduler.plugins_of_type("prefix-group-balance-scorer")[0]


def evicted_at_a(scheduler, scorer, states):
    """Tenant 0 was served on a, tenant 1 (a shorter prompt) on b; then a's cache dropped tenant 0's prompt (the
    prefix index forgets a: a restart, or every block evicted)."""
    scheduler.on_picked(LLMRequest("t0", "m", "m", tenant_prompt(0, 1)), states[0])
    scheduler.on_picked(LLMRequest("t1", "m", "m", tenant_prompt(1, 1, "Tides?")), states[1])
    scheduler.plugins_of_type("prefix-cache-scorer")[0].remove_endpoint("a:1")


@pytest.mark.parametrize("aware, preferred", [(False, "a:1"), (True, "b:1")])
def test_a_group_its_home_evicted_counts_there_like_any_group(aware, preferred):
    """Without evictionAware the balance leaves tenant 0's footprint out at a, its old home — a looks empty and the
    group goes back there; eviction-aware, a carries tenant 0's footprint as b carries tenant 1's, and b (the smaller
    one) is the least loaded."""
    scheduler, scorer = balance(aware)
    states = [kv_state("a:1"), kv_state("b:1")]
    evicted_at_a(scheduler, scorer, states)
    request = LLMRequest("r", "m", "m", tenant_prompt(0, 2))
    scores = decide(scheduler, scorer.score, request, states)
    assert [s.address for s, score in zip(states, scores) if score == 1.0] == [preferred]


def test_the_fit_check_counts_the_evicted_group_at_its_old_home_too():
    """64 blocks of 16 (1024 tokens) at φ 0.2: ~205 tokens, one tenant's prompt. Eviction-aware, a still serves tenant
    0's footprint, so a second copy does not fit there; b's tenant 1 leaves no room either: every candidate is kept."""
    for aware, kept in ((False, ["a:1"]), (True, ["a:1", "b:1"])):
        scheduler, scorer = balance(aware, fit=0.2)
        states = [kv_state("a:1"), kv_state("b:1")]
        evicted_at_a(scheduler, scorer, states)
        request = LLMRequest("r", "m", "m", tenant_prompt(0, 2))
        assert [s.address for s in decide(scheduler, scorer.filter, request, states)] == kept, aware


def test_a_resident_group_is_scored_as_before():
    """Warm somewhere: the balance is neutral whatever evictionAware says (the prefix scorers keep it)."""
    for aware in (False, True):
        scheduler, scorer = balance(aware)
        states = [kv_state("a:1"), kv_state("b:1")]
        scheduler.on_picked(LLMRequest("t0", "m", "m", tenant_prompt(0, 1)), states[0])
        scores = decide(scheduler, scorer.score, LLMRequest("r", "m", "m", tenant_prompt(0, 2)), states)
        assert list(scores) == [0.5, 0.5]


def test_eviction_aware_is_a_checked_parameter_and_off_in_kvgates_profile():
    with pytest.raises(ValueError, match="evictionAware"):
        create_plugin("prefix-group-balance-scorer", {"evictionAware": "yes"})

    def group_balance(name):
        return Scheduler(parse_config(BY_NAME[name].epp_config).scheduler).plugins_of_type(
            "prefix-group-balance-scorer")[0]

    assert not group_balance("kvgate").eviction_aware
    assert group_balance("kvgate-evict-aware").eviction_aware
