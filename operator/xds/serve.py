"""Starts an operator replica's xDS side: the ConfigMap source feeding the snapshot cache, the ADS server, and
the writer of the Envoys' answers. Runs in every replica, whether it leads the reconciling or not."""

from __future__ import annotations

from typing import Callable

from kvgate.operator.apply import Kube
from kvgate.operator.xds.ack_report import AckWriter
from kvgate.operator.xds.ads_server import AdsServer
from kvgate.operator.xds.configmap_source import ConfigMapSource
from kvgate.operator.xds.snapshot_cache import SnapshotCache

# How long the server waits for the first list of ConfigMaps before it listens: an Envoy that connects earlier
# would wait anyway (no snapshot yet), but a replica that cannot list should not look ready to serve.
FIRST_LIST_WAIT_S = 30.0


def start_xds(kube: Kube, namespace: str | None, host: str, port: int, max_streams: int,
              on_reports: Callable[[str, str], None]) -> tuple[ConfigMapSource, AdsServer]:
    cache = SnapshotCache()
    source = ConfigMapSource(kube.api, cache, namespace, on_reports)
    source.start()
    source.synced.wait(FIRST_LIST_WAIT_S)
    server = AdsServer(cache, host, port, max_streams, on_status=AckWriter(kube))
    server.start()
    return source, server
