"""Every operator replica's feed of snapshots: a list-and-watch of the Gateways' Envoy ConfigMaps (which the
leader writes in their xDS form), each turned into its Gateway's snapshot in a SnapshotCache.

A ConfigMap is read within bounded_json's limits and must build (snapshot.py); one that does not keeps its
Gateway's last good snapshot (logged), so a hand-edited ConfigMap cannot take a serving Gateway down. A deleted
ConfigMap leaves its snapshot out: its Envoys keep what they have. `on_reports(namespace, name)` is called when
the Envoys' reports on a ConfigMap change (ack_report.py): the leader reconciles the Gateways then.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from kvgate.common import bounded_json
from kvgate.operator import naming
from kvgate.operator.xds.ack_report import reports_of
from kvgate.operator.xds.snapshot import Snapshot, SnapshotError
from kvgate.operator.xds.snapshot_cache import SnapshotCache
from kvgate.operator.xds.xds_files import is_xds_file_set

log = logging.getLogger("kvgate.operator.xds")

SELECTOR = f"app.kubernetes.io/component=gateway,{naming.MANAGED_BY_KEY}={naming.MANAGED_BY}"
WATCH_TIMEOUT_S = 300  # the API server ends each watch after this; the source lists again
BACKOFF_S = (0.5, 30.0)


def node_of(config_map: dict) -> str | None:
    """The node id ("<namespace>/<gateway>") whose config this ConfigMap holds: its owner Gateway's."""
    meta = config_map.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("kind") == "Gateway" and ref.get("name"):
            return f"{meta.get('namespace', '')}/{ref['name']}"
    return None


def snapshot_of(config_map: dict) -> Snapshot | None:
    """The snapshot of an xDS-form ConfigMap; None for a file-form one; SnapshotError/ValueError if malformed."""
    data = config_map.get("data") or {}
    if not is_xds_file_set(data):
        return None
    files = {name: bounded_json.loads(text, bounded_json.CONFIG_BYTES) for name, text in data.items()
             if name.endswith(".yaml") and isinstance(text, str)}
    return Snapshot.from_files(files)


class ConfigMapSource:
    def __init__(self, api_client, cache: SnapshotCache, namespace: str | None = None,
                 on_reports: Callable[[str, str], None] | None = None) -> None:
        self.api_client, self.cache, self.namespace = api_client, cache, namespace
        self.on_reports = on_reports or (lambda *_: None)
        self.synced = threading.Event()  # the first list is in the cache
        self._stop = threading.Event()
        self._nodes: dict[tuple[str, str], str] = {}  # ConfigMap key -> node id
        self._reports: dict[tuple[str, str], dict] = {}
        self._thread = threading.Thread(target=self._run, name="kvgate-xds-configmaps", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def apply(self, event_type: str, config_map: dict) -> None:
        """One ConfigMap seen (ADDED, MODIFIED) or gone (DELETED)."""
        key, node = naming.key_of(config_map), node_of(config_map)
        if node is None:
            return
        if event_type == "DELETED":
            self._nodes.pop(key, None)
            self._reports.pop(key, None)
            self.cache.set(node, None)
            return
        try:
            snapshot = snapshot_of(config_map)
        except (SnapshotError, ValueError) as exc:
            log.error("ConfigMap %s/%s is not a config the xDS server can serve (its Envoys keep the last one): %s",
                      *key, exc)
            snapshot = self.cache.get(node)
        self._nodes[key] = node
        self.cache.set(node, snapshot)
        reports = reports_of(config_map)
        if reports != self._reports.get(key, {}):
            self._reports[key] = reports
            self.on_reports(*key)

    def _list_and_watch(self) -> None:
        from kubernetes import client, watch

        core = client.CoreV1Api(self.api_client)
        if self.namespace:
            lister, args = core.list_namespaced_config_map, {"namespace": self.namespace}
        else:
            lister, args = core.list_config_map_for_all_namespaces, {}
        listed = self.api_client.sanitize_for_serialization(lister(label_selector=SELECTOR, **args))
        seen = set()
        for item in listed.get("items") or []:
            seen.add(naming.key_of(item))
            self.apply("ADDED", item)
        for key in set(self._nodes) - seen:  # gone while the watch was down
            self.apply("DELETED", {"metadata": {"namespace": key[0], "name": key[1], "ownerReferences": [
                {"kind": "Gateway", "name": self._nodes[key].split("/", 1)[1]}]}})
        self.synced.set()
        stream = watch.Watch()
        for event in stream.stream(lister, label_selector=SELECTOR, timeout_seconds=WATCH_TIMEOUT_S,
                                   resource_version=(listed.get("metadata") or {}).get("resourceVersion"),
                                   _request_timeout=WATCH_TIMEOUT_S + 30, **args):
            if self._stop.is_set():
                stream.stop()
                return
            obj = event.get("raw_object") or {}
            if event.get("type") in ("ADDED", "MODIFIED", "DELETED") and obj.get("kind", "ConfigMap") == "ConfigMap":
                self.apply(event["type"], obj)

    def _run(self) -> None:
        first, cap = BACKOFF_S
        delay = first
        while not self._stop.is_set():
            try:
                self._list_and_watch()
                delay = first
            except Exception as exc:  # noqa: BLE001 - the watch restarts; Envoys keep their config meanwhile
                log.warning("the xDS ConfigMap watch failed (again in %.1fs): %s", delay, str(exc)[:300])
                self._stop.wait(delay)
                delay = min(cap, delay * 2)
