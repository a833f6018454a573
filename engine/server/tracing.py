"""The engine server's request spans (OpenTelemetry, kvgate.common.tracing), as vLLM traces a request: one
`llm_request` span per API request, a child of the `traceparent` it came with (the gateway's span), with the
engine's timeline as child spans — `llm_request.queue` (arrival to first scheduled), `llm_request.prefill` (to the
first token) and `llm_request.decode` (to the end) — and the GenAI semantic conventions' attributes: the model, the
sampling parameters (max_tokens, temperature, top_p, n), the response id, the token counts, the time in queue, the
time to first token and the end-to-end time. Never the prompt's or the output's text.

Off unless an OTLP endpoint is configured (`kvgate serve --otlp-traces-endpoint`, vLLM's flag, or OTEL_* variables):
the routes then create no RequestTrace, and the tracker's hooks are `None` checks.

The span is written once the request ends (RequestTracker.close), its times taken from the tracker and from the
engine's per-sample timestamps (RequestOutput.metrics: arrival, scheduled, first token, finished; the first
finished sample's), converted from the monotonic clock to wall-clock time.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

LLM_REQUEST = "llm_request"


def _wall_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as wall-clock nanoseconds (what span times are)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class RequestTrace:
    """One API request's span, written when its tracker closes (`end`)."""

    def __init__(self, tracer, headers: Mapping[str, str], operation: str, model: str, params) -> None:
        from kvgate.common.tracing import extract

        self.tracer = tracer
        self.operation = operation  # GenAI's gen_ai.operation.name: "chat" or "text_completion"
        self.parent = extract({k: headers[k] for k in ("traceparent", "tracestate") if k in headers})
        self.model = model
        self.params = params  # the first prompt's SamplingParams (after the model's defaults)
        self.response_id: str | None = None
        self.timeline: Mapping | None = None  # the first finished sample's RequestOutput.metrics
        self.finish_reasons: list[str] = []

    def sample_finished(self, finish_reason: str | None, metrics: Mapping) -> None:
        if self.timeline is None and metrics:
            self.timeline = metrics
        if len(self.finish_reasons) < 16:
            self.finish_reasons.append(finish_reason or "abort")

    def end(self, tracker) -> None:
        """Write the span: `tracker` (metrics.RequestTracker) holds the request's tokens and times."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind, Status, StatusCode

        start, end = _wall_ns(tracker.arrival), time.time_ns()
        span = self.tracer.start_span(LLM_REQUEST, context=self.parent, kind=SpanKind.SERVER, start_time=start)
        p = self.params
        attributes = {
            "gen_ai.operation.name": self.operation,
            "gen_ai.request.model": self.model,
            "gen_ai.request.temperature": float(p.temperature),
            "gen_ai.request.top_p": float(p.top_p),
            "gen_ai.request.n": int(p.n),
            "gen_ai.usage.input_tokens": tracker.num_prompt_tokens,
            "gen_ai.usage.output_tokens": tracker.generated,
            "gen_ai.latency.e2e": (end - start) / 1e9,
        }
        if p.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = int(p.max_tokens)
        if self.response_id is not None:
            attributes["gen_ai.response.id"] = self.response_id
        if self.finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = self.finish_reasons
        if tracker.first_token_time is not None:
            attributes["gen_ai.latency.time_to_first_token"] = tracker.first_token_time - tracker.arrival
        timeline = self.timeline or {}
        arrival, scheduled = timeline.get("arrival_time"), timeline.get("scheduled_time")
        first, finished = timeline.get("first_token_time"), timeline.get("finished_time")
        if arrival is not None and scheduled is not None:
            attributes["gen_ai.latency.time_in_queue"] = max(scheduled - arrival, 0.0)
        span.set_attributes(attributes)
        if tracker.unfinished_samples > 0:
            span.set_status(Status(StatusCode.ERROR, "the request ended before its samples finished"))
        parent = trace.set_span_in_context(span)
        for name, begin, until in (("queue", arrival, scheduled), ("prefill", scheduled, first),
                                   ("decode", first, finished)):
            if begin is not None and until is not None:
                child = self.tracer.start_span(f"{LLM_REQUEST}.{name}", context=parent,
                                               start_time=_wall_ns(begin))
                child.end(end_time=max(_wall_ns(until), _wall_ns(begin)))
        span.end(end_time=end)


class EngineTracing:
    """The server's tracer: a RequestTrace per admitted request."""

    def __init__(self, tracing) -> None:
        self.tracing = tracing  # kvgate.common.tracing.Tracing

    def start(self, headers: Mapping[str, str], operation: str, model: str, prep) -> RequestTrace:
        """Trace the admitted request `prep` (openai_serving.Prepared): its tracker writes the span when it closes."""
        trace = RequestTrace(self.tracing.tracer, headers, operation, model, prep.params[0])
        prep.tracker.trace = trace
        return trace

    def shutdown(self) -> None:
        self.tracing.shutdown()
