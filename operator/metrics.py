"""The operator's own Prometheus metrics (`kvgate operator --metrics-port`): whether this replica leads, and the
autoscaler's decisions and signals (autoscale_metrics.py, `autoscale`, handed to the Autoscaler).

kvgate_operator_leader                 1 while this replica holds the leader Lease and reconciles (1 without
                                       leader election: the one replica always does), else 0
kvgate_operator_leader_transitions_total  times this replica started or stopped leading
kvgate_operator_autoscale_*            per autoscaled ModelServer: see autoscale_metrics.py
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from kvgate.operator.autoscale_metrics import AutoscaleMetrics


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.leader = Gauge("kvgate_operator_leader", "1 while this operator replica holds the leader Lease and "
                            "reconciles (always 1 without leader election), else 0", registry=self.registry)
        self.transitions = Counter("kvgate_operator_leader_transitions", "Times this operator replica started or "
                                   "stopped leading", registry=self.registry)
        self.leader.set(1)
        self.autoscale = AutoscaleMetrics()
        self.registry.register(self.autoscale)
        self._server = None

    def set_leader(self, leading: bool, transition: bool = False) -> None:
        self.leader.set(1 if leading else 0)
        if transition:
            self.transitions.inc()

    def serve(self, host: str, port: int) -> None:
        """Serve /metrics at http://HOST:PORT (a daemon thread; `close` stops it)."""
        self._server, _ = start_http_server(port, addr=host, registry=self.registry)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
