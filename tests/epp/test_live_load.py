"""The herd fix: every decision sees this EPP's exact in-flight load, within one scrape round's snapshot."""

import time
from collections import Counter

import numpy as np

from kvgate.epp.admission import Admission
from kvgate.epp.datalayer import Datalayer
from kvgate.epp.datastore import Datastore
from kvgate.epp.director import Director
from kvgate.epp.scheduling.config import default_config, parse_config
from kvgate.epp.scheduling.framework import CycleState, Scheduler
from kvgate.epp.scheduling.live_load import LoadTracker
from kvgate.epp.types import Endpoint, EndpointMetrics, LLMRequest
from tests.epp.helpers import state

ADDRESSES = [f"10.0.0.{i}:8000" for i in range(1, 5)]


def one_round_director(config=None, addresses=ADDRESSES):
    """A director over a real (unstarted) Datalayer whose scrape round never ends: every decision of a test
    shares one round snapshot, as a burst within 50 ms does."""
    layer = Datalayer(interval=3600.0, staleness=3600.0)
    layer.set_endpoints([Endpoint(a) for a in addresses])
    for a in addresses:  # scraped once, equal numbers
        c = layer._collectors[a]
        c.metrics = EndpointMetrics(waiting_queue_size=3, running_requests=8, kv_cache_usage=0.3,
                                    updated_at=time.monotonic())
        c.scrapes = 1
    scheduler = Scheduler((config or default_config()).scheduler)
    return Director(Datastore(), layer, scheduler, Admission(), seed=1), layer


def burst(director, n, prefix="q"):
    picked = []
    for i in range(n):
        # distinct prompts (their first 64-character block differs): no prefix-cache affinity between them
        request = LLMRequest(request_id=f"{prefix}{i}", model="m", target_model="m",
                             prompt=f"{prefix}{i:06d} " * 20, max_tokens=10)
        picked.append((request, director.pick(request)[0].address))
    return picked


def test_a_burst_within_one_round_spreads_within_one_under_the_default_config():
    director, layer = one_round_director()
    snapshot = layer.snapshot()
    picked = burst(director, 401)
    assert layer.snapshot() is snapshot  # one round: the same frozen snapshot served every decision
    counts = Counter(a for _, a in picked)
    assert set(counts) == set(ADDRESSES)
    assert max(counts.values()) - min(counts.values()) <= 1, counts


def test_released_requests_leave_the_live_load_and_the_queue_counts_them_no_more():
    director, layer = one_round_director()
    picked = burst(director, 8)
    view = director.load.view(layer.snapshot())
    assert view.requests.sum() == 8 and view.unseen_requests.sum() == 8
    # release everything sent to the first endpoint: it has the shortest effective queue again, alone
    first = ADDRESSES[0]
    for request, address in picked:
        if address == first:
            director.release(request, address)
    i = view.positions[first]
    assert view.requests[i] == 0 and view.tokens[i] == 0 and view.unseen_requests[i] == 0
    others = [view.tokens[view.positions[a]] for a in ADDRESSES[1:]]
    assert all(t == others[0] > 0 for t in others)
    assert director.pick(LLMRequest("next", "m", "m", "zzz " * 30))[0].address == first
    gone = next((r, a) for r, a in picked if a == first)
    assert director.load.release(*gone) is None  # released twice: no double count


def test_a_newer_scrape_sees_what_was_routed_before_it():
    tracker = LoadTracker()
    before = [state("a:1"), state("b:1")]
    request = LLMRequest("r", "m", "m", "x" * 400, max_tokens=50)
    tracker.add(request, "a:1", tokens=150, prompt_tokens=100)
    view = tracker.view(before)
    assert list(view.unseen_requests[:2]) == [1, 0] and list(view.unseen_prompt[:2]) == [100, 0]
    time.sleep(0.002)
    after = [state("a:1"), state("b:1")]  # scraped after the pick: the engine's numbers include the request
    view = tracker.view(after)
    assert list(view.requests[:2]) == [1, 0] and list(view.tokens[:2]) == [150, 0]
    assert list(view.unseen_requests[:2]) == [0, 0] and view.unseen_total == 0
    tracker.release(request, "a:1")
    assert list(view.requests[:2]) == [0, 0] and view.unseen_total == 0
    assert tracker.counts() == {}


def test_token_load_scorer_reads_the_exact_in_flight_tokens():
    config = parse_config("""\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: token-load-scorer
- type: max-score-picker
""")
    director, layer = one_round_director(config, ADDRESSES[:2])
    a, b = ADDRESSES[:2]
    big = LLMRequest("big", "m", "m", "y" * 4000, max_tokens=1000)  # 1000 + 1000 tokens
    first = director.pick(big)[0].address
    other = b if first == a else a
    scorer = director.scheduler.plugins_of_type("token-load-scorer")[0]
    states = director.candidates(None, round_snapshot=True)
    cycle = CycleState(director.load.view(layer.snapshot()))
    scores = dict(zip([s.address for s in states], scorer.score(big, states, cycle)))
    assert scores == {first: 0.0, other: 1.0}
    small = [LLMRequest(f"s{i}", "m", "m", "z" * 400, max_tokens=100) for i in range(9)]  # 200 tokens each
    assert {director.pick(r)[0].address for r in small} == {other}  # 1800 < 2000 tokens
    director.release(big, first)
    assert director.pick(LLMRequest("after", "m", "m", "w" * 40))[0].address == first


def test_a_filtered_candidate_list_maps_onto_the_overlay():
    tracker = LoadTracker()
    states = [state("a:1"), state("b:1"), state("c:1")]
    view = tracker.view(states)
    tracker.add(LLMRequest("r", "m", "m", "x"), "c:1", tokens=7, prompt_tokens=1)
    sub = [states[2], state("z:9"), states[0]]
    assert list(view.column("tokens", sub)) == [7, 0, 0]
    assert np.array_equal(view.column("tokens", states), [0, 0, 7])
    assert np.array_equal(view.column("tokens", list(states)), [0, 0, 7])  # the scheduler's copy of the list


def test_a_burst_of_sheddable_requests_is_shed_once_it_fills_the_queues_within_the_round():
    import pytest

    from kvgate.epp.director import RoutingError
    from kvgate.common.epp_protocol import OBJECTIVE_HEADER

    director, _ = one_round_director()  # every queue scraped at 3; the saturation threshold is 5
    director.datastore.set_policies({"batch": -1}, [])
    sheddable = [LLMRequest(f"s{i}", "m", "m", f"s{i:06d} " * 20, headers={OBJECTIVE_HEADER: "batch"})
                 for i in range(9)]
    for r in sheddable[:8]:
        director.pick(r)  # two per endpoint (the burst spreads): each queue is at 5 now
    with pytest.raises(RoutingError) as err:
        director.pick(sheddable[8])
    assert err.value.status == 429
    director.pick(LLMRequest("critical", "m", "m", "c" * 300))  # priority 0 is never shed


def test_kvgates_profile_shares_a_mixed_pool_by_prefill_speed():
    """A pool of mixed hardware (two replicas prefilling half as fast, as their engines time it): kvgate's profile
    gives the fast ones about twice the work of the slow ones; the same profile in tokens shares it evenly (which
    left the slow replicas' queues growing: `kvgate bench routing --shapes mixed-hardware`), and a uniform pool
    whose timed rates differ by a few percent spreads evenly as before."""
    from kvgate.bench.routing.configurations import BY_NAME
    from kvgate.epp.scheduling.config import KVGATE_PROFILE_YAML

    def shares(profile: str, rates: list[float]) -> list[int]:
        director, layer = one_round_director(parse_config(profile))
        for a, rate in zip(ADDRESSES, rates):
            m = layer._collectors[a].metrics
            m.prefill_tokens_per_s, m.prefill_rate_timed = rate, True
        counts = Counter(a for _, a in burst(director, 300))
        return [counts[a] for a in ADDRESSES]

    fast, slow = 4000.0, 2000.0
    mixed = shares(KVGATE_PROFILE_YAML, [fast, fast, slow, slow])
    assert min(mixed[:2]) > 1.7 * max(mixed[2:]), mixed
    # the profile before the engines' latency model (token-load where predicted-latency is), its loads in tokens
    before = BY_NAME["kvgate-token-load"].epp_config
    in_tokens = before.replace("    loadUnit: seconds\n", "")  # yaml.safe_dump's block style
    assert "loadUnit" not in in_tokens and "token-load-scorer" in in_tokens
    mixed_before = shares(before, [fast, fast, slow, slow])
    assert min(mixed_before[:2]) > 1.7 * max(mixed_before[2:]), mixed_before
    assert max(shares(in_tokens, [fast, fast, slow, slow])) - min(shares(in_tokens, [fast, fast, slow, slow])) <= 2
    uniform = shares(KVGATE_PROFILE_YAML, [4000.0, 3900.0, 4100.0, 4000.0])
    assert max(uniform) - min(uniform) <= 2, uniform
