"""What each Envoy ACKed or NACKed, from the operator replica that holds its xDS stream to the Gateway's
Programmed condition, written by the leader.

Any replica may hold an Envoy's stream, and only the leader writes statuses, so the replica records the Envoy's
answer as one annotation on the Gateway's Envoy ConfigMap (the object the leader writes and every replica
watches): `xds.kvgate.dev/<pod>: {"version": <snapshot version>, "error": <NACK text, or "">}`, merge-patched
by field manager kvgate-xds (one key per pod, so replicas never overwrite each other's; the leader's server-side
apply leaves keys it does not own alone). Each replica's ConfigMap watch (configmap_source.py) wakes the
Gateways' reconcile when those annotations change; the leader then compares them with the version of the config it
rendered (xds_programmed) and drops the keys of pods that are gone.
"""

from __future__ import annotations

import json
import logging
import queue
import re
import threading

from kvgate.operator import naming
from kvgate.operator.apply import CONFIGMAP, ApiError, Kube

log = logging.getLogger("kvgate.operator.xds")

PREFIX = "xds.kvgate.dev/"
FIELD_MANAGER = "kvgate-xds"
MAX_MESSAGE_CHARS = 1024
RETRY_S = 2.0  # after a failed write of a report
_POD_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,61}[a-z0-9])?$")  # fits an annotation name's 63 characters
_VERSION = re.compile(r"^[0-9a-f]{1,64}$")


def annotation_key(pod: str) -> str | None:
    """The annotation of an Envoy pod's report; None for a name that is not a pod's (a node's claim, unchecked)."""
    return PREFIX + pod if _POD_NAME.match(pod or "") else None


def report_value(version: str, error: str) -> str:
    return json.dumps({"version": version, "error": error[:MAX_MESSAGE_CHARS]}, sort_keys=True)


def reports_of(config_map: dict | None) -> dict[str, tuple[str, str]]:
    """{pod: (version, error)} of the Envoys' reports on a ConfigMap; malformed entries are skipped."""
    out = {}
    for key, value in (((config_map or {}).get("metadata") or {}).get("annotations") or {}).items():
        if not key.startswith(PREFIX) or not isinstance(value, str) or len(value) > 4 * MAX_MESSAGE_CHARS:
            continue
        try:
            report = json.loads(value)
            version, error = report["version"], report.get("error", "")
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        if isinstance(version, str) and _VERSION.match(version) and isinstance(error, str):
            out[key[len(PREFIX):]] = (version, error[:MAX_MESSAGE_CHARS])
    return out


def xds_programmed(reports: dict[str, tuple[str, str]], ready_pods: list[str], version: str) -> tuple[bool, str, str]:
    """(Programmed, reason, message) of a Gateway whose config is snapshot `version`: True once every ready Envoy
    pod (at least one) ACKed it; False "Invalid" with Envoy's error when one NACKed it."""
    for pod in sorted(reports):
        got, error = reports[pod]
        if got == version and error:
            return False, "Invalid", f"Envoy {pod} rejected config {version}: {error}"[:MAX_MESSAGE_CHARS + 100]
    acked = sorted(p for p in ready_pods if reports.get(p) == (version, ""))
    if ready_pods and len(acked) == len(ready_pods):
        return True, "Programmed", f"{len(acked)} Envoy(s) serve config {version}"
    return False, "Pending", f"{len(acked)} of {len(ready_pods)} ready Envoy(s) serve config {version}"


def stale_keys(config_map: dict | None, live_pods: set[str]) -> list[str]:
    """The report annotations of pods that no longer exist."""
    annotations = ((config_map or {}).get("metadata") or {}).get("annotations") or {}
    return sorted(k for k in annotations if k.startswith(PREFIX) and k[len(PREFIX):] not in live_pods)


def patch_annotations(kube: Kube, namespace: str, name: str, annotations: dict[str, str | None]) -> None:
    """Merge-patch annotations of the ConfigMap (None deletes a key); nothing when it is gone."""
    try:
        kube.request("PATCH", CONFIGMAP.path(namespace, name), {"metadata": {"annotations": annotations}},
                     query={"fieldManager": FIELD_MANAGER}, content_type="application/merge-patch+json")
    except ApiError as exc:
        if exc.status != 404:
            raise


class AckWriter:
    """Writes the reports of the Envoys whose streams this replica holds, from a thread of its own (the xDS
    server's loop only queues them). At most `limit` reports wait; the latest per Envoy wins."""

    def __init__(self, kube: Kube, limit: int = 1000) -> None:
        self.kube, self.limit = kube, limit
        self._pending: dict[tuple[str, str], tuple[str, str]] = {}
        self._lock = threading.Lock()
        self._wake: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvgate-xds-acks", daemon=True)
        self._thread.start()

    def __call__(self, node_id: str, envoy: str, version: str, error: str) -> None:
        """The xDS server's on_status: queue one report."""
        key = annotation_key(envoy)
        if key is None or node_id.count("/") != 1:
            log.warning("not recording the answer of Envoy %r of %r: not a pod name", envoy[:80], node_id[:120])
            return
        with self._lock:
            if len(self._pending) >= self.limit and (node_id, envoy) not in self._pending:
                log.warning("dropping the answer of Envoy %s: %d reports wait", envoy, self.limit)
                return
            self._pending[(node_id, envoy)] = (version, error)
        self._wake.put(None)

    def _run(self) -> None:
        while True:
            self._wake.get()
            with self._lock:
                batch, self._pending = self._pending, {}
            for (node_id, envoy), (version, error) in sorted(batch.items()):
                ns, gateway = node_id.split("/")
                name = naming.envoy_name({"metadata": {"name": gateway}})
                try:
                    patch_annotations(self.kube, ns, name, {annotation_key(envoy): report_value(version, error)})
                except Exception as exc:  # noqa: BLE001 - tried again below, unless a newer answer came
                    log.warning("cannot record Envoy %s's answer on ConfigMap %s/%s (again in %.0f s): %s", envoy,
                                ns, name, RETRY_S, exc)
                    threading.Timer(RETRY_S, self._retry, ((node_id, envoy), (version, error))).start()

    def _retry(self, key: tuple[str, str], report: tuple[str, str]) -> None:
        with self._lock:
            self._pending.setdefault(key, report)
        self._wake.put(None)
