"""The snapshots an xDS server serves, by node id ("<namespace>/<gateway>"), shared between the thread that
builds them (configmap_source.py) and the server's event loop, which is told of each change."""

from __future__ import annotations

import threading
from typing import Callable

from kvgate.operator.xds.snapshot import Snapshot


class SnapshotCache:
    def __init__(self) -> None:
        self._snapshots: dict[str, Snapshot] = {}
        self._lock = threading.Lock()
        self._watchers: list[Callable[[str], None]] = []

    def get(self, node_id: str) -> Snapshot | None:
        with self._lock:
            return self._snapshots.get(node_id)

    def set(self, node_id: str, snapshot: Snapshot | None) -> None:
        """Serve `snapshot` to `node_id` from now on (None: nothing more; Envoys keep what they have)."""
        with self._lock:
            before = self._snapshots.get(node_id)
            if snapshot is None:
                self._snapshots.pop(node_id, None)
            else:
                self._snapshots[node_id] = snapshot
            watchers = list(self._watchers)
        if (before and before.version) != (snapshot and snapshot.version):
            for watcher in watchers:
                watcher(node_id)

    def nodes(self) -> list[str]:
        with self._lock:
            return sorted(self._snapshots)

    def watch(self, watcher: Callable[[str], None]) -> None:
        """Call watcher(node_id) (from the setting thread; it must not block) when a node's snapshot changes."""
        with self._lock:
            self._watchers.append(watcher)
