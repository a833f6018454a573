"""OpenTelemetry traces through the real Envoy, the EPP and sim engines, each its own process, exported over OTLP/gRPC
to a real OTLP receiver (opentelemetry-proto's TraceService) in this test: one trace per request, with the right
parent links and attributes, and never the prompt's or the answer's text."""

from __future__ import annotations

import httpx
import pytest

from kvgate.common.envoy_config import EnvoyTracing
from kvgate.common.gateway_routes import render_pool_gateway
from tests.gateway import Gateway

pytestmark = pytest.mark.processes

pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc")
from kvgate.bench.otlp_receiver import OtlpReceiver  # noqa: E402

SECRET = "zebra-quartz-sentinel"  # in the prompt: must appear in no exported byte
SPAN_WAIT_S = 20.0


def attributes(span) -> dict:
    out = {}
    for a in span.attributes:
        v = a.value
        kind = v.WhichOneof("value")
        out[a.key] = list(getattr(x, x.WhichOneof("value")) for x in v.array_value.values) \
            if kind == "array_value" else getattr(v, kind)
    return out


@pytest.fixture
def receiver():
    r = OtlpReceiver()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kvgate-cache")


@pytest.fixture(autouse=True)
def quick_export(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")  # the processes' batch processors export every 100 ms
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_SAMPLER",
                 "OTEL_TRACES_SAMPLER_ARG", "OTEL_SERVICE_NAME"):
        monkeypatch.delenv(name, raising=False)


ENVOY_SPANS = {"ingress", "async envoy.service.ext_proc.v3.ExternalProcessor.Process egress"}
EPP_SPANS = {"gateway.request", "gateway.scheduling"}
ENGINE_SPANS = {"llm_request", "llm_request.queue", "llm_request.prefill", "llm_request.decode"}


def test_one_request_is_one_trace_from_envoy_through_the_epp_to_the_engine(tmp_path, cache, receiver):
    flag = ["--otlp-traces-endpoint", receiver.endpoint]
    tracing = EnvoyTracing.from_endpoint(receiver.endpoint)

    def envoy_config(pool, port, admin):
        config = render_pool_gateway(pool, "127.0.0.1", port, admin, tracing=tracing)
        # Envoy's tracer exports every 5 s unless 5 spans are waiting: every 100 ms here
        config["layered_runtime"] = {"layers": [{"name": "quick-export", "static_layer": {
            "tracing.opentelemetry.flush_interval_ms": 100}}]}
        return config

    with Gateway(tmp_path, cache, [["--backend", "sim", *flag]] * 2, epp_args=flag, envoy_config=envoy_config) as gw:
        r = httpx.post(f"{gw.url}/v1/completions", timeout=30, json={
            "model": "sim-model", "prompt": f"tell me about {SECRET}", "max_tokens": 5, "temperature": 0.5,
            "top_p": 0.9})
        assert r.status_code == 200, r.text
        answer = r.json()
        spans = receiver.wait_for(ENVOY_SPANS | EPP_SPANS | ENGINE_SPANS, SPAN_WAIT_S)

    services = {name: svc for name, (svc, _) in spans.items()}
    assert services["ingress"] == "kvgate-gateway"
    assert services["gateway.request"] == "kvgate-epp" and services["llm_request"] == "kvgate-engine"
    span = {name: s for name, (_, s) in spans.items()}
    trace_id = span["ingress"].trace_id
    assert {s.trace_id for s in span.values()} == {trace_id}
    assert len(receiver.trace(trace_id)) == len(ENVOY_SPANS | EPP_SPANS | ENGINE_SPANS)  # one request, one trace
    egress = span["async envoy.service.ext_proc.v3.ExternalProcessor.Process egress"]
    # Envoy → its ext_proc call → the EPP's request span → its scheduling span
    assert egress.parent_span_id == span["ingress"].span_id
    assert span["gateway.request"].parent_span_id == egress.span_id
    assert span["gateway.scheduling"].parent_span_id == span["gateway.request"].span_id
    # Envoy's router sends the upstream request under its ingress span (it rewrites the EPP's traceparent)
    assert span["llm_request"].parent_span_id == span["ingress"].span_id
    for child in ("queue", "prefill", "decode"):
        assert span[f"llm_request.{child}"].parent_span_id == span["llm_request"].span_id
    llm = span["llm_request"]
    assert span["llm_request.queue"].start_time_unix_nano >= llm.start_time_unix_nano - 5_000_000
    assert span["llm_request.decode"].end_time_unix_nano <= llm.end_time_unix_nano + 5_000_000

    epp = attributes(span["gateway.request"])
    scheduling = attributes(span["gateway.scheduling"])
    assert epp["kvgate.epp.destination_endpoint"] in gw.endpoints
    assert epp["gen_ai.request.model"] == "sim-model" and epp["http.response.status_code"] == 200
    assert epp["gen_ai.usage.output_tokens"] == answer["usage"]["completion_tokens"]
    assert scheduling["kvgate.epp.candidates"] == 2
    assert scheduling["kvgate.epp.destination_endpoint"] == epp["kvgate.epp.destination_endpoint"]
    assert sorted(scheduling["kvgate.epp.top_scores.endpoints"]) == sorted(gw.endpoints)
    scores = dict(zip(scheduling["kvgate.epp.top_scores.endpoints"], scheduling["kvgate.epp.top_scores.values"]))
    assert list(scores.values()) == sorted(scores.values(), reverse=True)  # best first
    assert scores[epp["kvgate.epp.destination_endpoint"]] == max(scores.values())  # the max-score picker's pick
    assert scheduling["kvgate.epp.profile"]
    assert any(k.startswith("kvgate.epp.plugin.") for k in scheduling)

    engine = attributes(llm)
    assert engine["gen_ai.request.model"] == "sim-model"
    assert engine["gen_ai.response.id"] == answer["id"]
    assert engine["gen_ai.request.max_tokens"] == 5
    assert engine["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert engine["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert engine["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert engine["gen_ai.usage.output_tokens"] == answer["usage"]["completion_tokens"]
    assert 0 <= engine["gen_ai.latency.time_in_queue"] <= engine["gen_ai.latency.time_to_first_token"]
    assert engine["gen_ai.latency.time_to_first_token"] <= engine["gen_ai.latency.e2e"]

    exported = b"".join(receiver.raw)
    assert SECRET.encode() not in exported
    text = answer["choices"][0]["text"]
    assert len(text) < 4 or all(text not in str(v) for s in span.values() for v in attributes(s).values())


def test_without_envoy_s_tracer_the_epp_parents_the_engine_and_follows_the_client_s_sampling(tmp_path, cache,
                                                                                             receiver):
    """An Envoy that does not trace passes the client's traceparent to the EPP and the EPP's to the engine; a parent
    that is not sampled is followed (parent-based sampling): nothing is exported for it."""
    flag = ["--otlp-traces-endpoint", receiver.endpoint]
    with Gateway(tmp_path, cache, [["--backend", "sim", *flag]], epp_args=flag) as gw:
        unsampled = "00-" + "a" * 32 + "-" + "b" * 16 + "-00"
        sampled_trace, client_span = "c" * 32, "d" * 16
        for traceparent in (unsampled, f"00-{sampled_trace}-{client_span}-01"):
            r = httpx.post(f"{gw.url}/v1/chat/completions", timeout=30, headers={"traceparent": traceparent},
                           json={"model": "sim-model", "max_tokens": 3, "stream": True,
                                 "messages": [{"role": "user", "content": SECRET}]})
            assert r.status_code == 200 and r.text.rstrip().endswith("[DONE]"), r.text
        refused_trace = "e" * 32
        r = httpx.post(f"{gw.url}/v1/completions", timeout=30, content=b'{"model": "sim-model", "prompt": ',
                       headers={"traceparent": f"00-{refused_trace}-{'f' * 16}-01",
                                "content-type": "application/json"})
        assert r.status_code == 400, r.text
        spans = receiver.wait_for(EPP_SPANS | ENGINE_SPANS, SPAN_WAIT_S, bytes.fromhex(sampled_trace))
        receiver.wait_for({"gateway.request"}, SPAN_WAIT_S, bytes.fromhex(refused_trace))

    span = {name: s for name, (_, s) in spans.items()}
    assert span["gateway.request"].trace_id == bytes.fromhex(sampled_trace)
    assert span["gateway.request"].parent_span_id == bytes.fromhex(client_span)
    assert span["llm_request"].trace_id == bytes.fromhex(sampled_trace)
    assert span["llm_request"].parent_span_id == span["gateway.request"].span_id  # the EPP's traceparent
    assert attributes(span["llm_request"])["gen_ai.operation.name"] == "chat"
    assert receiver.trace(bytes.fromhex("a" * 32)) == []
    # a refusal: the EPP's span alone (no decision, no engine), its status the answer's
    ((service, refused),) = receiver.trace(bytes.fromhex(refused_trace))
    assert (service, refused.name) == ("kvgate-epp", "gateway.request")
    assert attributes(refused)["http.response.status_code"] == 400
    assert refused.status.code == refused.status.STATUS_CODE_ERROR
    assert SECRET.encode() not in b"".join(receiver.raw)
