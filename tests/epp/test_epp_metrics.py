"""The EPP's own Prometheus exporter: read from prometheus_client's HTTP thread while the event loop routes.

The exporter must read only what the event loop publishes (an immutable snapshot), never the director's or
the datalayer's live dicts; and every per-endpoint series goes when its endpoint leaves the pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import sys
import threading
import time

from prometheus_client import generate_latest

from kvgate.epp.admission import Admission
from kvgate.epp.datalayer import Datalayer
from kvgate.epp.datastore import Datastore
from kvgate.epp.director import Director
from kvgate.epp.metrics import EppMetrics
from kvgate.epp.scheduling.config import default_config
from kvgate.epp.scheduling.framework import Scheduler
from kvgate.epp.types import Endpoint, LLMRequest


@contextlib.contextmanager
def refusing_addresses(count: int):
    """Loopback addresses that refuse connections: ports held by bound, never-listening sockets (so no other
    process can take them while the test runs and every scrape fails at once, without traffic)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        yield [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]
    finally:
        for s in sockets:
            s.close()


def make_epp(interval: float = 0.05):
    layer = Datalayer(interval=interval, timeout=0.5)
    metrics = EppMetrics()
    director = Director(Datastore(), layer, Scheduler(default_config().scheduler), Admission(), metrics, seed=1)
    metrics.watch(director)
    return layer, director, metrics


def exposition(metrics: EppMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def endpoint_lines(text: str, address: str) -> list[str]:
    return [line for line in text.splitlines() if f'endpoint="{address}"' in line]


async def fresh_exposition(metrics: EppMetrics, layer: Datalayer) -> str:
    """A scrape reads the last snapshot; a round after a scrape publishes a new one: scrape, wait, scrape."""
    exposition(metrics)
    await next_rounds(layer)
    return exposition(metrics)


async def next_rounds(layer: Datalayer, count: int = 2, timeout: float = 2.0) -> None:
    """Wait until the datalayer's ticker has run `count` more rounds (each publishes the snapshot)."""
    done = asyncio.Event()
    seen = 0

    def listener():
        nonlocal seen
        seen += 1
        if seen >= count:
            done.set()

    layer.round_listeners.append(listener)
    try:
        await asyncio.wait_for(done.wait(), timeout)
    finally:
        layer.round_listeners.remove(listener)


def test_scraping_the_exporter_while_the_loop_routes_and_the_pool_churns():
    """Before the snapshot, collect() walked director.in_flight and the datalayer's collectors from the exporter
    thread while the loop changed them: 'dictionary changed size during iteration' within a second."""
    errors: list[BaseException] = []
    scrapes = 0
    stop = threading.Event()

    def hammer(metrics: EppMetrics) -> None:
        nonlocal scrapes
        while not stop.is_set():
            try:
                generate_latest(metrics.registry)
                scrapes += 1
            except BaseException as e:  # noqa: BLE001 - the test reports it
                errors.append(e)
                return

    async def main(addresses: list[str]):
        layer, director, metrics = make_epp(interval=0.2)  # few failing connects: the loop's time goes to routing
        rng = random.Random(7)
        layer.set_endpoints([Endpoint(a) for a in addresses[:300]])
        await layer.start()
        thread = threading.Thread(target=hammer, args=(metrics,), daemon=True)
        thread.start()
        try:
            picked: list[tuple[LLMRequest, str]] = []
            # Two seconds of churn, longer if a loaded machine has not let the exporter thread scrape 20 times yet.
            start = time.monotonic()
            i = 0
            while not errors and (time.monotonic() < start + 2.0 or scrapes <= 20) and time.monotonic() < start + 20:
                i += 1
                # the pool changes: endpoints come and go
                layer.set_endpoints([Endpoint(a) for a in rng.sample(addresses, rng.randint(250, 400))])
                for _ in range(rng.randint(1, 5)):  # requests start...
                    request = LLMRequest(request_id=f"r{i}-{len(picked)}", model="m", target_model="m",
                                         prompt="p" * rng.randint(10, 400), max_tokens=16)
                    with contextlib.suppress(Exception):
                        picked.append((request, director.pick(request)[0].address))
                rng.shuffle(picked)
                for _ in range(rng.randint(0, len(picked))):  # ...and end
                    request, address = picked.pop()
                    director.release(request, address, prompt_tokens=5, completion_tokens=7)
                await asyncio.sleep(0)
        finally:
            stop.set()
            thread.join(5)
            await layer.stop()
        print(f"{scrapes} scrapes of the exporter, {i} loop iterations")
        assert not errors, f"the exporter failed after {scrapes} scrapes: {errors[0]!r}"
        assert scrapes > 20

    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, as a busy EPP's threads do
    try:
        with refusing_addresses(400) as addresses:
            asyncio.run(asyncio.wait_for(main(addresses), 30))
    finally:
        sys.setswitchinterval(switch)


def test_series_of_a_removed_endpoint_are_gone_token_counters_included():
    async def main(a: str, b: str):
        layer, director, metrics = make_epp(interval=0.02)
        layer.set_endpoints([Endpoint(a), Endpoint(b)])
        await layer.start()
        try:
            for address in (a, b):
                director.in_flight.clear()
                request = LLMRequest(request_id=address, model="m", target_model="m", prompt="hello")
                director.release(request, address, prompt_tokens=11, completion_tokens=22)
            text = await fresh_exposition(metrics, layer)
            for address in (a, b):
                lines = endpoint_lines(text, address)
                assert any(line.startswith("kvgate_epp_tokens_total") for line in lines)
                assert any(line.startswith("kvgate_epp_endpoint_stale") for line in lines)
            layer.set_endpoints([Endpoint(b)])
            text = await fresh_exposition(metrics, layer)
            assert endpoint_lines(text, a) == []
            assert f'kvgate_epp_tokens_total{{endpoint="{b}",kind="completion"}} 22.0' in text
            # A response that ends after its endpoint left counts once more, and then goes with the next round.
            director.release(LLMRequest(request_id="late", model="m", target_model="m", prompt="x"), a, 1, 1)
            assert endpoint_lines(await fresh_exposition(metrics, layer), a) == []
        finally:
            await layer.stop()

    with refusing_addresses(2) as (a, b):
        asyncio.run(asyncio.wait_for(main(a, b), 30))


def test_each_endpoint_says_whether_its_prefill_rate_is_the_engines_own_timing():
    """kvgate_epp_endpoint_prefill_rate_timed: 1 where the speed-aware loads read the engine's step timing, 0 where
    the pool's median stands in (an engine that does not time itself, or not yet measured)."""
    from kvgate.epp.metrics import EndpointGauges, EndpointRow, Snapshot

    gauges = EndpointGauges(director=None)
    now = time.monotonic()
    gauges.snapshot = Snapshot((EndpointRow("a:1", 0, 0, 0.0, now, 0, False, True, 4800.0, True),
                                EndpointRow("b:1", 0, 0, 0.0, now, 0, False, True, 2100.0, False),
                                EndpointRow("c:1", 0, 0, 0.0, now, 0, False, True)))
    families = {f.name: {s.labels["endpoint"]: s.value for s in f.samples} for f in gauges.collect()
                if f.name.startswith("kvgate_epp_endpoint_")}
    assert families["kvgate_epp_endpoint_prefill_rate_timed"] == {"a:1": 1.0, "b:1": 0.0, "c:1": 0.0}
    assert families["kvgate_epp_endpoint_prefill_tokens_per_second"] == {"a:1": 4800.0, "b:1": 2100.0}
