"""Kubernetes mode: keep the datastore in step with an InferencePool, its pods and its policies.

A pod watch (selector from the pool) triggers a recompute at once; the pool itself and the
InferenceObjective / InferenceModelRewrite objects are re-read on every recompute and at least every
`resync` seconds. Errors back off and retry; the translation to endpoints is datastore.pool_endpoints().
"""

from __future__ import annotations

import logging
import threading

from kvgate.epp.datastore import Datastore, parse_objectives, parse_rewrites, pool_endpoints

log = logging.getLogger(__name__)

POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
POLICY_GROUP, POLICY_VERSION = "inference.networking.x-k8s.io", "v1alpha2"


class PoolWatcher:
    def __init__(self, datastore: Datastore, pool_name: str, namespace: str, resync: float = 5.0) -> None:
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        self.core = client.CoreV1Api()
        self.custom = client.CustomObjectsApi()
        self.datastore = datastore
        self.pool_name, self.namespace = pool_name, namespace
        self.resync = resync
        self._stop = threading.Event()
        self._kick = threading.Event()
        self._threads: list[threading.Thread] = []
        self._forbidden: set[str] = set()

    def start(self) -> None:
        for target, name in ((self._sync_loop, "pool-sync"), (self._pod_watch_loop, "pod-watch")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self._kick.set()

    def _list_policies(self, plural: str) -> list[dict]:
        from kubernetes.client.exceptions import ApiException

        try:
            items = self.custom.list_namespaced_custom_object(POLICY_GROUP, POLICY_VERSION, self.namespace, plural)
        except ApiException as exc:
            if exc.status == 404:  # CRD not installed: no policies
                return []
            if exc.status == 403:  # RBAC grants only pods and pools (upstream's minimal EPP role): no policies
                if plural not in self._forbidden:
                    self._forbidden.add(plural)
                    log.warning("not allowed to list %s in %s: running without them", plural, self.namespace)
                return []
            raise
        return items.get("items", [])

    def sync_once(self) -> None:
        pool = self.custom.get_namespaced_custom_object(POOL_GROUP, POOL_VERSION, self.namespace, POOL_PLURAL,
                                                        self.pool_name)
        selector = ",".join(f"{k}={v}" for k, v in ((pool.get("spec") or {}).get("selector") or {})
                            .get("matchLabels", {}).items())
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector or None)
        pod_dicts = [self.core.api_client.sanitize_for_serialization(p) for p in pods.items]
        self.datastore.set_endpoints(pool_endpoints(pool, pod_dicts))
        self.datastore.set_policies(
            parse_objectives(self._list_policies("inferenceobjectives"), self.pool_name),
            parse_rewrites(self._list_policies("inferencemodelrewrites"), self.pool_name))

    def _sync_loop(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                self.sync_once()
                backoff = 0.5
                self._kick.wait(self.resync)
            except Exception as exc:  # noqa: BLE001 - API hiccups: log, back off, retry
                log.warning("syncing pool %s/%s failed: %s", self.namespace, self.pool_name, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
            self._kick.clear()

    def _pod_watch_loop(self) -> None:
        from kubernetes import watch

        backoff = 0.5
        while not self._stop.is_set():
            try:
                w = watch.Watch()
                for _ in w.stream(self.core.list_namespaced_pod, self.namespace, timeout_seconds=30):
                    self._kick.set()
                    if self._stop.is_set():
                        w.stop()
                        break
                backoff = 0.5
            except Exception as exc:  # noqa: BLE001
                log.warning("pod watch failed: %s", exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
