"""Engines that require an API key (`kvgate serve --api-key`) behind the EPP and Envoy: the EPP still scrapes them
(/metrics is public) and routes, the gateway passes the client's Authorization through to the engine, and the EPP
keeps no credential in its view of a request, so none can reach its log."""

import openai
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvgate.epp.extproc import _headers
from kvgate.epp.types import LLMRequest
from tests.epp.test_stock_envoy import stock_envoy
from tests.gateway import Gateway

pytestmark = pytest.mark.processes

KEY = "gw-key-5a7c9e1b3d"


def test_the_epp_keeps_no_credentials_of_a_request():
    values = [("Authorization", f"Bearer {KEY}"), ("proxy-authorization", f"Basic {KEY}"),
              ("x-gateway-inference-objective", "gold"), ("content-type", "application/json")]
    msg = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values]))
    headers = _headers(msg)
    assert headers == {"x-gateway-inference-objective": "gold", "content-type": "application/json"}
    assert KEY not in repr(LLMRequest(request_id="r", model="m", target_model="m", prompt="p", headers=headers))


@pytest.fixture(scope="module", params=["kvgate-envoy", "stock-envoy"])
def gateway(request, tmp_path_factory):
    """kvgate's Envoy config, and upstream's stock shape (ext_proc -> ORIGINAL_DST, no kvgate filters): neither
    strips the Authorization header on its way to the engine."""
    config = stock_envoy if request.param == "stock-envoy" else None
    with Gateway(tmp_path_factory.mktemp("gw-api-key"), tmp_path_factory.mktemp("cache"),
                 [["--backend", "sim", "--api-key", KEY]] * 2,
                 envoy_config=config) as gw:  # the EPP saw fresh metrics of both
        yield gw


def test_keyed_engines_behind_the_gateway(gateway):
    client = openai.OpenAI(base_url=gateway.url + "/v1", api_key=KEY, max_retries=0, timeout=30)
    served = set()
    for i in range(6):
        r = client.completions.with_raw_response.create(model="sim-model", prompt=f"hello {i}", max_tokens=2)
        assert r.parse().usage.completion_tokens == 2
        served.add(r.headers["x-kvgate-endpoint"])
    assert served <= set(gateway.endpoints) and served
    with pytest.raises(openai.AuthenticationError) as caught:
        openai.OpenAI(base_url=gateway.url + "/v1", api_key="wrong", max_retries=0, timeout=30) \
            .completions.create(model="sim-model", prompt="x", max_tokens=1)
    assert caught.value.body["message"] == "Invalid API key."  # the engine's answer, through Envoy
    assert KEY not in gateway.epp.log() and "wrong" not in gateway.epp.log()
