"""OpenTelemetry tracing for kvgate's processes (the EPP, `kvgate serve`): off unless an OTLP endpoint is configured.

Configured the standard way: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT (or a component's
`--otlp-traces-endpoint` flag, which wins), OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (the
SDK reads them; default parentbased_always_on: a sampled parent is always followed, an unsampled one never), the
batch processor's OTEL_BSP_* and the exporter's OTEL_EXPORTER_OTLP_* settings. With no endpoint, `setup` returns
None and neither the OpenTelemetry SDK nor the API is imported: the disabled path costs a `None` check per request.

Spans go out over OTLP/gRPC through a BatchSpanProcessor: a bounded queue (spans beyond it are dropped, never
block a request) and a bounded export timeout, so a slow or dead collector costs memory up to the queue's bound
and nothing on the request path.

W3C trace context (`traceparent`, `tracestate`) is read from and written to plain header dicts by `extract` and
`inject`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from kvgate.common.errors import ConfigError

ENDPOINT_ENV = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_ENV = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
DEFAULT_MAX_QUEUE_SIZE = 2048  # spans waiting for export; more are dropped
DEFAULT_EXPORT_TIMEOUT_MS = 10_000  # one export call, before it gives up


class TracingConfigError(ConfigError):
    """An OTEL_* setting kvgate cannot honour (an OTLP protocol other than grpc), or tracing asked for without the
    OpenTelemetry SDK installed: `kvgate` prints it as one line and exits 2."""


def configured_endpoint(flag: str | None = None) -> str | None:
    """The OTLP endpoint traces go to: the flag, else the standard environment variables; None: tracing is off."""
    if flag:
        return flag
    for name in ENDPOINT_ENV:
        value = os.environ.get(name, "").strip()
        if value:
            return value
    return None


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise TracingConfigError(f"{name} must be an integer, got {value!r}") from None


class Tracing:
    """A configured tracer provider: `tracer` starts spans; `shutdown` flushes what is queued (bounded)."""

    def __init__(self, provider, tracer, endpoint: str) -> None:
        self.provider = provider
        self.tracer = tracer
        self.endpoint = endpoint

    def shutdown(self) -> None:
        self.provider.shutdown()


def setup(component: str, endpoint_flag: str | None = None) -> Tracing | None:
    """The process's tracing for `component` (its default service name, e.g. "kvgate-epp"), or None when no OTLP
    endpoint is configured. Raises TracingConfigError for settings it cannot honour."""
    endpoint = configured_endpoint(endpoint_flag)
    if endpoint is None:
        return None
    protocol = next((os.environ[n].strip() for n in PROTOCOL_ENV if os.environ.get(n, "").strip()), "grpc")
    if protocol != "grpc":
        raise TracingConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL {protocol!r}: kvgate exports traces over OTLP/gRPC "
                                 "only (grpc)")
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise TracingConfigError(f"an OTLP endpoint is configured ({endpoint}) but the OpenTelemetry SDK is not "
                                 f"installed ({exc.name}): pip install opentelemetry-sdk "
                                 "opentelemetry-exporter-otlp-proto-grpc") from None

    service = os.environ.get("OTEL_SERVICE_NAME", "").strip() or component
    # The sampler comes from OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG (the SDK's own reading of them).
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service}))
    timeout_ms = _env_int("OTEL_BSP_EXPORT_TIMEOUT", DEFAULT_EXPORT_TIMEOUT_MS)
    exporter = OTLPSpanExporter(endpoint=endpoint, timeout=timeout_ms / 1000)
    provider.add_span_processor(BatchSpanProcessor(
        exporter, max_queue_size=_env_int("OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_MAX_QUEUE_SIZE),
        export_timeout_millis=timeout_ms))
    return Tracing(provider, provider.get_tracer(f"kvgate.{component}"), endpoint)


def extract(headers: Mapping[str, str]):
    """The parent context a request's W3C headers carry (an empty context when they carry none or a bad one)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(headers)


def inject(span) -> dict[str, str]:
    """The W3C headers naming `span` as the parent of what a request does next."""
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, trace.set_span_in_context(span))
    return carrier
