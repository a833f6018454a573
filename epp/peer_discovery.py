"""Active-active replicas in Kubernetes: the peers are the EPP's own pods (`kvgate epp --peer-sync-discover-pods
SELECTOR`, as the operator deploys them: operator/epp_peer_sync.py).

A thread lists the pods of the pool's namespace that match SELECTOR (the EPP's own labels: its Role already
reads pods there) and watches them from that list; every change gives peer sync the running pods' addresses,
`tcp://<pod IP>:<--peer-sync-bind's port>`, this pod's own left out (by name, $HOSTNAME, or IP, $POD_IP). A pod
that is being deleted is dropped at once; its state in the other replicas ages out (peer_sync.py
peer_timeout_s). A watch ends after WATCH_TIMEOUT_S and the thread lists again (a replica set is a few pods);
errors back off 0.5 s doubling to 10 s. Every call carries a client-side timeout, as epp/k8s_watch.py's.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable

from kvgate.epp.k8s_watch import REQUEST_TIMEOUT, WATCH_REQUEST_TIMEOUT, WATCH_TIMEOUT_S, apply_pod_event

log = logging.getLogger(__name__)

MAX_SELECTOR_LEN = 512
_LABEL = r"[A-Za-z0-9]([-A-Za-z0-9_./]{0,250}[A-Za-z0-9])?"
_SELECTOR = re.compile(rf"{_LABEL}=([A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?)?")


def check_selector(text: str) -> str:
    """A label selector of equalities, `k=v[,k=v...]` (what --peer-sync-discover-pods takes); ValueError if not."""
    parts = text.split(",")
    if not text or len(text) > MAX_SELECTOR_LEN or not all(_SELECTOR.fullmatch(p) for p in parts):
        raise ValueError(f"expected label equalities k=v[,k=v...] (at most {MAX_SELECTOR_LEN} characters), got "
                         f"{text[:80]!r}")
    return text


def peer_addresses(pods: dict[str, dict], port: int, own_name: str | None, own_ip: str | None) -> list[str]:
    """The running, not deleting pods' peer-sync addresses, sorted; this pod's own left out."""
    out = set()
    for name, pod in pods.items():
        status, meta = pod.get("status") or {}, pod.get("metadata") or {}
        ip = status.get("podIP")
        if not ip or status.get("phase") != "Running" or meta.get("deletionTimestamp"):
            continue
        if name == own_name or ip == own_ip:
            continue
        out.add(f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}")
    return sorted(out)


class PeerPods:
    """Watches the EPP's pods and calls `on_peers(addresses)` (from its thread) whenever the peer list changes."""

    def __init__(self, namespace: str, selector: str, port: int, on_peers: Callable[[list[str]], None],
                 core=None, own_name: str | None = None, own_ip: str | None = None) -> None:
        if core is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            core = client.CoreV1Api()
        self.core, self.namespace, self.selector, self.port = core, namespace, check_selector(selector), port
        self.on_peers = on_peers
        self.own_name = own_name if own_name is not None else os.environ.get("HOSTNAME")
        self.own_ip = own_ip if own_ip is not None else os.environ.get("POD_IP")
        self._pods: dict[str, dict] = {}
        self._peers: list[str] | None = None
        self._stop = threading.Event()
        self._watch = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="peer-pods", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            self._thread.join(timeout=REQUEST_TIMEOUT[0] + REQUEST_TIMEOUT[1])

    def _publish(self) -> None:
        peers = peer_addresses(self._pods, self.port, self.own_name, self.own_ip)
        if peers != self._peers:
            self._peers = peers
            self.on_peers(peers)

    def list_and_watch(self) -> None:
        """One round: list the pods, then watch them until the server ends the watch (or stop)."""
        from kubernetes import watch

        resp = self.core.list_namespaced_pod(self.namespace, label_selector=self.selector, _preload_content=False,
                                             _request_timeout=REQUEST_TIMEOUT)
        body = json.loads(resp.data)
        self._pods = {p["metadata"]["name"]: p for p in body.get("items") or []
                      if (p.get("metadata") or {}).get("name")}
        self._publish()
        version = (body.get("metadata") or {}).get("resourceVersion")
        w = watch.Watch()
        self._watch = w
        try:
            for event in w.stream(self.core.list_namespaced_pod, self.namespace, label_selector=self.selector,
                                  resource_version=version, timeout_seconds=WATCH_TIMEOUT_S,
                                  _request_timeout=WATCH_REQUEST_TIMEOUT):
                if event.get("type") == "ERROR":  # 410 Gone and the like: list again
                    break
                apply_pod_event(self._pods, event)
                self._publish()
                if self._stop.is_set():
                    break
        finally:
            self._watch = None
            w.stop()

    def _loop(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                self.list_and_watch()
                backoff = 0.5
            except Exception as exc:  # noqa: BLE001 - a dropped connection, an API error: list again after a pause
                if self._stop.is_set():
                    break
                log.warning("peer pods of %s (%s): %s", self.namespace, self.selector, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
