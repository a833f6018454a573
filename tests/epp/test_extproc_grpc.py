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
from tests.procs import KvgateServe, free_port

pytestmark = pytest.mark.processes

FULL = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
DEST = "x-gateway-destination-endpoint"
BODY_LIMIT = 64 * 1024


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
        epp = EPP(tmp, addresses, extra=["--manifests", str(manifests), "--max-request-body-bytes", str(BODY_LIMIT)])
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
    # The exporter shows what the event loop published last (at most a scrape round old): wait a little.
    deadline = time.monotonic() + 2
    while True:
        metrics = epp.metrics()
        released = f'kvgate_epp_endpoint_in_flight_requests{{endpoint="{picked}"}} 0.0' in metrics
        if released or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert f'kvgate_epp_tokens_total{{endpoint="{picked}",kind="completion"}}' in metrics
    assert released, metrics


def test_health_services(pool):
    _, _, epp = pool
    with grpc.insecure_channel(f"127.0.0.1:{epp.health_port}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def immediate(resp: pb.ProcessingResponse) -> tuple[int, dict]:
    assert resp.HasField("immediate_response"), resp
    ir = resp.immediate_response
    headers = {h.header.key: h.header.raw_value for h in ir.headers.set_headers}
    assert headers["content-type"] == b"application/json"
    return ir.status.code, json.loads(ir.body)["error"]


def test_body_over_the_limit_is_413_without_waiting_for_the_rest(pool):
    _, stub, epp = pool
    chunk = b"x" * (BODY_LIMIT // 2)
    msgs = [headers_msg({})] + [pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk)) for _ in range(3)]
    out = run(stub, msgs)  # the stream never ends its body: the refusal must not wait for it
    assert len(out) == 1
    status, error = immediate(out[0])
    assert status == 413 and str(BODY_LIMIT) in error["message"]
    assert 'kvgate_epp_requests_total{code="413"}' in epp.metrics()


def test_hostile_json_is_400_and_the_stream_stays_clean(pool):
    addresses, stub, _ = pool
    deep = b'{"prompt": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    for body in (deep, b"\xff\xfe{}", b'{"prompt": "a", "prompt": 5}', b"[1, 2]", b'{"messages": "hi"}',
                 b'{"prompt": 1e999999}', b'{"model": ["x"], "prompt": "a"}'):
        out = run(stub, [headers_msg({}), *body_msgs(body, 4)])
        status, error = immediate(out[0])
        assert status == 400 and error["type"] == "invalid_request_error", (body[:40], error)
    out = run(stub, [headers_msg({}), *body_msgs(completion())])  # the EPP is unharmed
    assert destination(out[0]) in addresses


def test_body_ending_with_trailers_is_decided(pool):
    addresses, stub, _ = pool
    body = completion("trailers")
    msgs = [headers_msg({}), pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=False)),
            pb.ProcessingRequest(request_trailers=pb.HttpTrailers())]
    out = run(stub, msgs)
    assert [r.WhichOneof("response") for r in out] == ["request_headers", "request_body", "request_trailers"]
    assert destination(out[0]) in addresses
    streamed = out[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == body and not streamed.end_of_stream  # the trailers end the stream


def test_embeddings_and_responses_bodies_are_routed(pool):
    addresses, stub, _ = pool
    for body in ({"model": "sim-model", "input": "embed me"}, {"model": "sim-model", "input": ["a", "b"]},
                 {"model": "sim-model", "input": [{"role": "user", "content": "hi"}]}):
        out = run(stub, [headers_msg({}), *body_msgs(json.dumps(body).encode())])
        assert destination(out[0]) in addresses


def test_stale_endpoint_is_not_picked_while_a_fresh_one_exists(tmp_path):
    """An endpoint never scraped (nothing listens there) has all-zero metrics: it would win every score."""
    engine = KvgateServe("sim-model", "--backend", "sim", cache_dir=tmp_path)
    epp = None
    try:
        engine.wait_ready()
        live, dead = f"127.0.0.1:{engine.port}", f"127.0.0.1:{free_port()}"
        epp = EPP(tmp_path, [dead, live])
        deadline = time.monotonic() + 20
        while f'kvgate_epp_endpoint_stale{{endpoint="{live}"}} 0.0' not in epp.metrics():
            assert time.monotonic() < deadline, epp.log()
            time.sleep(0.1)
        with grpc.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            picked = {destination(run(stub, [headers_msg({}), *body_msgs(completion(f"p{i}"))])[0])
                      for i in range(30)}
        assert picked == {live}
        assert f'kvgate_epp_endpoint_stale{{endpoint="{dead}"}} 1.0' in epp.metrics()  # still visible
    finally:
        if epp:
            epp.stop()
        engine.stop()


def test_a_killed_engine_leaves_rotation_within_a_second_and_returns(tmp_path):
    engines = [KvgateServe("sim-model", "--backend", "sim", cache_dir=tmp_path) for _ in range(2)]
    epp = None
    try:
        for e in engines:
            e.wait_ready()
        victim, survivor = (f"127.0.0.1:{e.port}" for e in engines)
        epp = EPP(tmp_path, [victim, survivor])
        deadline = time.monotonic() + 20
        while epp.metrics().count("kvgate_epp_endpoint_stale{") != 2 or " 1.0" in "".join(
                l for l in epp.metrics().splitlines() if l.startswith("kvgate_epp_endpoint_stale{")):
            assert time.monotonic() < deadline, epp.log()
            time.sleep(0.1)
        with grpc.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)

            def picks(n):
                return [destination(run(stub, [headers_msg({}), *body_msgs(completion(f"k{time.monotonic()}"))])[0])
                        for _ in range(n)]

            assert set(picks(40)) == {victim, survivor}  # both in rotation (ties spread)
            engines[0].proc.kill()
            killed = time.monotonic()
            while victim in picks(20):  # 20 picks all avoiding it by chance (ties): ~1e-6
                assert time.monotonic() - killed < 1.0, "the dead engine is still picked after 1 s"
            assert set(picks(40)) == {survivor}
            # The same port comes back (a restarted pod): the first good scrape returns it to rotation.
            engines[0] = KvgateServe("sim-model", "--backend", "sim", cache_dir=tmp_path,
                                     port=int(victim.rsplit(":", 1)[1])).wait_ready()
            deadline = time.monotonic() + 10
            while victim not in picks(10):
                assert time.monotonic() < deadline, epp.log()
    finally:
        if epp:
            epp.stop()
        for e in engines:
            e.stop()


def _serving(epp, service="readiness") -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{epp.health_port}") as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
    return status == health_pb2.HealthCheckResponse.SERVING


def test_ready_once_it_can_route_and_within_two_seconds(tmp_path):
    """Readiness waits for a first good scrape, so a (re)started EPP is not sent requests it would answer 503 —
    and is bounded: with no endpoint answering, it turns ready 2 s after the pool's endpoints are known."""
    engine = KvgateServe("sim-model", "--backend", "sim", cache_dir=tmp_path)
    epps = []
    try:
        engine.wait_ready()
        live = EPP(tmp_path, [f"127.0.0.1:{engine.port}"], wait_ready=False)
        epps.append(live)
        started = time.monotonic()
        while not _serving(live):
            assert time.monotonic() - started < 2.0, live.log()
            time.sleep(0.02)
        with grpc.insecure_channel(f"127.0.0.1:{live.grpc_port}") as channel:
            out = run(pb_grpc.ExternalProcessorStub(channel), [headers_msg({}), *body_msgs(completion())])
        assert destination(out[0]) == f"127.0.0.1:{engine.port}"  # ready means routable, not 503
        dead = EPP(tmp_path, [f"127.0.0.1:{free_port()}"], wait_ready=False)
        epps.append(dead)
        started = time.monotonic()
        assert not _serving(dead)
        while not _serving(dead):
            assert time.monotonic() - started < 5.0, dead.log()
            time.sleep(0.05)
        assert time.monotonic() - started > 1.0  # it waited for a scrape that never came, then gave up waiting
        assert _serving(dead, "liveness")
    finally:
        for e in epps:
            e.stop()
        engine.stop()
