"""The EPP's request spans (OpenTelemetry, kvgate.common.tracing): one `gateway.request` span per ext-proc stream,
with a `gateway.scheduling` child for the decision.

Parent: the trace context Envoy sends on the ext-proc stream. Envoy's tracer puts it in the gRPC metadata of the
stream (its `async ...ExternalProcessor.Process egress` span, a child of Envoy's ingress span); without one there,
the request's own `traceparent` header (a client's, passed on by an Envoy that does not trace). The EPP writes its
span's `traceparent` into the request headers it mutates, so an engine behind an Envoy that does not trace is a
child of the EPP's span; an Envoy that traces re-parents the upstream request on its own ingress span (its router
overwrites `traceparent`), and the engine's span is then the EPP's sibling in the same trace.

Attributes: the decision (the endpoint picked, the fallbacks), the number of candidates, the top candidates'
scores (at most TOP_SCORES), the scheduling profile, flow control's wait, each plugin's time in this decision, the
answer's status. Never the prompt or any header value but the request id.
"""

from __future__ import annotations

import time

TOP_SCORES = 5  # candidates whose total score a span carries
GATEWAY_REQUEST = "gateway.request"
GATEWAY_SCHEDULING = "gateway.scheduling"


class RequestSpan:
    """The span of one ext-proc stream, ended once (`end`)."""

    def __init__(self, tracer, grpc_metadata, headers: dict[str, str]) -> None:
        from opentelemetry.trace import SpanKind

        from kvgate.common.tracing import TRACEPARENT, extract

        carrier = {k: v for k, v in (grpc_metadata or ()) if k in (TRACEPARENT, "tracestate")}
        if TRACEPARENT not in carrier:
            carrier = headers
        attributes = {"http.request.method": headers.get(":method", ""),
                      "url.path": headers.get(":path", "").split("?", 1)[0][:256]}
        if "x-request-id" in headers:
            attributes["kvgate.request_id"] = headers["x-request-id"][:128]
        self.tracer = tracer
        self.span = tracer.start_span(GATEWAY_REQUEST, context=extract(carrier), kind=SpanKind.SERVER,
                                      attributes=attributes)
        self.ended = False

    def traceparent(self) -> dict[str, str]:
        """The W3C headers that make this span the parent of the upstream request."""
        from kvgate.common.tracing import inject

        return inject(self.span)

    def request_parsed(self, request) -> None:
        attributes = {"gen_ai.request.model": request.model or ""}
        if request.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = request.max_tokens
        self.span.set_attributes(attributes)

    def decided(self, request, ordered, decision: dict, started_ns: int, ended_ns: int) -> None:
        """The pick: `decision` is what Director.pick recorded (candidates, scores, profile, plugin times)."""
        destination = ordered[0].address
        attributes = {"kvgate.epp.destination_endpoint": destination, "kvgate.epp.priority": request.priority,
                      "kvgate.epp.fallback_endpoints": [s.address for s in ordered[1:TOP_SCORES]],
                      "http.response.status_code": 200}
        if request.target_model and request.target_model != request.model:
            attributes["gen_ai.request.target_model"] = request.target_model
        if request.flow_wait_s:
            attributes["kvgate.epp.flow_control.wait_ms"] = request.flow_wait_s * 1000
        self.span.set_attributes(attributes)
        scores = decision.get("scores", ())
        scheduling = {"kvgate.epp.candidates": decision.get("candidates", 0),
                      "kvgate.epp.profile": decision.get("profile", ""),
                      "kvgate.epp.destination_endpoint": destination,
                      "kvgate.epp.top_scores.endpoints": [a for a, _ in scores],
                      "kvgate.epp.top_scores.values": [v for _, v in scores]}
        for (point, name), seconds in decision.get("plugins", {}).items():
            scheduling[f"kvgate.epp.plugin.{point}.{name}.ms"] = seconds * 1000
        self.tracer.start_span(GATEWAY_SCHEDULING, context=_context_of(self.span), start_time=started_ns,
                               attributes=scheduling).end(end_time=ended_ns)

    def refused(self, status: int, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode

        self.span.set_attribute("http.response.status_code", status)
        self.span.set_status(Status(StatusCode.ERROR, message[:200]))

    def usage(self, prompt_tokens: int, completion_tokens: int) -> None:
        self.span.set_attributes({"gen_ai.usage.input_tokens": prompt_tokens,
                                  "gen_ai.usage.output_tokens": completion_tokens})

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.span.end()


def _context_of(span):
    from opentelemetry import trace

    return trace.set_span_in_context(span)


def now_ns() -> int:
    return time.time_ns()
