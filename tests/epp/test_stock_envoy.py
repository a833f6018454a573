"""`kvgate epp` as a drop-in: behind a stock Envoy config in upstream's shape (common/upstream-envoy.yaml:
ext_proc with streamed bodies → an ORIGINAL_DST cluster reading `x-gateway-destination-endpoint`, nothing else),
and behind kvgate's own rendered config — real Envoy, real sim engines, the EPP's default config unless named."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import pytest

from kvgate.conformance.epp_config import CONFORMANCE_EPP_CONFIG
from kvgate.common.epp_protocol import SERVED_TEST_HEADER, TEST_ENDPOINT_SELECTION_HEADER
from kvgate.common.upstream_envoy import UPSTREAM_ENVOY_YAML, render_upstream_envoy
from tests.gateway import Gateway

pytestmark = pytest.mark.processes

FIXTURE = UPSTREAM_ENVOY_YAML
SERVED_BY = "x-kvgate-endpoint"  # set by the engine: the endpoint that really served the request
REQUESTS = 200


def stock_envoy(pool, port: int, admin_port: int) -> dict:
    return render_upstream_envoy(port, admin_port, pool.epp_port)


def test_fixture_is_upstream_shaped():
    """The fixture stays stock: ext_proc and the router only, one ORIGINAL_DST cluster on the protocol's header."""
    config = stock_envoy(type("Pool", (), {"epp_port": 1})(), 2, 3)
    (hcm,) = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"]
    assert [f["name"] for f in hcm["typed_config"]["http_filters"]] == ["envoy.filters.http.ext_proc",
                                                                        "envoy.filters.http.router"]
    ext_proc = hcm["typed_config"]["http_filters"][0]["typed_config"]
    assert "metadata_options" not in ext_proc
    assert ext_proc["processing_mode"]["request_body_mode"] == "FULL_DUPLEX_STREAMED"
    (original_dst,) = [c for c in config["static_resources"]["clusters"] if c["type"] == "ORIGINAL_DST"]
    assert original_dst["original_dst_lb_config"] == {"use_http_header": True,
                                                      "http_header_name": "x-gateway-destination-endpoint"}
    assert "lua" not in FIXTURE.read_text().lower().replace("no lua", "")


def _request(client: httpx.AsyncClient, url: str, i: int, headers: dict):
    """Request i of the mix: completions and chat, streamed and not, and a body-less GET /v1/models."""
    kind = i % 5
    if kind == 4:
        return client.get(url + "/v1/models", headers=headers)
    chat = kind in (2, 3)
    body = {"model": "sim-model", "max_tokens": 4, "stream": kind in (1, 3)}
    if chat:
        body["messages"] = [{"role": "user", "content": f"question {i}: " + "x" * (i % 37)}]
    else:
        body["prompt"] = f"prompt {i}: " + "y" * (i % 41)
    return client.post(url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body, headers=headers)


def _is_complete(response: httpx.Response, i: int) -> bool:
    if i % 5 == 4:
        return bool(response.json()["data"])
    if i % 5 in (1, 3):
        return response.text.rstrip().endswith("data: [DONE]")
    return bool(json.loads(response.text)["choices"])


def run_mix(url: str, headers: dict | None = None, total: int = REQUESTS, concurrency: int = 8):
    """`total` requests of the mix, `concurrency` at a time: [(index, response)]."""
    async def main():
        gate = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(i):
                async with gate:
                    return i, await _request(client, url, i, headers or {})
            return await asyncio.gather(*(one(i) for i in range(total)))

    return asyncio.run(main())


def assert_all_served(results, endpoints: list[str]) -> Counter:
    served = Counter()
    for i, r in results:
        assert r.status_code == 200, (i, r.status_code, r.text[:300])
        assert _is_complete(r, i), (i, r.text[:300])
        assert r.headers[SERVED_BY] in endpoints
        assert SERVED_TEST_HEADER not in r.headers  # no conformance hook, no pod address leaked
        served[r.headers[SERVED_BY]] += 1
    return served


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kvgate-cache")


@pytest.fixture(scope="module")
def stock(tmp_path_factory, cache):
    """`kvgate epp --endpoints A,B,C` (default config) behind the stock fixture."""
    with Gateway(tmp_path_factory.mktemp("stock"), cache, [["--backend", "sim"]] * 3,
                 envoy_config=stock_envoy) as gw:
        yield gw


def test_stock_envoy_serves_everything_spread_by_the_scorers(stock):
    served = assert_all_served(run_mix(stock.url), stock.endpoints)
    assert sum(served.values()) == REQUESTS
    # every endpoint takes a share: the scorers balance (a broken pick would pin one endpoint or 503)
    assert set(served) == set(stock.endpoints) and min(served.values()) >= REQUESTS // 10, served


def test_stock_envoy_ignores_the_selection_header_under_the_default_config(stock):
    pinned = stock.endpoints[0]
    results = run_mix(stock.url, {TEST_ENDPOINT_SELECTION_HEADER: pinned}, total=40)
    served = assert_all_served(results, stock.endpoints)
    assert set(served) != {pinned}, served
    unknown = run_mix(stock.url, {TEST_ENDPOINT_SELECTION_HEADER: "127.0.0.1:1"}, total=5)
    assert_all_served(unknown, stock.endpoints)  # the conformance config would answer 503


def test_stock_envoy_honours_the_selection_header_under_the_conformance_config(tmp_path, cache):
    with Gateway(tmp_path, cache, [["--backend", "sim"]] * 3, envoy_config=stock_envoy,
                 epp_args=["--config-text", CONFORMANCE_EPP_CONFIG]) as gw:
        for endpoint in gw.endpoints:
            for i, r in run_mix(gw.url, {TEST_ENDPOINT_SELECTION_HEADER: endpoint}, total=10):
                assert r.status_code == 200 and _is_complete(r, i), (i, r.text[:300])
                assert r.headers[SERVED_BY] == endpoint
        # the stock config forwards no served-endpoint metadata: the verifier says so, as upstream's does
        r = httpx.get(gw.url + "/v1/models", timeout=10)
        assert r.status_code == 200 and r.headers[SERVED_TEST_HEADER].startswith("fail:")


def test_kvgate_envoy_serves_everything(tmp_path, cache):
    with Gateway(tmp_path, cache, [["--backend", "sim"]] * 3) as gw:
        served = assert_all_served(run_mix(gw.url), gw.endpoints)
        assert set(served) == set(gw.endpoints), served
