"""Flow control through a real gateway: upstream's stock Envoy config (ext_proc FULL_DUPLEX_STREAMED → ORIGINAL_DST),
`kvgate epp` with `featureGates: [flowControl]`, sim engines made to saturate.

1. A low-priority flood on a saturated pool waits in the EPP while high-priority requests go ahead of it; every
   request of both is served once, whole. Two tenants in one band, one sending ten times the other's requests at
   once: while both wait they are served 1:1 (round-robin fairness).
2. Scale from zero: requests sent to a pool with no endpoint are held and served once one appears; past the queue's
   bound they are refused with 429, past the TTL with 503, each with retry-after and an OpenAI-style JSON body.
3. kvgate's shortest-prompt-first ordering: short prompts overtake a queue of long ones (with the aging parameter at
   0, i.e. arrival order, the same test fails: the short ones finished with the last long ones, 4.6 s against 0.8).
"""

from __future__ import annotations

import asyncio
import re
import statistics
import time

import httpx
import pytest

from kvgate.common.upstream_envoy import render_upstream_envoy
from tests.epp.test_stock_envoy import stock_envoy
from tests.gateway import EPP, Envoy, Gateway
from tests.procs import KvgateServe, free_port

pytestmark = pytest.mark.processes

FLOW_CONFIG = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: round-robin-fairness-policy
saturationDetector: {queueDepthThreshold: 1, kvCacheUtilThreshold: 0.95}
flowControl:
  defaultRequestTTL: %s
  maxRequests: %d
  defaultPriorityBand: {fairnessPolicyRef: round-robin-fairness-policy}
"""
OBJECTIVES = """apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: interactive}
spec: {priority: 10, poolRef: {name: pool}}
---
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1, poolRef: {name: pool}}
"""
# Two requests at a time per engine, ~10 ms a step: a request of 16 tokens takes ~0.2 s.
SIM = ["--backend", "sim", "--max-num-seqs", "2", "--sim-step-overhead-ms", "10"]
MAX_TOKENS = 16


async def complete(client: httpx.AsyncClient, url: str, objective: str, i: int,
                   tenant: str | None = None) -> tuple[float, httpx.Response]:
    started = time.monotonic()
    headers = {"x-gateway-inference-objective": objective}
    if tenant:
        headers["x-gateway-inference-fairness-id"] = tenant
    r = await client.post(f"{url}/v1/completions", headers=headers,
                          json={"model": "sim-model", "prompt": f"{objective} request {i}", "max_tokens": MAX_TOKENS})
    finished[id(r)] = time.monotonic()
    return finished[id(r)] - started, r


finished: dict[int, float] = {}  # id(response) -> when it was whole at the client


def whole(r: httpx.Response) -> bool:
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_high_priority_goes_ahead_of_a_flood_and_nothing_is_lost(tmp_path):
    (tmp_path / "logs").mkdir()
    manifests = tmp_path / "objectives.yaml"
    manifests.write_text(OBJECTIVES)
    with Gateway(tmp_path / "logs", tmp_path / "cache", [SIM, SIM], envoy_config=stock_envoy,
                 epp_args=["--config-text", FLOW_CONFIG % ("60s", 5000), "--manifests", str(manifests)]) as gw:
        async def main():
            # no client-side queue: every request of a flood is at the gateway at once (httpx holds back past 100)
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as client:
                alone = [(await complete(client, gw.url, "interactive", i))[0] for i in range(3)]
                flood = [asyncio.create_task(complete(client, gw.url, "batch", i)) for i in range(60)]
                await asyncio.sleep(0.5)  # the flood fills the engines and the EPP's queue
                high = []
                for i in range(5):
                    high.append(await complete(client, gw.url, "interactive", 100 + i))
                low = await asyncio.gather(*flood)
                # Fairness in one band: tenant A sends ten times B's 20 requests, all at once.
                sent = [("A", asyncio.create_task(complete(client, gw.url, "batch", i, "A"))) for i in range(200)]
                sent += [("B", asyncio.create_task(complete(client, gw.url, "batch", i, "B"))) for i in range(20)]
                tenants = {name: [] for name in "AB"}
                for name, task in sent:
                    tenants[name].append(await task)
                return alone, high, low, tenants
        alone, high, low, tenants = asyncio.run(main())
        metrics = gw.epp.metrics()
    assert all(whole(r) for _, r in high + low), [(r.status_code, r.text[:200]) for _, r in high + low
                                                 if not whole(r)][:3]
    unloaded, high_s, low_s = statistics.median(alone), [s for s, _ in high], [s for s, _ in low]
    print(f"unloaded {unloaded:.3f}s; high priority during the flood: max {max(high_s):.3f}s "
          f"(p50 {statistics.median(high_s):.3f}s); flood: p50 {statistics.median(low_s):.3f}s, "
          f"max {max(low_s):.3f}s")
    # The flood waited in the EPP (a queue of dozens at four running), the high-priority requests did not wait
    # behind it: typically done in a fraction of the flood's typical time, each before it (one that lands on an
    # engine busy with the flood's running requests on a loaded machine takes longer: 3.9 s against 7.6 s once).
    assert statistics.median(high_s) < statistics.median(low_s) / 2 and max(high_s) < statistics.median(low_s)
    # Round-robin between the tenants' flows: while both have requests waiting they are served 1:1 however many each
    # sent. Counted at the client: A's completions between B's first and last (B's 20 span 19 intervals); in one
    # line with A's flood first (global-strict) B would finish after nearly all of A's 200.
    assert all(whole(r) for t in "AB" for _, r in tenants[t]) and [len(tenants[t]) for t in "AB"] == [200, 20]
    b_done = sorted(finished[id(r)] for _, r in tenants["B"])
    a_between = sum(b_done[0] < finished[id(r)] < b_done[-1] for _, r in tenants["A"])
    print(f"fairness 10:1: while tenant B's 20 requests were served, tenant A got {a_between} (1:1 would be 19); "
          f"B p50 {statistics.median(s for s, _ in tenants['B']):.3f}s, A p50 "
          f"{statistics.median(s for s, _ in tenants['A']):.3f}s")
    assert 19 / 1.5 <= a_between <= 19 * 1.5, a_between
    queued = re.search(r'^inference_extension_flow_control_request_queue_duration_seconds_count\{fairness_id="batch",'
                       r'outcome="Dispatched",priority="-1"\} (\S+)$', metrics, re.M)
    assert queued and float(queued.group(1)) == 60, metrics[-3000:]  # the flood, each request dispatched once

    # The EPP's own time on a request's path leaves the queue's wait out: the flood waited ~1 s or more on average
    # in the queue, while the path (body parse, decision) takes milliseconds.
    def mean(name: str, labels: str = "") -> float:
        total = float(re.search(rf"^{name}_sum{labels} (\S+)$", metrics, re.M).group(1))
        return total / float(re.search(rf"^{name}_count{labels} (\S+)$", metrics, re.M).group(1))
    waited = mean("inference_extension_flow_control_request_queue_duration_seconds",
                  r'\{fairness_id="batch",outcome="Dispatched",priority="-1"\}')
    path = mean("kvgate_epp_request_path_duration_seconds")
    print(f"flow control wait mean {waited:.3f}s, request path mean {path * 1000:.2f} ms")
    assert waited > 0.3 and path < waited / 10, (waited, path)


def test_scale_from_zero_queue_bound_and_ttl_through_envoy(tmp_path):
    """No endpoint yet: a request waits its TTL (2 s) and gets 503; then 6 at once against maxRequests 4: 2 refused
    with 429 at once, the other 4 served once an engine joins the pool."""
    logs = tmp_path / "logs"
    logs.mkdir()
    endpoints = tmp_path / "endpoints"
    endpoints.write_text("")
    engine = KvgateServe("sim-model", *SIM, cache_dir=tmp_path / "cache")
    epp = envoy = None
    try:
        engine.wait_ready()
        epp = EPP(logs, endpoints_file=endpoints, extra=["--config-text", FLOW_CONFIG % ("2s", 4)])
        port, admin = free_port(), free_port()
        envoy = Envoy(logs, render_upstream_envoy(port, admin, epp.grpc_port), admin)
        url = f"http://127.0.0.1:{port}"

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                waited, expired = await complete(client, url, "interactive", 0)
                batch = [asyncio.create_task(complete(client, url, "interactive", i)) for i in range(1, 7)]
                await asyncio.sleep(0.5)
                refused = [t for t in batch if t.done()]
                endpoints.write_text(f"127.0.0.1:{engine.port}\n")  # the pool's first endpoint
                await asyncio.gather(*batch)
                return waited, expired, [t.result() for t in refused], [t.result() for t in batch
                                                                         if t not in refused]
        waited, expired, refused, served = asyncio.run(main())
    finally:
        for p in (envoy, epp):
            if p is not None:
                p.stop()
        engine.stop()
    assert expired.status_code == 503 and 1.9 < waited < 10, (expired.status_code, waited)
    assert expired.headers["retry-after"] == "1"
    assert "flow control" in expired.json()["error"]["message"]
    assert [r.status_code for _, r in refused] == [429, 429], [(r.status_code, r.text) for _, r in refused]
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "rate_limit_error" for _, r in refused)
    assert len(served) == 4 and all(whole(r) for _, r in served), [(r.status_code, r.text[:200]) for _, r in served]


SPF_CONFIG = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: shortest-prompt-first-ordering-policy
  parameters: {msPerPromptToken: %s}
saturationDetector: {queueDepthThreshold: 1, kvCacheUtilThreshold: 0.95}
flowControl:
  defaultPriorityBand: {orderingPolicyRef: shortest-prompt-first-ordering-policy}
"""


def test_shortest_prompt_first_lets_short_prompts_overtake_a_queue_of_long_ones(tmp_path):
    """kvgate's shortest-prompt-first ordering behind the stock Envoy config: short prompts sent after a queue of
    long ones leave the EPP first (in arrival order they would wait for nearly all of them), and every request of
    both is served once, whole."""
    (tmp_path / "logs").mkdir()
    long_prompt = "a long document to summarise. " * 130  # ~3900 characters: ~975 estimated tokens, ~2 s of aging
    with Gateway(tmp_path / "logs", tmp_path / "cache", [SIM, SIM], envoy_config=stock_envoy,
                 epp_args=["--config-text", SPF_CONFIG % 2]) as gw:
        async def send(client: httpx.AsyncClient, prompt: str) -> tuple[float, httpx.Response]:
            started = time.monotonic()
            r = await client.post(f"{gw.url}/v1/completions",
                                  json={"model": "sim-model", "prompt": prompt, "max_tokens": MAX_TOKENS})
            return time.monotonic() - started, r

        async def main():
            async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=None)) as client:
                longs = [asyncio.create_task(send(client, f"{i} {long_prompt}")) for i in range(40)]
                await asyncio.sleep(0.5)  # the long prompts fill the engines and the EPP's queue
                shorts = await asyncio.gather(*(send(client, f"short question {i}") for i in range(5)))
                return await asyncio.gather(*longs), shorts
        longs, shorts = asyncio.run(main())
    assert all(whole(r) for _, r in longs + shorts), [(r.status_code, r.text[:200]) for _, r in longs + shorts
                                                      if not whole(r)][:3]
    long_s, short_s = sorted(s for s, _ in longs), [s for s, _ in shorts]
    print(f"long prompts: p50 {statistics.median(long_s):.3f}s, max {long_s[-1]:.3f}s; short prompts sent 0.5 s "
          f"later: max {max(short_s):.3f}s")
    # ~36 long requests were still queued when the short ones came: first come first served, the short ones would
    # finish with the last long ones; shortest first, they leave at the next free slot.
    assert max(short_s) < statistics.median(long_s) / 2, (short_s, statistics.median(long_s))
