"""The Endpoint Picker through the real Envoy binary, in front of real sim engines."""

import asyncio
import threading
import struct
import socket
import http.server
import json
import random
import time
from collections import Counter

import httpx
import pytest

from tests.epp.helpers import LIST_CONFIG
from tests.gateway import EPP, Envoy, Gateway
from tests.procs import KvgateServe, free_port
from kvgate.conformance.epp_config import CONFORMANCE_EPP_CONFIG
from kvgate.common.envoy_config import UPSTREAM_HOST_HEADER, UPSTREAM_IDLE_S, PoolBackend
from kvgate.common.gateway_routes import render_pool_gateway
from kvgate.common.epp_protocol import DESTINATION_HEADER, SERVED_TEST_HEADER, TEST_ENDPOINT_SELECTION_HEADER

pytestmark = pytest.mark.processes

SERVED_BY = "x-kvgate-endpoint"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kvgate-cache")


@pytest.fixture(scope="module")
def three(tmp_path_factory, cache):
    """Three engines behind kvgate's Envoy, the EPP on its default config."""
    with Gateway(tmp_path_factory.mktemp("gw3"), cache, [["--backend", "sim"]] * 3) as gw:
        yield gw


@pytest.fixture(scope="module")
def conformance(tmp_path_factory, cache):
    """Three engines behind kvgate's Envoy, the EPP on the conformance suite's config (its test plugins on)."""
    with Gateway(tmp_path_factory.mktemp("gw3c"), cache, [["--backend", "sim"]] * 3,
                 epp_args=["--config-text", CONFORMANCE_EPP_CONFIG]) as gw:
        yield gw


def complete(url, prompt="hello", max_tokens=4, headers=None, **extra):
    return httpx.post(url + "/v1/completions", json={"model": "sim-model", "prompt": prompt,
                                                     "max_tokens": max_tokens, **extra},
                      headers=headers or {}, timeout=30)


def test_envoy_closes_idle_engine_connections_before_the_engines_do(three):
    """An idle connection to an engine is closed by Envoy (UPSTREAM_IDLE_S), never by the engine's keep-alive:
    a request Envoy writes onto a connection the engine is closing is answered 503, and cannot be retried."""
    idle_closed, remote_closed = (f"cluster.pool-test.upstream_cx_{s}" for s in ("idle_timeout", "destroy_remote"))
    r = complete(three.url, "idle connections")
    assert r.status_code == 200, r.text
    before = three.envoy_stat(idle_closed), three.envoy_stat(remote_closed)
    deadline = time.monotonic() + UPSTREAM_IDLE_S + 5  # past the engines' 5 s keep-alive too
    while three.envoy_stat(idle_closed) == before[0] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert three.envoy_stat(idle_closed) > before[0]
    assert three.envoy_stat(remote_closed) == before[1]
    assert complete(three.url, "after the idle close").status_code == 200


@pytest.mark.parametrize("count", [1, 2, 3])
def test_conformance_header_selects_endpoints(conformance, count):
    chosen = conformance.endpoints[:count]
    served = Counter()
    for i in range(12):
        r = complete(conformance.url, f"prompt {i}", headers={TEST_ENDPOINT_SELECTION_HEADER: ",".join(chosen)})
        assert r.status_code == 200, r.text
        served[r.headers[SERVED_BY]] += 1
    assert set(served) <= set(chosen)
    if count == 1:
        assert served[chosen[0]] == 12


def test_gateway_reports_the_served_endpoint(conformance):
    """Envoy reports the upstream host as `envoy.lb` response metadata (route header → header_to_metadata,
    no Lua) and ext_proc forwards it; the conformance config's served-endpoint verifier echoes it in
    x-conformance-test-served-endpoint (upstream's conformance hook). Streaming and body-less requests too."""
    for endpoint in conformance.endpoints:
        selected = {TEST_ENDPOINT_SELECTION_HEADER: endpoint}
        with httpx.stream("POST", conformance.url + "/v1/completions", headers=selected, timeout=30, json={
                "model": "sim-model", "prompt": "stream", "max_tokens": 4, "stream": True}) as streamed:
            streamed.read()
        for r in (complete(conformance.url, headers=selected), streamed,
                  httpx.get(conformance.url + "/v1/models", headers=selected, timeout=10)):
            assert r.status_code == 200, r.text
            assert r.headers[SERVED_BY] == endpoint
            assert r.headers[SERVED_TEST_HEADER] == endpoint
            assert UPSTREAM_HOST_HEADER not in r.headers  # the internal header never leaves Envoy


def test_default_config_ignores_the_selection_header_and_reports_nothing(three):
    """Under the default config a client cannot pick its pod, and no response carries a pod address."""
    served = Counter()
    for i in range(12):  # distinct short prompts on an idle pool: the scorers tie and the picker spreads them
        r = complete(three.url, f"prompt {i}", headers={TEST_ENDPOINT_SELECTION_HEADER: three.endpoints[0]})
        assert r.status_code == 200, r.text
        assert SERVED_TEST_HEADER not in r.headers and UPSTREAM_HOST_HEADER not in r.headers
        served[r.headers[SERVED_BY]] += 1
    assert len(served) > 1, served  # honoured, the header would have pinned all 12 to endpoints[0]
    r = complete(three.url, headers={TEST_ENDPOINT_SELECTION_HEADER: "127.0.0.1:1"})
    assert r.status_code == 200, r.text  # the conformance config answers 503 here


@pytest.mark.parametrize("fail_open", [True, False])
def test_client_destination_header_never_steers(tmp_path, cache, fail_open):
    """A client-set x-gateway-destination-endpoint picks nothing: kvgate's Envoy routes by the EPP's metadata,
    which a client cannot set — also with the EPP down under FailOpen, where the fallback balances instead."""
    with Gateway(tmp_path, cache, [["--backend", "sim"]] * 2, failure_mode_allow=fail_open) as gw:
        target = gw.endpoints[1]
        outsider = KvgateServe("sim-model", "--backend", "sim", cache_dir=cache).wait_ready()
        try:
            forged = {DESTINATION_HEADER: f"127.0.0.1:{outsider.port}"}
            for i in range(6):
                r = complete(gw.url, f"p{i}", headers=forged)
                assert r.status_code == 200 and r.headers[SERVED_BY] in gw.endpoints
            gw.epp.stop()
            _wait_epp_unhealthy(gw)
            for i in range(6):
                r = complete(gw.url, f"q{i}", headers={DESTINATION_HEADER: f"127.0.0.1:{outsider.port},{target}"})
                if fail_open:
                    assert r.status_code == 200 and r.headers[SERVED_BY] in gw.endpoints
                else:
                    assert r.status_code >= 500
            assert _served_total(outsider) == 0
        finally:
            outsider.stop()


def _served_total(engine) -> float:
    text = httpx.get(engine.url + "/metrics", timeout=5).text
    return sum(float(l.split()[-1]) for l in text.splitlines() if l.startswith("vllm:request_success_total"))


def _wait_epp_unhealthy(gw, timeout: float = 15.0) -> None:
    # "the EPP is down" as Envoy sees it: its health check marked the EPP unhealthy (3 failures, 1 s apart)
    deadline = time.monotonic() + timeout
    while gw.envoy_stat("cluster.epp-test.membership_healthy") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not gw.envoy_stat("cluster.epp-test.membership_healthy")


def test_selection_header_keeps_only_this_pools_endpoints(conformance):
    """Upstream's weighted-pools conformance test lists endpoints of two pools: each EPP keeps its own."""
    mine = conformance.endpoints[1]
    r = complete(conformance.url, headers={TEST_ENDPOINT_SELECTION_HEADER: f"127.0.0.1:1,{mine},127.0.0.1:2"})
    assert r.status_code == 200 and r.headers[SERVED_BY] == mine


def test_unknown_endpoint_in_selection_header_is_503(conformance):
    r = complete(conformance.url, headers={TEST_ENDPOINT_SELECTION_HEADER: "127.0.0.1:1"})
    assert r.status_code == 503 and r.json()["error"]["code"] == 503


def test_malformed_body_is_400(three):
    r = httpx.post(three.url + "/v1/completions", content=b'{"prompt": "x", ', timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(three.url + "/v1/completions", json={"model": "sim-model"}, timeout=10)
    assert r.status_code == 400


def test_get_without_body_is_routed(three):
    r = httpx.get(three.url + "/v1/models", timeout=10)
    assert r.status_code == 200 and r.headers[SERVED_BY] in three.endpoints


def test_streaming_through_gateway_is_incremental_and_identical(three):
    body = {"model": "sim-model", "prompt": "stream me", "max_tokens": 40, "seed": 11, "ignore_eos": True}
    direct = httpx.post(f"http://{three.endpoints[0]}/v1/completions", json=body, timeout=30).json()
    arrivals, text = [], []
    with httpx.stream("POST", three.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                arrivals.append(time.monotonic())
                text.extend(c["text"] for c in json.loads(line[6:])["choices"])
    assert "".join(text) == direct["choices"][0]["text"]
    assert len(arrivals) >= 40
    # 40 decode steps of ~6 ms each: the first chunk must arrive well before the last
    assert arrivals[-1] - arrivals[0] > 0.1


def test_prefix_affinity_and_balance(tmp_path, cache):
    # Sequential requests leave every endpoint idle, so a new group's first request ties on the load scorers and
    # the picker breaks the tie at random: balance is judged over enough groups to hold for every draw (8 groups
    # put 5 on one endpoint in ~11% of draws, which failed this test; 32 put 16 on one in < 0.4%).
    with Gateway(tmp_path, cache, [["--backend", "sim"]] * 4) as gw:
        rng = random.Random(3)
        systems = ["".join(rng.choice("abcdefgh ") for _ in range(1000)) for _ in range(32)]
        order = [g for g in range(32) for _ in range(3)]
        rng.shuffle(order)
        home: dict[int, str] = {}
        repeats = same = 0
        load = Counter()

        async def main():
            nonlocal repeats, same
            async with httpx.AsyncClient(timeout=60) as client:
                for i, g in enumerate(order):
                    r = await client.post(gw.url + "/v1/completions", json={
                        "model": "sim-model", "prompt": systems[g] + f" question {i}?", "max_tokens": 4})
                    assert r.status_code == 200, r.text
                    ep = r.headers[SERVED_BY]
                    load[ep] += 1
                    if g in home:
                        repeats += 1
                        same += ep == home[g]
                    home.setdefault(g, ep)

        asyncio.run(main())
        assert same / repeats >= 0.9, (same, repeats)
        mean = len(order) / 4
        assert max(load.values()) <= 2 * mean, load


def test_load_awareness_avoids_a_slow_endpoint(tmp_path, cache):
    engines = [["--backend", "sim"], ["--backend", "sim"], ["--backend", "sim", "--sim-slowdown", "50",
                                                             "--max-num-seqs", "1"]]
    with Gateway(tmp_path, cache, engines) as gw:
        slow = gw.endpoints[2]

        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                # pile a queue onto the slow endpoint directly
                backlog = [asyncio.create_task(client.post(f"http://{slow}/v1/completions", json={
                    "prompt": f"backlog {i}", "max_tokens": 20, "ignore_eos": True})) for i in range(8)]
                await asyncio.sleep(0.5)  # the EPP scrapes every 50 ms
                served = Counter()
                for i in range(30):
                    r = await client.post(gw.url + "/v1/completions", json={
                        "model": "sim-model", "prompt": f"new request {i} " + "z" * (i * 7), "max_tokens": 2})
                    served[r.headers[SERVED_BY]] += 1
                for t in backlog:
                    t.cancel()
                await asyncio.gather(*backlog, return_exceptions=True)
                return served

        served = asyncio.run(main())
        assert served[slow] <= 1, served


def test_shedding_429_for_sheddable_when_saturated(tmp_path, cache):
    manifests = tmp_path / "objectives.yaml"
    manifests.write_text(
        "kind: InferenceObjective\nmetadata: {name: batch}\nspec: {priority: -1, poolRef: {name: p}}\n---\n"
        "kind: InferenceObjective\nmetadata: {name: interactive}\nspec: {priority: 10, poolRef: {name: p}}\n")
    engines = [["--backend", "sim", "--sim-slowdown", "50", "--max-num-seqs", "1"]]
    with Gateway(tmp_path, cache, engines, epp_args=["--manifests", str(manifests),
                                                     "--saturation-queue-depth", "2"]) as gw:
        async def main():
            async with httpx.AsyncClient(timeout=120) as client:
                backlog = [asyncio.create_task(client.post(f"http://{gw.endpoints[0]}/v1/completions", json={
                    "prompt": f"b{i}", "max_tokens": 10, "ignore_eos": True})) for i in range(6)]
                # The engine's own count, not a fixed pause: on a loaded machine the backlog can take longer than
                # half a second to queue. Then a few of the EPP's 50 ms scrapes, so it has seen the queue too.
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    page = (await client.get(f"http://{gw.endpoints[0]}/metrics")).text
                    waiting = [float(line.split()[-1]) for line in page.splitlines()
                               if line.startswith("vllm:num_requests_waiting")]
                    if waiting and waiting[0] >= 3:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.3)
                shed = await client.post(gw.url + "/v1/completions", headers={
                    "x-gateway-inference-objective": "batch"}, json={"model": "sim-model", "prompt": "x",
                                                                     "max_tokens": 1})
                kept = await client.post(gw.url + "/v1/completions", headers={
                    "x-gateway-inference-objective": "interactive"}, json={"model": "sim-model", "prompt": "y",
                                                                           "max_tokens": 1})
                for t in backlog:
                    t.cancel()
                await asyncio.gather(*backlog, return_exceptions=True)
                return shed, kept

        shed, kept = asyncio.run(main())
        assert shed.status_code == 429 and shed.json()["error"]["code"] == 429
        assert kept.status_code == 200


def test_no_endpoints_is_503(tmp_path):
    empty = tmp_path / "endpoints.txt"
    empty.write_text("")
    epp = EPP(tmp_path, endpoints_file=empty)
    envoy = None
    try:
        port, admin = free_port(), free_port()
        envoy = Envoy(tmp_path, render_pool_gateway(PoolBackend("empty", "127.0.0.1", epp.grpc_port),
                                                    "127.0.0.1", port, admin), admin)
        r = complete(f"http://127.0.0.1:{port}")
        assert r.status_code == 503 and "no eligible endpoint" in r.json()["error"]["message"]
    finally:
        if envoy:
            envoy.stop()
        epp.stop()


@pytest.mark.parametrize("fail_open", [True, False])
def test_failure_mode_with_the_epp_down(tmp_path, cache, fail_open):
    with Gateway(tmp_path, cache, [["--backend", "sim"]] * 2, failure_mode_allow=fail_open) as gw:
        assert complete(gw.url).status_code == 200
        gw.epp.stop()
        _wait_epp_unhealthy(gw)
        r = complete(gw.url)
        if fail_open:
            assert r.status_code == 200 and r.headers[SERVED_BY] in gw.endpoints
        else:
            assert r.status_code >= 500


class ResettingEngine:
    """An endpoint whose /metrics looks healthy (so the EPP keeps it in rotation) but which resets every other
    connection before answering: what a server that dies mid-request looks like to Envoy."""

    PAGE = b"vllm:num_requests_waiting 0\nvllm:num_requests_running 0\nvllm:kv_cache_usage_perc 0\n"

    def __init__(self) -> None:
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                if self.path.startswith("/metrics"):
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(outer.PAGE)))
                    self.end_headers()
                    self.wfile.write(outer.PAGE)
                else:
                    self.reset()

            def do_POST(self):  # noqa: N802
                outer.resets += 1
                self.reset()

            def reset(self):
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
                self.close_connection = True

            def log_message(self, *args):
                pass

        self.resets = 0
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


PINNED_LIST_CONFIG = LIST_CONFIG.replace("plugins:\n- type: queue-scorer", "plugins:\n- type: header-based-testing-filter\n"
                                         "- type: queue-scorer", 1).replace(
    "  plugins:\n  - pluginRef: queue-scorer", "  plugins:\n  - pluginRef: header-based-testing-filter\n"
    "  - pluginRef: queue-scorer", 1)


def test_retries_walk_the_epps_list_when_the_primary_resets(tmp_path, cache):
    """With fallbacks configured (maxNumOfEndpoints > 1), a request whose primary resets the connection before
    answering is retried by kvgate's Envoy on the next endpoint of the EPP's list (override_host): all served.
    The primary is pinned first with the conformance header filter, so every request meets the broken one."""
    broken = ResettingEngine()
    engine = KvgateServe("sim-model", "--backend", "sim", cache_dir=cache)
    epp = envoy = None
    try:
        engine.wait_ready()
        live = f"127.0.0.1:{engine.port}"
        epp = EPP(tmp_path, [broken.address, live], extra=["--config-text", PINNED_LIST_CONFIG])
        port, admin = free_port(), free_port()
        pool = PoolBackend("test", "127.0.0.1", epp.grpc_port, [broken.address, live],
                           epp_health_port=epp.health_port, fallbacks=True)
        envoy = Envoy(tmp_path, render_pool_gateway(pool, "127.0.0.1", port, admin), admin)
        deadline = time.monotonic() + 20
        while epp.metrics().count(" 0.0\n") < 2 or "kvgate_epp_endpoint_stale" not in epp.metrics():
            assert time.monotonic() < deadline, epp.log()
            time.sleep(0.1)
        served = Counter()
        for i in range(24):
            r = complete(f"http://127.0.0.1:{port}", f"distinct prompt {i}",
                         headers={"test-epp-endpoint-selection": f"{broken.address},{live}"})
            assert r.status_code == 200, r.text
            served[r.headers[SERVED_BY]] += 1
        assert served == {live: 24}
        assert broken.resets >= 24  # every request met the broken primary first, and was retried
        stats = httpx.get(f"http://127.0.0.1:{admin}/stats?filter=^cluster.pool-test.upstream_rq_retry$",
                          timeout=5).text
        assert int(stats.split(":")[1]) >= 24
    finally:
        for p in (envoy, epp):
            if p is not None:
                p.stop()
        engine.stop()
        broken.stop()
