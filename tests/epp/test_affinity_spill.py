"""The affinity filter's spill rule (spillShare): a prefix whose traffic outgrows its warm endpoints gets one more."""

from types import SimpleNamespace

import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.bench.routing.runner import affinity_spills
from kvgate.epp.metrics import EndpointGauges
from kvgate.epp.scheduling.config import ConfigError, parse_config
from kvgate.epp.scheduling.framework import CycleState, Scheduler
from kvgate.epp.scheduling.kv_fit import KV_ROOM
from kvgate.epp.scheduling.plugins import create_plugin
from kvgate.epp.scheduling.plugins._prefix_rates import MIN_REQUESTS, PrefixRates, prefix_key
from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState, LLMRequest
from tests.epp.helpers import state
from tests.epp.test_load_plugins import addresses, config, decide, warmed

SYSTEM = "You answer for the harbour office of a small town by the sea. " * 10  # 620 characters


def tenant_prompt(tenant: int, user: int, question: str = "When is high tide today?") -> str:
    """A tenant's system prompt (its first ~87% of the prompt, as in the bench's multi-tenant shapes), then its
    user's short part."""
    return f"tenant {tenant:02d}: {SYSTEM}" + f" user {user}: {question}"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_prefix_key_groups_a_tenants_requests_not_a_conversations_turns():
    a = prefix_key(tenant_prompt(1, 1), 0.8)
    assert a is not None
    assert prefix_key(tenant_prompt(1, 2), 0.8) == a  # another user of the tenant
    assert prefix_key(tenant_prompt(1, 3, "And when is low tide, and is the ferry running?"), 0.8) == a  # ±9% long
    assert prefix_key(tenant_prompt(2, 1), 0.8) != a
    shared = "You are a helpful assistant. " * 14  # 406 characters every conversation starts with
    turns = [shared + f"conversation {c}: " + "so much was said before. " * 40 for c in range(3)]
    assert len({prefix_key(t, 0.8) for t in turns}) == 3  # each warm only for its own history: keys of its own
    assert prefix_key("short prompt", 0.8) is None


def test_prefix_rates_share_decays_and_waits_for_enough_requests():
    clock = Clock()
    rates = PrefixRates(window_s=10.0, clock=clock, max_keys=8)
    shares = []
    for i in range(200):
        clock.now += 0.06
        shares.append(rates.add(1 if i % 5 < 2 else 100 + i % 3))  # key 1: 40% of the requests
    assert shares[0] == 0.0 and shares[int(MIN_REQUESTS) - 10] == 0.0  # too few requests to say yet
    assert shares[150] == 0.0  # enough requests, but not a whole window of them yet (9 s of 10)
    assert shares[195] == pytest.approx(0.4, abs=0.05)  # a request of key 1
    for i in range(400):  # 24 s more, key 1 gone quiet
        clock.now += 0.06
        rates.add(None)
    assert rates.add(1) < 0.1
    for key in range(20):
        rates.add(key)
    assert len(rates) == 8  # bounded: the least recently seen keys go first


def spill_filter(share=1.25, endpoints=4):
    clock = Clock()
    text = config("type: prefix-cache-scorer", "type: prefix-cache-affinity-filter\n  parameters: "
                  f"{{explorationProbability: 0, loadTolerance: 4, spillShare: {share}}}")
    scheduler = Scheduler(parse_config(text).scheduler)
    f = scheduler.plugins_of_type("prefix-cache-affinity-filter")[0]
    f._rates.clock = clock
    states = [state(f"{c}:1") for c in "abcd"[:endpoints]]
    return scheduler, f, states, clock


def traffic(scheduler, f, states, hot_share: float, n: int = 200) -> None:
    """n requests through the filter over a little more than its rates' window (shares count from then on),
    `hot_share` of them tenant 0's, the rest spread over eleven others."""
    if not isinstance(f._rates.clock, Clock):
        f._rates.clock = Clock()
    hot_every = round(1 / hot_share)
    for i in range(n):
        f._rates.clock.now += 1.05 * f._rates.window_s / n
        prompt = tenant_prompt(0 if i % hot_every == 0 else 1 + i % 11, i % 4)
        decide(scheduler, f.filter, LLMRequest(f"t{i}", "m", "m", prompt), states)


def test_a_prefix_past_its_share_spills_to_a_cold_endpoint_once():
    scheduler, f, states, _ = spill_filter()
    hot = tenant_prompt(0, 1)
    warmed(scheduler, states, {"a:1": hot})
    traffic(scheduler, f, states, hot_share=0.5)  # 2 replicas' fair share, over 1.25: two homes
    spilled = decide(scheduler, f.filter, LLMRequest("h1", "m", "m", hot), states, {"a:1": 50})
    assert addresses(spilled) == ["b:1", "c:1", "d:1"]
    assert f.stats() == {"spills": 1, "spills_without_room": 0}
    # where the spill went is warm too (the prefix scorer's record of the pick): both homes kept, no more spills
    warmed(scheduler, states, {"c:1": hot})
    both = decide(scheduler, f.filter, LLMRequest("h2", "m", "m", hot), states, {"a:1": 50})
    assert addresses(both) == ["a:1", "c:1"]
    assert f.stats() == {"spills": 1, "spills_without_room": 0}


def test_no_spill_under_the_share_on_an_idle_home_or_when_off():
    scheduler, f, states, _ = spill_filter()
    hot = tenant_prompt(0, 1)
    warmed(scheduler, states, {"a:1": hot})
    traffic(scheduler, f, states, hot_share=0.25)  # one replica's fair share: under 1.25 of it, one home is enough
    assert addresses(decide(scheduler, f.filter, LLMRequest("h", "m", "m", hot), states, {"a:1": 50})) == ["a:1"]
    scheduler, f, states, _ = spill_filter()
    warmed(scheduler, states, {"a:1": hot})
    traffic(scheduler, f, states, hot_share=0.5)
    assert addresses(decide(scheduler, f.filter, LLMRequest("h", "m", "m", hot), states)) == ["a:1"]  # home idle
    off = create_plugin("prefix-cache-affinity-filter", {"explorationProbability": 0})
    off.inputs = dict(f.inputs)  # reads the profile's prefix match
    assert off._rates is None
    for i in range(200):
        assert addresses(decide(scheduler, off.filter, LLMRequest(f"o{i}", "m", "m", hot), states, {"a:1": 50})) == [
            "a:1"]


def test_the_scheduler_serves_a_hot_prefix_from_two_endpoints_not_all():
    """Through a whole profile (the approximate prefix scorer records each pick): the hot tenant spills once, then
    stays on its two homes, balanced between them by the queue."""
    text = config("type: prefix-cache-scorer", "type: prefix-cache-affinity-filter\n  parameters: "
                  "{explorationProbability: 0, spillShare: 1.25}", "type: queue-scorer", "type: max-score-picker",
                  profile=["prefix-cache-affinity-filter", "prefix-cache-scorer", "queue-scorer", "max-score-picker"])
    scheduler = Scheduler(parse_config(text).scheduler)
    f = scheduler.plugins_of_type("prefix-cache-affinity-filter")[0]
    states = [state(f"{c}:1") for c in "abcd"]
    warmed(scheduler, states, {"a:1": tenant_prompt(0, 0)})
    traffic(scheduler, f, states, hot_share=0.5)
    served = []
    for i in range(40):  # each pick a new scrape: the queues follow what each endpoint was given; a stays busier
        states = [state(f"{c}:1", queue=served.count(f"{c}:1"), tokens=20 if c == "a" else 0) for c in "abcd"]
        request, cycle = LLMRequest(f"h{i}", "m", "m", tenant_prompt(0, i % 4)), CycleState()
        (picked,) = scheduler.schedule(request, states, cycle)
        scheduler.on_picked(request, picked, cycle)
        served.append(picked.address)
    assert f.stats() == {"spills": 1, "spills_without_room": 0}
    homes = set(served)
    assert len(homes) == 2 and "a:1" in homes
    assert min(served.count(h) for h in homes) >= 10
    assert scheduler.stats()["affinity"] == {"spills": 1, "spills_without_room": 0}
    gauges = EndpointGauges(SimpleNamespace(states=lambda: [], datalayer=SimpleNamespace(staleness=2.0, endpoint_counts=list,
                                                                           stats=lambda: {"scrapes": 0}),
                                            scheduler=scheduler))
    gauges.publish(force=True)
    registry = CollectorRegistry()
    registry.register(gauges)
    page = generate_latest(registry).decode()
    assert "kvgate_epp_affinity_spills_total 1.0" in page
    assert "kvgate_epp_affinity_spills_without_room_total 0.0" in page
    families = list(text_string_to_metric_families(page))
    assert affinity_spills(families) == 1  # what the bench's result file records
    assert affinity_spills(families, "kvgate_epp_affinity_spills_without_room") == 0


def kv_state(address: str, tokens: int) -> EndpointState:
    return EndpointState(Endpoint(address), EndpointMetrics(num_kv_blocks=tokens // 16, kv_block_size=16,
                                                            updated_at=time.monotonic()), stale=False)


def fit_profile(spill_fit: bool = True):
    """The approximate prefix scorer, the spilling affinity filter and the group balance with its fit check, over
    four endpoints of 256 tokens of KV: one tenant's prompt (~170 tokens) fits on an endpoint alone, not beside
    another's."""
    fit = str(spill_fit).lower()
    text = config("type: prefix-cache-scorer", "type: prefix-cache-affinity-filter\n  parameters: "
                  f"{{explorationProbability: 0, loadTolerance: 4, spillShare: 1.25, spillFit: {fit}}}",
                  "type: prefix-group-balance-scorer\n  parameters: {balanceBy: tokens, fitKvCapacity: 1}")
    scheduler = Scheduler(parse_config(text).scheduler)
    f = scheduler.plugins_of_type("prefix-cache-affinity-filter")[0]
    balance = scheduler.plugins_of_type("prefix-group-balance-scorer")[0]
    states = [kv_state(f"{c}:1", 256) for c in "abcd"]
    warmed(scheduler, states, {"a:1": tenant_prompt(0, 1)})  # the hot tenant's home, its group recorded there
    for tenant, address in ((5, "b:1"), (6, "c:1")):
        balance.pre_request(LLMRequest(f"g{tenant}", "m", "m", tenant_prompt(tenant, 0)), kv_state(address, 256))
    traffic(scheduler, f, states, hot_share=0.5)
    return scheduler, f, balance, states


def test_a_spill_goes_only_where_the_copy_fits():
    """spillFit (default): the spill skips cold endpoints whose groups leave no room for the prefix (b and c), and
    where none has room the request is not spilled — the sticky rule decides, and the miss is counted."""
    scheduler, f, balance, states = fit_profile()
    assert f.inputs[KV_ROOM] == balance.name  # linked by the profile
    hot = tenant_prompt(0, 1)
    assert addresses(decide(scheduler, f.filter, LLMRequest("h1", "m", "m", hot), states, {"a:1": 50})) == ["d:1"]
    assert f.stats() == {"spills": 1, "spills_without_room": 0}
    balance.pre_request(LLMRequest("g7", "m", "m", tenant_prompt(7, 0)), states[3])  # d serves a group now
    assert addresses(decide(scheduler, f.filter, LLMRequest("h2", "m", "m", hot), states, {"a:1": 50})) == ["a:1"]
    assert f.stats() == {"spills": 1, "spills_without_room": 1}
    scheduler, anywhere, _, states = fit_profile(spill_fit=False)
    assert KV_ROOM not in anywhere.inputs
    assert addresses(decide(scheduler, anywhere.filter, LLMRequest("h1", "m", "m", hot), states, {"a:1": 50})) == [
        "b:1", "c:1", "d:1"]


def test_the_kv_room_comes_from_one_fit_check():
    """No fit check in the profile: the spill goes anywhere; two: a config error naming them (only where a
    spilling filter asks)."""
    plain = config("type: prefix-cache-scorer", "type: prefix-cache-affinity-filter\n  parameters: {spillShare: 1}")
    f = Scheduler(parse_config(plain).scheduler).plugins_of_type("prefix-cache-affinity-filter")[0]
    assert KV_ROOM not in f.inputs
    two = ["type: prefix-cache-scorer",
           "name: fit-a\n  type: prefix-group-balance-scorer\n  parameters: {fitKvCapacity: 1}",
           "name: fit-b\n  type: prefix-group-balance-scorer\n  parameters: {fitKvCapacity: 1}"]
    parse_config(config(*two, "type: prefix-cache-affinity-filter"))  # not spilling: nothing to choose
    with pytest.raises(ConfigError, match="'prefix-cache-affinity-filter' reads kv-room, which several plugins of this "
                                          "profile produce .fit-a, fit-b.: keep fitKvCapacity on one"):
        parse_config(config(*two, "type: prefix-cache-affinity-filter\n  parameters: {spillShare: 1}"))


@pytest.mark.parametrize("parameters, message", [
    ({"spillShare": -1}, "spillShare must be in"),
    ({"spillShare": float("nan")}, "spillShare must be in"),
    ({"spillWindowSeconds": 0}, "spillWindowSeconds must be in"),
    ({"spillWindowSeconds": 1e9}, "spillWindowSeconds must be in"),
    ({"spillFit": "yes"}, "spillFit"),
])
def test_spill_parameters_are_checked(parameters, message):
    with pytest.raises(ValueError, match=message):
        create_plugin("prefix-cache-affinity-filter", parameters)


def test_kvgates_profile_spills_only_where_the_copy_fits():
    """kvgate's profile spills a hot prefix (σ 1.25) and asks its group balance's fit check first; kvgate-no-spill
    and kvgate-spill-anywhere are the bench's configurations without each."""
    from kvgate.bench.routing.configurations import CONFIGURATIONS
    from kvgate.epp.scheduling.config import KVGATE_PROFILE_YAML

    def affinity(text):
        scheduler = Scheduler(parse_config(text).scheduler)
        return (scheduler.plugins_of_type("prefix-cache-affinity-filter")[0],
                scheduler.plugins_of_type("prefix-group-balance-scorer")[0])

    f, balance = affinity(KVGATE_PROFILE_YAML)
    assert f.spill_share == 1.25 and f.inputs[KV_ROOM] == balance.name and balance.produces == (KV_ROOM,)
    configs = {c.name: c for c in CONFIGURATIONS}
    assert affinity(configs["kvgate-no-spill"].epp_config)[0].spill_share == 0
    anywhere, _ = affinity(configs["kvgate-spill-anywhere"].epp_config)
    assert anywhere.spill_share == 1.25 and KV_ROOM not in anywhere.inputs
