"""The EPP's real exporter (epp/metrics.py's EppMetrics and EndpointGauges) serving a snapshot a test sets, on
loopback: the page the operator's autoscaler reads, without an EPP's event loop behind it."""

from __future__ import annotations

import time

from prometheus_client import generate_latest, start_http_server

from kvgate.epp.metrics import EndpointGauges, EndpointRow, EppMetrics, Snapshot


class FakeEpp:
    """The EPP's exporter (EppMetrics + EndpointGauges) with a snapshot set by the test, served on loopback."""

    def __init__(self) -> None:
        self.metrics = EppMetrics()
        self.gauges = EndpointGauges(director=None)
        self.metrics.registry.register(self.gauges)
        self.server, self.thread = start_http_server(0, "127.0.0.1", registry=self.metrics.registry)
        self.port = self.server.server_port

    def set(self, endpoints: list[tuple[int, int, float]], held: int = 0, flow: bool = True) -> None:
        """endpoints: (waiting, running, kv) each, all in rotation; `held` requests in flow control."""
        now = time.monotonic()
        rows = tuple(EndpointRow(f"10.0.0.{i}:8000", w, r, kv, now, r, False, True)
                     for i, (w, r, kv) in enumerate(endpoints))
        self.gauges.snapshot = Snapshot(rows, flow_rows=(("default", 0, held, 100 * held),) if flow else None)

    def page(self) -> str:
        return generate_latest(self.metrics.registry).decode()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
