"""Flow control's queue (epp/flow_control.py): priority, fairness, ordering, bounds, TTL, cancellation — driven with
a pool whose room the test sets, on a real event loop."""

from __future__ import annotations

import asyncio
import random

import pytest

from kvgate.epp.director import RoutingError
from kvgate.epp.flow_config import EDF, FCFS, GLOBAL_STRICT, ROUND_ROBIN, SPF, BandConfig, FlowControlConfig
from kvgate.epp.flow_control import FlowController
from kvgate.epp.types import LLMRequest
from tests.epp.helpers import request


class Pool:
    """The room a saturation detector would report; `routed` counts requests let go and routed."""

    def __init__(self, room: int = 0) -> None:
        self.free = room

    def room(self) -> int:
        return self.free


def flow_request(i, priority=0, flow="a", slo_ms=None) -> LLMRequest:
    """Request i of fairness flow `flow` (with a TTFT objective where slo_ms is given)."""
    headers = {"x-gateway-inference-fairness-id": flow}
    if slo_ms is not None:
        headers["x-slo-ttft-ms"] = str(slo_ms)
    return request("p", request_id=str(i), headers=headers, priority=priority)


def config(**band) -> FlowControlConfig:
    return FlowControlConfig(enabled=True, default_band=BandConfig(**band))


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


class Harness:
    """Requests submitted as tasks; `release(n)` opens room for n and records the order they leave in."""

    def __init__(self, controller: FlowController, pool: Pool) -> None:
        self.fc, self.pool = controller, pool
        self.order: list[str] = []
        self.tasks: dict[str, asyncio.Task] = {}

    def submit(self, request: LLMRequest, size: int = 10) -> asyncio.Task:
        async def run():
            grant = await self.fc.admit(request, size)
            self.order.append(request.request_id)
            self.pool.free -= 1   # routed: the pool's own counts now hold it
            grant.release()
        task = asyncio.get_running_loop().create_task(run())
        self.tasks[request.request_id] = task
        return task

    async def release(self, n: int) -> None:
        self.pool.free += n
        self.fc.wake()
        await settle()


def test_no_queue_while_the_pool_has_room():
    async def main():
        pool = Pool(room=2)
        fc = FlowController(config(), pool.room, poll_s=0.01)
        h = Harness(fc, pool)
        h.submit(flow_request(1))
        h.submit(flow_request(2))
        await settle()
        assert h.order == ["1", "2"] and fc.count == 0
        h.submit(flow_request(3))
        await settle()
        assert h.order == ["1", "2"] and fc.count == 1  # no room: it waits
        await h.release(1)
        assert h.order == ["1", "2", "3"] and fc.count == 0
    asyncio.run(main())


def test_higher_priority_leaves_first():
    async def main():
        pool = Pool()
        fc = FlowController(config(), pool.room, poll_s=0.01)
        h = Harness(fc, pool)
        for i in range(3):
            h.submit(flow_request(f"low{i}", priority=-1))
        h.submit(flow_request("mid", priority=0))
        h.submit(flow_request("high", priority=10))
        await settle()
        await h.release(2)
        assert h.order == ["high", "mid"]
        await h.release(3)
        assert h.order == ["high", "mid", "low0", "low1", "low2"]
    asyncio.run(main())


def test_round_robin_gives_a_flood_and_a_trickle_turns():
    async def main():
        pool = Pool()
        fc = FlowController(config(fairness=ROUND_ROBIN), pool.room, poll_s=0.01)
        h = Harness(fc, pool)
        for i in range(10):
            h.submit(flow_request(f"A{i}", flow="A"))
        for i in range(3):
            h.submit(flow_request(f"B{i}", flow="B"))
        await settle()
        await h.release(8)
        assert h.order == ["A0", "B0", "A1", "B1", "A2", "B2", "A3", "A4"]
    asyncio.run(main())


def test_global_strict_keeps_arrival_order_across_flows():
    async def main():
        pool = Pool()
        fc = FlowController(config(fairness=GLOBAL_STRICT, ordering=FCFS), pool.room, poll_s=0.01)
        h = Harness(fc, pool)
        for i, flow in enumerate("AABAB"):
            h.submit(flow_request(f"{flow}{i}", flow=flow))
        await settle()
        await h.release(5)
        assert h.order == ["A0", "A1", "B2", "A3", "B4"]
    asyncio.run(main())


def test_edf_orders_by_the_requests_ttft_objective():
    async def main():
        pool = Pool()
        fc = FlowController(config(ordering=EDF), pool.room, poll_s=0.01)
        h = Harness(fc, pool)
        h.submit(flow_request("none"))                  # deadline: its TTL (60 s)
        h.submit(flow_request("slow", slo_ms=5000))
        h.submit(flow_request("fast", slo_ms=200))
        await settle()
        await h.release(3)
        assert h.order == ["fast", "slow", "none"]
    asyncio.run(main())


def test_shortest_prompt_first_ages_long_prompts_instead_of_starving_them():
    async def main():
        pool, now = Pool(), [100.0]
        fc = FlowController(config(ordering=SPF, ms_per_prompt_token=2.0), pool.room, poll_s=0.01,
                            clock=lambda: now[0])
        h = Harness(fc, pool)

        async def submit(name: str, chars: int, at: float) -> None:
            now[0] = at
            h.submit(LLMRequest(request_id=name, model="m", target_model="m", prompt="x" * chars))
            await settle()  # queued at `at`
        # keys: arrival + 2 ms per estimated token (characters / 4)
        await submit("long", 8000, 100.0)    # 100 + 4.0 s
        await submit("mid", 2000, 100.5)     # 100.5 + 1.0 s
        await submit("short", 200, 101.0)    # 101 + 0.1 s
        await submit("late", 200, 105.0)     # 105 + 0.1 s: a short prompt 5 s later waits behind "long"
        await h.release(4)
        assert h.order == ["short", "mid", "long", "late"]
    asyncio.run(main())


def test_a_full_band_answers_429_with_retry_after():
    async def main():
        pool = Pool()
        cfg = FlowControlConfig(enabled=True, max_bytes=1000,
                                bands={5: BandConfig(priority=5, max_requests=2)})
        fc = FlowController(cfg, pool.room, poll_s=0.01)
        h = Harness(fc, pool)
        h.submit(flow_request(1, priority=5))
        h.submit(flow_request(2, priority=5))
        third = h.submit(flow_request(3, priority=5))
        other_band = h.submit(flow_request(4, priority=0), size=900)
        too_big = h.submit(flow_request(5, priority=0), size=200)   # 900 + 200 bytes > maxBytes 1000
        await settle()
        for task in (third, too_big):
            with pytest.raises(RoutingError) as e:
                task.result()
            assert e.value.status == 429 and e.value.headers == {"retry-after": "1"}
        assert not other_band.done() and fc.count == 3 and fc.bytes == 920
        await h.release(3)
        assert sorted(h.order) == ["1", "2", "4"] and fc.count == 0 and fc.bytes == 0
        assert set(fc._bands) == {5}  # the configured band stays; the refused request made none
    asyncio.run(main())


def test_ttl_answers_503_or_429_for_sheddable():
    async def main():
        now = [0.0]
        pool = Pool()
        fc = FlowController(FlowControlConfig(enabled=True, default_ttl_s=5.0), pool.room, clock=lambda: now[0],
                            poll_s=0.01)
        h = Harness(fc, pool)
        critical, sheddable = h.submit(flow_request(1, priority=0)), h.submit(flow_request(2, priority=-1))
        await settle()
        now[0] = 4.9
        fc.dispatch()
        await settle()
        assert not critical.done()
        now[0] = 5.0
        fc.dispatch()
        await settle()
        assert [t.exception().status for t in (critical, sheddable)] == [503, 429]
        assert "retry-after" in critical.exception().headers and fc.count == 0 and fc.expired == 2
    asyncio.run(main())


def test_a_client_that_goes_away_leaves_the_queue_and_nothing_leaks():
    async def main():
        pool = Pool()
        fc = FlowController(config(), pool.room, poll_s=0.01)
        h = Harness(fc, pool)
        gone = h.submit(flow_request("gone"), size=50)
        h.submit(flow_request("stays"))
        await settle()
        gone.cancel()
        await settle()
        assert fc.count == 1 and fc.bytes == 10 and fc.cancelled == 1
        await h.release(1)
        assert h.order == ["stays"] and fc._granted == 0
    asyncio.run(main())


def test_let_go_then_cancelled_gives_its_place_back():
    async def main():
        pool = Pool()
        fc = FlowController(config(), pool.room, poll_s=0.01)
        h = Harness(fc, pool)
        first = h.submit(flow_request("first"))
        await settle()
        pool.free = 1
        fc.dispatch()           # let go, but its task has not run yet
        first.cancel()          # ... and the client leaves before it is routed
        await settle()
        assert fc._granted == 0 and fc.count == 0
    asyncio.run(main())


def test_scale_from_zero_holds_then_serves_everything():
    async def main():
        pool = Pool(room=0)  # no endpoint yet
        fc = FlowController(config(), pool.room, poll_s=0.005)
        h = Harness(fc, pool)
        for i in range(20):
            h.submit(flow_request(i))
        await asyncio.sleep(0.05)
        assert h.order == [] and fc.count == 20
        pool.free = 20  # an endpoint became ready: the dispatcher's poll finds room without a wake
        await asyncio.sleep(0.05)
        assert sorted(h.order, key=int) == [str(i) for i in range(20)] and fc.count == 0
    asyncio.run(main())


def test_random_traffic_is_served_or_refused_exactly_once():
    """Many flows and priorities, room opening at random, clients leaving at random: every request ends exactly
    once (let go, refused, or cancelled), and the counts return to zero."""
    async def main():
        rng = random.Random(7)
        pool = Pool()
        cfg = FlowControlConfig(enabled=True, max_requests=40,
                                default_band=BandConfig(fairness=ROUND_ROBIN, ordering=EDF))
        fc = FlowController(cfg, pool.room, poll_s=0.002)
        h = Harness(fc, pool)
        for i in range(300):
            h.submit(flow_request(i, priority=rng.choice([-1, 0, 0, 5]), flow=rng.choice("abcde"),
                         slo_ms=rng.choice([None, 100, 1000])), size=rng.randint(1, 100))
            if rng.random() < 0.2:
                victim = h.tasks[str(rng.randrange(i + 1))]
                victim.cancel()
            if rng.random() < 0.3:
                await h.release(rng.randint(0, 3))
        await h.release(400)
        await asyncio.sleep(0.05)
        outcomes = {"served": 0, "refused": 0, "cancelled": 0}
        for task in h.tasks.values():
            assert task.done()
            if task.cancelled():
                outcomes["cancelled"] += 1
            elif task.exception() is not None:
                assert task.exception().status == 429
                outcomes["refused"] += 1
            else:
                outcomes["served"] += 1
        assert len(h.order) == len(set(h.order)) == outcomes["served"]
        assert sum(outcomes.values()) == 300 and outcomes["refused"] > 0 and outcomes["cancelled"] > 0
        assert fc.count == 0 and fc.bytes == 0 and fc._granted == 0 and not fc._bands
        # tickets still in the expiry heap (until their TTL) no longer hold their request and its body
        assert fc._expiry and all(ticket.request is None for _, _, ticket in fc._expiry)
    asyncio.run(main())


HEADER = ("apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
          "plugins: [{type: queue-scorer}]\n")


def test_config_in_upstreams_shape():
    from kvgate.epp.scheduling.config import parse_config
    c = parse_config(HEADER + """featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: round-robin-fairness-policy
  name: rr
flowControl:
  maxBytes: 2Gi
  defaultRequestTTL: 30s
  defaultPriorityBand: {maxRequests: "100"}
  priorityBands:
  - {priority: 100, maxBytes: 500Mi, fairnessPolicyRef: rr, orderingPolicyRef: edf-ordering-policy}
""".replace("plugins: [{type: queue-scorer}]\n", ""))
    fc = c.flow_control
    assert fc.enabled and fc.max_bytes == 2 << 30 and fc.default_ttl_s == 30.0 and fc.max_requests == 5000
    assert fc.bands[100] == BandConfig(100, 100, 500 << 20, ROUND_ROBIN, EDF)
    assert fc.band(7) == BandConfig(7, 100, 2 << 30, GLOBAL_STRICT, FCFS)  # the template, for a priority unnamed
    assert not parse_config(HEADER + "flowControl: {maxRequests: 10}").flow_control.enabled  # no gate: off


def test_shortest_prompt_first_takes_its_aging_from_its_plugin():
    from kvgate.epp.scheduling.config import parse_config
    c = parse_config(HEADER.replace("plugins: [{type: queue-scorer}]\n", "") + """featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: shortest-prompt-first-ordering-policy
  name: spf
  parameters: {msPerPromptToken: 0.5}
flowControl:
  defaultPriorityBand: {orderingPolicyRef: spf}
  priorityBands:
  - {priority: 1, orderingPolicyRef: shortest-prompt-first-ordering-policy}
  - {priority: 2}
""").flow_control
    assert c.default_band.ordering == SPF and c.default_band.ms_per_prompt_token == 0.5
    assert c.bands[1].ordering == SPF and c.bands[1].ms_per_prompt_token == 2.0  # the bare type: its default
    assert c.bands[2].ms_per_prompt_token == 0.5 and c.band(9).ordering == SPF  # from the template


@pytest.mark.parametrize("section, says", [
    ("plugins: [{type: queue-scorer}, {type: shortest-prompt-first-ordering-policy, parameters: {msPerPromptToken: "
     "-1}}]", "msPerPromptToken must be a number"),
    ("plugins: [{type: queue-scorer}, {type: shortest-prompt-first-ordering-policy, parameters: {aging: 1}}]",
     "unknown field"),
    ("featureGates: flowControl", "featureGates must be a list"),
    ("flowControl: {maxBytes: -1}", "maxBytes must be a positive whole quantity"),
    ("flowControl: {maxRequests: 1.5}", "maxRequests must be a quantity"),
    ("flowControl: {maxRequests: 2e400}", "maxRequests must be a"),
    ("flowControl: {defaultRequestTTL: 0s}", "defaultRequestTTL"),
    ("flowControl: {priorityBands: [{priority: 1, fairnessPolicyRef: nope}]}", "names no"),
    ("flowControl: {priorityBands: [{priority: 1}, {priority: 1}]}", "named twice"),
    ("flowControl: {priorityBands: [{priority: x}]}", "priority must be an integer"),
    ("flowControl: {queue: 1}", "unknown field"),
])
def test_bad_flow_control_sections_are_one_line_errors(section, says):
    from kvgate.epp.scheduling.config import ConfigError, parse_config
    with pytest.raises(ConfigError, match=says):
        parse_config(HEADER + section)


def test_room_is_the_headroom_summed_over_endpoints():
    from kvgate.epp.admission import Admission
    from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState

    def ep(waiting, kv=0.1, stale=False):
        return EndpointState(Endpoint("a:1"), EndpointMetrics(waiting_queue_size=waiting, kv_cache_usage=kv), stale)
    a = Admission(queue_depth_threshold=5, kv_cache_threshold=0.8)
    assert a.room([ep(0), ep(3), ep(0, kv=0.9), ep(0, stale=True)], [0, 1, 0, 0]) == 5 + 1
    assert a.room([ep(5)], [0]) == 0 and a.room([], []) == 0
