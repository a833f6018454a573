"""The Envoy ext-proc server: one gRPC stream per HTTP request, the Endpoint Picker Protocol on top.

Request path: headers -> body chunks -> (end of body, or trailers) decision. In FULL_DUPLEX_STREAMED mode Envoy holds
the request until the headers response, so the EPP answers the headers only after the whole body has
arrived: the headers response carries `x-gateway-destination-endpoint` (primary first, then fallbacks)
and clear_route_cache, the same value goes into dynamic metadata `envoy.lb`, and the buffered body is
streamed back unchanged (or with the model rewritten). In BUFFERED mode the headers are answered at once
and the decision rides on the body response. Requests without a body are decided at header time, as upstream
does. The body is held only until the decision (then freed) and never beyond `max_body_bytes`: a larger one is
answered 413 at once, without waiting for the rest. Every refusal is an ImmediateResponse with an OpenAI-shaped
JSON body (400 malformed, 413 too large, 429 shed, 503 no eligible endpoint; flow control's 429 / 503 carry
retry-after), never a broken stream. With flow control (epp/flow_control.py) a request waits between its body
and the decision while the pool is saturated.
Response path: every body chunk is echoed straight back (SSE tokens keep flowing), `usage` is read from
the tail of the stream, and the in-flight accounting is released when the stream ends or breaks.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid

import grpc

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from kvgate.common import bounded_json
from kvgate.common.api_errors import anthropic_error_body, is_anthropic_path
from kvgate.epp.director import Director, RoutingError
from kvgate.common.epp_protocol import (DESTINATION_HEADER, DESTINATION_NAMESPACE as LB_NAMESPACE, SERVED_KEY, SERVED_MISSING,
                                 SERVED_TEST_HEADER, SUBSET_KEY, SUBSET_NAMESPACE)
from kvgate.epp.request_parsing import BadRequest, parse_request
from kvgate.epp.types import LLMRequest

log = logging.getLogger(__name__)

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
_TAIL_BYTES = 64 * 1024  # enough of a response to find its usage
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024  # --max-request-body-bytes: generous for long prompts, finite
_ERROR_TYPES = {400: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "internal_error"}


# Credentials the EPP has no use for (an engine's API key, `kvgate serve --api-key`): left out of its view of a
# request, so no log line, error message, plugin or repr of an LLMRequest can carry them. Envoy still forwards them.
CREDENTIAL_HEADERS = frozenset({"authorization", "proxy-authorization", "x-api-key"})


def _headers(http_headers) -> dict[str, str]:
    out = {}
    for h in http_headers.headers.headers:
        key = h.key.lower()
        if key not in CREDENTIAL_HEADERS:
            out[key] = h.raw_value.decode(errors="replace") if h.raw_value else h.value
    return out


def _metadata_value(metadata, namespace: str, key: str):
    ns = metadata.filter_metadata.get(namespace)
    if ns is None or key not in ns.fields:
        return None
    value = ns.fields[key]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        return [v.string_value for v in value.list_value.values]
    if kind == "string_value":
        return [s.strip() for s in value.string_value.split(",") if s.strip()]
    return None


def _destination(value: str, rewritten_body: bytes | None, *, buffered_body: bool,
                 trace_headers: dict[str, str] | None = None):
    """`trace_headers`: the EPP span's W3C context, set on the upstream request too (a traced request)."""
    mutations = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=DESTINATION_HEADER,
                                                                        raw_value=value.encode()))]
    if trace_headers:
        mutations += [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()))
                      for k, v in trace_headers.items()]
    common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=mutations), clear_route_cache=True)
    if buffered_body and rewritten_body is not None:
        common.status = pb.CommonResponse.CONTINUE_AND_REPLACE
        common.body_mutation.body = rewritten_body
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: value}})
    return common, metadata


# The headers answer of an untraced, FULL_DUPLEX_STREAMED decision depends only on the destination list: built once
# per list and reused (the messages are never changed once built; grpc serializes each at its write). Bounded:
# emptied when it holds _ROUTING_ANSWERS_MAX lists (a pool's endpoints, and their fallback orders, are far fewer).
_ROUTING_ANSWERS_MAX = 4096
_routing_answers: dict[str, pb.ProcessingResponse] = {}


def _routing_headers_answer(value: str) -> pb.ProcessingResponse:
    answer = _routing_answers.get(value)
    if answer is None:
        if len(_routing_answers) >= _ROUTING_ANSWERS_MAX:
            _routing_answers.clear()
        common, metadata = _destination(value, None, buffered_body=False)
        answer = _routing_answers[value] = pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)
    return answer


def _immediate(status: int, message: str, headers: dict[str, str] | None = None,
               anthropic: bool = False) -> pb.ProcessingResponse:
    """A refusal in the client API's error shape: Anthropic's on its Messages path, else OpenAI's."""
    if anthropic:
        body = json.dumps(anthropic_error_body(status, message))
    else:
        kind = _ERROR_TYPES.get(status, "service_unavailable")
        body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}})
    headers = pb.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=key, raw_value=value.encode()))
        for key, value in {"content-type": "application/json", **(headers or {})}.items()])
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), headers=headers, body=body.encode(),
        details=f"kvgate_epp_{status}"))


def _token_counts(usage: dict) -> tuple[int, int]:
    """(prompt, completion) tokens of an OpenAI `usage`, or of the Responses / Anthropic one (input / output)."""
    if "prompt_tokens" in usage or "completion_tokens" in usage:
        return int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    return int(usage.get("input_tokens") or 0), int(usage.get("output_tokens") or 0)


def find_usage(tail: bytes) -> tuple[int, int] | None:
    """(prompt_tokens, completion_tokens) from a JSON body or the last SSE events carrying usage: top-level
    `usage` (completions, chat, Anthropic's message and message_delta), or a Responses event's `response.usage`."""
    text = tail.decode(errors="ignore")
    candidates = [text.strip()] if text.lstrip().startswith("{") else []
    candidates += [line[5:].strip() for line in reversed(text.splitlines()) if line.startswith("data:")]
    for item in candidates:
        if '"usage"' not in item:
            continue
        try:  # an upstream's bytes: deep nesting is a ValueError here, not a RecursionError out of the stream
            value = bounded_json.loads(item, _TAIL_BYTES)
            usage = value.get("usage")
            if usage is None and isinstance(value.get("response"), dict):
                usage = value["response"].get("usage")
        except (ValueError, AttributeError):
            continue
        if isinstance(usage, dict):
            try:
                return _token_counts(usage)
            except (TypeError, ValueError):
                continue
    return None


# A streamed chunk that carries generated text (completions' "text", chat's "content" or "reasoning_content", a
# tool call; the Responses API's string "delta"; Anthropic's "text", "thinking" and "partial_json" deltas): the
# first one marks the request's first token. Chat streams open with a role chunk whose content is empty, and the
# Responses and Anthropic streams with events whose text is empty, which do not count.
_TOKEN_CHUNK = re.compile(rb'"(?:text|content|reasoning_content|delta|thinking|partial_json)":\s*"(?!")'
                          rb'|"tool_calls":\s*\[\s*\{')


def has_token(chunk: bytes) -> bool:
    return _TOKEN_CHUNK.search(chunk) is not None


class _RequestStream:
    """State of one HTTP request as it passes through Envoy."""

    def __init__(self, director: Director, metrics, report_served: bool = False,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tracer=None, grpc_metadata=None) -> None:
        self.director = director
        self.metrics = metrics
        self.report_served = report_served
        self.max_body_bytes = max_body_bytes
        # tracing (epp/tracing.py): the tracer when it is on, the stream's gRPC metadata (Envoy's trace context)
        self.tracer = tracer
        self.grpc_metadata = grpc_metadata
        self.span = None  # the request's RequestSpan, from its headers to the end of the stream
        self.decided = False  # a decision (or refusal) went out: later request messages pass through
        self.request_full_duplex = False
        self.response_full_duplex = False
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self.body: bytes | bytearray = b""  # the request body until the decision: one chunk as it came, or joined
        self.request: LLMRequest | None = None
        # (raw, body, end_of_stream, responses to send after the decision): a decision that waits for the
        # director's prepare step (a long prompt's tokenization, off the loop), which Process awaits
        self.deferred: tuple | None = None
        self.picked: str | None = None
        self.served: str | None = None
        self.tail = bytearray()
        self.response_open = False  # response headers came, and a body follows them
        self.response_body_seen = False
        self.released = False
        self.path_started: float | None = None  # perf_counter when the request's routing work began
        self.streaming = False  # a routed request that asked for a streamed answer: its first token is timed

    def handle(self, msg: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
        if msg.HasField("protocol_config"):
            self.request_full_duplex = msg.protocol_config.request_body_mode == FULL_DUPLEX
            self.response_full_duplex = msg.protocol_config.response_body_mode == FULL_DUPLEX
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            self.headers = _headers(msg.request_headers)
            if self.tracer is not None:
                from kvgate.epp.tracing import RequestSpan

                self.span = RequestSpan(self.tracer, self.grpc_metadata, self.headers)
            self.subset = _metadata_value(msg.metadata_context, SUBSET_NAMESPACE, SUBSET_KEY)
            if msg.request_headers.end_of_stream:  # no body (GET /v1/models, ...): decide now
                return [self._decide_without_body()]
            if self.request_full_duplex:
                return []  # answered once the body is complete
            return [pb.ProcessingResponse(request_headers=pb.HeadersResponse())]
        if kind == "request_body":
            if self.decided:  # after a refusal Envoy stops the stream; nothing more to buffer
                return []
            chunk = msg.request_body.body
            if len(self.body) + len(chunk) > self.max_body_bytes:
                return [self._refuse(413, f"the request body is larger than {self.max_body_bytes} bytes")]
            if self.body:
                self.body += chunk
            elif msg.request_body.end_of_stream:  # the whole body in one message: used as it is, no copy
                self.body = chunk
            else:
                self.body = bytearray(chunk)
            if msg.request_body.end_of_stream or not self.request_full_duplex:  # BUFFERED: one message, answer it
                return self._decide_on_body(end_of_stream=msg.request_body.end_of_stream)
            return []
        if kind == "request_trailers":
            # The body ended with trailers, not with an end_of_stream chunk: decide now, or Envoy waits forever.
            decided = [] if self.decided else self._decide_on_body(end_of_stream=False)
            if self.deferred is not None:
                self.deferred[3].append(pb.ProcessingResponse(request_trailers=pb.TrailersResponse()))
                return []
            if decided and decided[0].HasField("immediate_response"):
                return decided
            return [*decided, pb.ProcessingResponse(request_trailers=pb.TrailersResponse())]
        if kind == "response_headers":
            served = _metadata_value(msg.metadata_context, LB_NAMESPACE, SERVED_KEY)
            self.served = served[0] if served else self.picked
            self.response_open = not msg.response_headers.end_of_stream
            if msg.response_headers.end_of_stream:
                self.release()
            if not self.report_served:
                return [pb.ProcessingResponse(response_headers=pb.HeadersResponse())]
            # Only what the gateway reports, never our own pick: a gateway that does not say fails the check.
            value = ",".join(served) if served else SERVED_MISSING
            mutation = pb.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=SERVED_TEST_HEADER, raw_value=value.encode()))])
            return [pb.ProcessingResponse(response_headers=pb.HeadersResponse(
                response=pb.CommonResponse(header_mutation=mutation)))]
        if kind == "response_body":
            self.response_body_seen = True
            chunk = msg.response_body.body
            if self.streaming and self.request.first_token_at is None and has_token(chunk):
                self.request.first_token_at = time.monotonic()
            self.tail += chunk
            if len(self.tail) > _TAIL_BYTES:
                del self.tail[: len(self.tail) - _TAIL_BYTES]
            if msg.response_body.end_of_stream:
                self.release()
            if self.response_full_duplex:
                return [pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                        body=chunk, end_of_stream=msg.response_body.end_of_stream)))))]
            return [pb.ProcessingResponse(response_body=pb.BodyResponse())]
        if kind == "response_trailers":
            self.release()
            return [pb.ProcessingResponse(response_trailers=pb.TrailersResponse())]
        return []

    def _refuse(self, status: int, message: str, headers: dict[str, str] | None = None) -> pb.ProcessingResponse:
        self.decided = True
        self.request = None
        self.deferred = None
        self.body = b""
        self._count(status)
        if self.span is not None:
            self.span.refused(status, message)
        return _immediate(status, message, headers, anthropic=is_anthropic_path(self.headers.get(":path", "")))

    def _decide_on_body(self, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        self.path_started = time.perf_counter()
        rid = self.headers.get("x-request-id") or uuid.uuid4().hex
        raw, self.body = bytes(self.body), b""  # held no longer than the decision (bytes(bytes) is no copy)
        try:
            self.request, body = parse_request(rid, raw, self.headers)
        except BadRequest as exc:
            return [self._refuse(400, str(exc))]
        if self.span is not None:
            self.span.request_parsed(self.request)
        if self.director.waits_before_pick(self.request):
            self.deferred = (raw, body, end_of_stream, [])
            return []
        return self._pick(raw, body, end_of_stream)

    def decide(self) -> list[pb.ProcessingResponse]:
        """The decision `_decide_on_body` deferred, once the director's before_pick step is done."""
        raw, body, end_of_stream, after = self.deferred
        self.deferred = None
        decided = self._pick(raw, body, end_of_stream)
        return decided if decided[0].HasField("immediate_response") else [*decided, *after]

    def _pick(self, raw: bytes, body: dict, end_of_stream: bool) -> list[pb.ProcessingResponse]:
        rewritten = None
        trace_headers = None
        try:
            if self.span is None:
                ordered = self.director.pick(self.request, self.subset)
            else:
                ordered, trace_headers = self._traced_pick()
        except RoutingError as exc:
            return [self._refuse(exc.status, str(exc))]
        self._observe_path()
        self.decided = True
        if self.request.target_model and self.request.target_model != self.request.model:
            body["model"] = self.request.target_model
            rewritten = json.dumps(body).encode()
        self.picked = ordered[0].address
        self.streaming = body.get("stream") is True
        value = ",".join(s.address for s in ordered)
        self._count(200)
        if self.request_full_duplex:
            if trace_headers:
                common, metadata = _destination(value, None, buffered_body=False, trace_headers=trace_headers)
                headers_answer = pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common),
                                                       dynamic_metadata=metadata)
            else:
                headers_answer = _routing_headers_answer(value)
            out_body = rewritten if rewritten is not None else raw
            return [
                headers_answer,
                pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(streamed_response=pb.StreamedBodyResponse(
                        body=out_body, end_of_stream=end_of_stream))))),
            ]
        common, metadata = _destination(value, rewritten, buffered_body=True, trace_headers=trace_headers)
        return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=metadata)]

    def _traced_pick(self) -> tuple[list, dict[str, str]]:
        """director.pick with the decision recorded on the request's span; (ordered, the span's W3C headers)."""
        from kvgate.epp.tracing import now_ns

        decision: dict = {}
        started = now_ns()
        ordered = self.director.pick(self.request, self.subset, trace=decision)
        self.span.decided(self.request, ordered, decision, started, now_ns())
        return ordered, self.span.traceparent()

    def _decide_without_body(self) -> pb.ProcessingResponse:
        self.path_started = time.perf_counter()
        rid = self.headers.get("x-request-id") or uuid.uuid4().hex
        self.request = LLMRequest(request_id=rid, model="", target_model="", prompt="", headers=self.headers)
        trace_headers = None
        try:
            if self.span is None:
                ordered = self.director.pick(self.request, self.subset)
            else:
                ordered, trace_headers = self._traced_pick()
        except RoutingError as exc:
            return self._refuse(exc.status, str(exc))
        self._observe_path()
        self.decided = True
        self.picked = ordered[0].address
        self._count(200)
        common, metadata = _destination(",".join(s.address for s in ordered), None, buffered_body=False,
                                        trace_headers=trace_headers)
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=metadata)

    def _observe_path(self) -> None:
        """A routed request's time in the EPP, from its body (or headers) to the decision (prepare included, flow
        control's wait not)."""
        if self.metrics is not None and self.path_started is not None:
            waited = self.request.flow_wait_s if self.request is not None else 0.0
            self.metrics.request_path_seconds.observe(max(0.0, time.perf_counter() - self.path_started - waited))

    def _count(self, code: int) -> None:
        if self.metrics is not None:
            self.metrics.request_count(code).inc()

    def release(self) -> None:
        if self.released or self.request is None or self.picked is None:
            return  # (a refused request's span ends with its stream, in Process)
        self.released = True
        if self.response_open and not self.response_body_seen:
            _warn_body_bypassed(self.director)
        usage = (find_usage(bytes(self.tail)) if self.tail else None) or (0, 0)
        self.director.release(self.request, self.picked, *usage)
        if self.span is not None:
            self.span.usage(*usage)
            self.span.end()


_body_bypass_warned = False


def _warn_body_bypassed(director: Director) -> None:
    """A response whose body never reached the EPP (a route sending it headers only): once per process, say so if a
    plugin wanted the body — it then learns nothing (docs/epp.md "Request and response bodies")."""
    global _body_bypass_warned
    if _body_bypass_warned or not director.scheduler.reads_response_body:
        return
    _body_bypass_warned = True
    log.warning("the gateway sends this EPP response headers but no response bodies, and a configured plugin "
                "(predicted-latency-scorer) learns from them: it will learn nothing; stream response bodies to the "
                "EPP (FULL_DUPLEX_STREAMED) on this pool's routes")


class ExtProcServicer(pb_grpc.ExternalProcessorServicer):
    def __init__(self, director: Director, metrics=None, report_served: bool = False,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, tracer=None) -> None:
        """`tracer`: an OpenTelemetry tracer (kvgate.common.tracing) when tracing is on: a span per stream."""
        self.director = director
        self.metrics = metrics
        self.report_served = report_served
        self.max_body_bytes = max_body_bytes
        self.tracer = tracer
        self.active = 0  # streams in flight: what a drain waits for
        self.last_started = 0.0  # event-loop time of the newest stream: a drain's lame duck waits for quiet

    async def Process(self, request_iterator, context):  # noqa: N802 - gRPC method name
        # context.read()/write() rather than iterating and yielding: grpc.aio's async-generator path costs more
        # per message.
        stream = _RequestStream(self.director, self.metrics, self.report_served, self.max_body_bytes,
                                *((self.tracer, context.invocation_metadata()) if self.tracer is not None else ()))
        self.active += 1
        self.last_started = asyncio.get_running_loop().time()
        try:
            while True:
                msg = await context.read()
                if msg is grpc.aio.EOF:
                    return
                try:
                    responses = stream.handle(msg)
                    if stream.deferred is not None:  # slow plugin work, flow control's wait: others go on
                        responses = await self._decide_after_wait(stream)
                except Exception:  # a bug must cost one request a clean 500, not the stream or the process
                    log.exception("ext-proc message failed")
                    if stream.decided:
                        raise
                    responses = [stream._refuse(500, "the endpoint picker failed on this request")]
                for response in responses:
                    await context.write(response)
        finally:
            self.active -= 1
            stream.release()  # the stream ended or broke: never leak in-flight accounting
            if stream.span is not None:
                stream.span.end()

    async def _decide_after_wait(self, stream: _RequestStream) -> list[pb.ProcessingResponse]:
        try:
            grant = await self.director.before_pick(stream.request, len(stream.deferred[0]))
        except RoutingError as exc:  # flow control's refusal: queue full, or the TTL passed
            return [stream._refuse(exc.status, str(exc), exc.headers)]
        try:
            return stream.decide()
        finally:
            if grant is not None:
                grant.release()
