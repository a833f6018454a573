"""The ext-proc protocol spoken directly over gRPC to a real `kvgate epp` (no Envoy in between)."""

import json
import time

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.gateway import EPP
from tests.procs import KvgateServe

FULL = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
DEST = "x-gateway-destination-endpoint"


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("extproc")
    manifests = tmp / "policies.yaml"
    manifests.write_text(
        "kind: InferenceModelRewrite\nmetadata: {name: alias}\nspec:\n  poolRef: {name: p}\n  rules:\n"
        "  - matches: [{model: {value: friendly-name}}]\n    targets: [{modelRewrite: sim-model, weight: 1}]\n")
    engines = [KvgateServe("sim-model", "--backend", "sim", cache_dir=tmp) for _ in range(3)]
    epp = None
    try:
        for e in engines:
            e.wait_ready()
        addresses = [f"127.0.0.1:{e.port}" for e in engines]
        epp = EPP(tmp, addresses, extra=["--manifests", str(manifests)])
        channel = grpc.insecure_channel(f"127.0.0.1:{epp.grpc_port}")
        deadline = time.monotonic() + 20
        while "kvgate_epp_endpoint_stale{endpoint=" not in epp.metrics() and time.monotonic() < deadline:
            time.sleep(0.1)
        yield addresses, pb_grpc.ExternalProcessorStub(channel), epp
        channel.close()
    finally:
        if epp:
            epp.stop()
        for e in engines:
            e.stop()


def headers_msg(headers: dict, end=False, mode=FULL, subset=None) -> pb.ProcessingRequest:
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    msg = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv),
                                                              end_of_stream=end),
                               protocol_config=pb.ProtocolConfiguration(request_body_mode=mode,
                                                                        response_body_mode=mode))
    if subset is not None:
        s = struct_pb2.Struct()
        s.update({"x-gateway-destination-endpoint-subset": subset})
        msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(s)
    return msg


def body_msgs(body: bytes, chunks: int = 2) -> list[pb.ProcessingRequest]:
    size = max(1, len(body) // chunks)
    parts = [body[i:i + size] for i in range(0, len(body), size)]
    return [pb.ProcessingRequest(request_body=pb.HttpBody(body=p, end_of_stream=i == len(parts) - 1))
            for i, p in enumerate(parts)]


def destination(resp: pb.ProcessingResponse) -> str:
    common = resp.request_headers.response if resp.HasField("request_headers") else resp.request_body.response
    (h,) = [h.header for h in common.header_mutation.set_headers if h.header.key == DEST]
    assert common.clear_route_cache
    meta = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value
    value = h.raw_value.decode()
    assert meta == value  # the same list in the header and in dynamic metadata
    return value


def run(stub, msgs):
    return list(stub.Process(iter(msgs), timeout=10))


def completion(prompt="hello", model="sim-model") -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": 3}).encode()


def test_full_duplex_decision_after_body_and_body_streamed_back(pool):
    addresses, stub, _ = pool
    body = completion("x" * 500)
    out = run(stub, [headers_msg({":path": "/v1/completions"}), *body_msgs(body, 3)])
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body"]
    assert destination(out[0]) in addresses  # one endpoint: all a stock ORIGINAL_DST cluster can parse
    streamed = out[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == body and streamed.end_of_stream


def test_selection_header_is_ignored_by_the_default_config(pool):
    addresses, stub, _ = pool
    out = run(stub, [headers_msg({"test-epp-endpoint-selection": "10.9.9.9:1"}), *body_msgs(completion())])
    assert destination(out[0]) in addresses


def test_subset_hint_restricts_candidates(pool):
    addresses, stub, _ = pool
    for _ in range(5):
        out = run(stub, [headers_msg({}, subset=[addresses[1]]), *body_msgs(completion())])
        assert destination(out[0]) == addresses[1]
    out = run(stub, [headers_msg({}, subset=[]), *body_msgs(completion())])
    assert out[0].immediate_response.status.code == 503
    assert "subset" in json.loads(out[0].immediate_response.body)["error"]["message"]


def test_buffered_mode(pool):
    addresses, stub, _ = pool
    out = run(stub, [headers_msg({}, mode=BUFFERED), pb.ProcessingRequest(
        request_body=pb.HttpBody(body=completion(), end_of_stream=True))])
    assert out[0].HasField("request_headers") and not out[0].request_headers.response.header_mutation.set_headers
    assert destination(out[1]).split(",")[0] in addresses


def test_model_rewrite_changes_the_body(pool):
    _, stub, _ = pool
    out = run(stub, [headers_msg({}), *body_msgs(completion(model="friendly-name"))])
    body = json.loads(out[1].request_body.response.body_mutation.streamed_response.body)
    assert body["model"] == "sim-model"


def test_malformed_and_bodyless(pool):
    addresses, stub, _ = pool
    out = run(stub, [headers_msg({}), *body_msgs(b'{"prompt": ')])
    assert out[0].immediate_response.status.code == 400
    out = run(stub, [headers_msg({":method": "GET"}, end=True)])
    assert destination(out[0]).split(",")[0] in addresses


def test_response_chunks_echoed_and_usage_accounted(pool):
    _, stub, epp = pool
    sse = [b'data: {"choices": [{"text": "a"}]}\n\n',
           b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}\n\ndata: [DONE]\n\n']
    msgs = [headers_msg({}), *body_msgs(completion()),
            pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
                headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])))]
    msgs += [pb.ProcessingRequest(response_body=pb.HttpBody(body=c, end_of_stream=i == len(sse) - 1))
             for i, c in enumerate(sse)]
    out = run(stub, msgs)
    echoed = [r.response_body.response.body_mutation.streamed_response.body for r in out if r.HasField("response_body")]
    assert echoed == sse
    picked = destination(out[0]).split(",")[0]
    metrics = epp.metrics()
    assert f'kvgate_epp_tokens_total{{endpoint="{picked}",kind="completion"}}' in metrics
    assert f'kvgate_epp_endpoint_in_flight_requests{{endpoint="{picked}"}} 0.0' in metrics


def test_health_services(pool):
    _, _, epp = pool
    with grpc.insecure_channel(f"127.0.0.1:{epp.health_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING
