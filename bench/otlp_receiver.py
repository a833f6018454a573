"""An OTLP/gRPC trace collector in this process (opentelemetry-proto's TraceService on a loopback port): what the
tracing test and `kvgate bench epp --tracing` send spans to. It keeps every span with its service's name, and the
raw requests (so a test can check what bytes left a process)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, keep_raw: bool = True) -> None:
        self.lock = threading.Lock()
        self.keep_raw = keep_raw
        self.raw: list[bytes] = []
        self.spans: list[tuple[str, object]] = []  # (service.name, opentelemetry.proto.trace.v1 Span)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def Export(self, request, context):  # noqa: N802 - gRPC method name
        with self.lock:
            if self.keep_raw:
                self.raw.append(request.SerializeToString())
            for resource_spans in request.resource_spans:
                service = next((a.value.string_value for a in resource_spans.resource.attributes
                                if a.key == "service.name"), "")
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((service, s) for s in scope_spans.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def count(self) -> int:
        with self.lock:
            return len(self.spans)

    def trace(self, trace_id: bytes) -> list[tuple[str, object]]:
        """The spans of one trace, (service, span)."""
        with self.lock:
            return [(svc, s) for svc, s in self.spans if s.trace_id == trace_id]

    def wait_for(self, names: set[str], timeout: float, trace_id: bytes | None = None
                 ) -> dict[str, tuple[str, object]]:
        """{span name: (service, span)} once a span of every name in `names` has arrived, of trace `trace_id` if
        given (AssertionError if not in `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                by_name = {s.name: (svc, s) for svc, s in self.spans if trace_id is None or s.trace_id == trace_id}
            if names <= by_name.keys():
                return by_name
            if time.monotonic() > deadline:
                raise AssertionError(f"spans {sorted(names - by_name.keys())} never arrived; got {sorted(by_name)}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.server.stop(grace=None)
