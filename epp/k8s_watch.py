"""Kubernetes mode: keep the datastore in step with an InferencePool, its pods and its policies.

Two threads. The pod watch lists the pool's pods once (label-selected with the pool's selector), then watches
them from that list's resourceVersion: each event updates that one pod in a local cache and recomputes the
endpoints from it (datastore.pool_endpoints, pure) — no API call per event. A watch ends after
WATCH_TIMEOUT_S (the API server closes it) and resumes from the last resourceVersion seen; only a 410 Gone
(that version is too old), an error, or a change of the pool's selector re-lists. The pool sync re-reads the
InferencePool and the InferenceObjective / InferenceModelRewrite objects every `resync` seconds.

Every API call carries a client-side timeout (`_request_timeout`): REQUEST_TIMEOUT for gets and lists, and a
read timeout longer than WATCH_TIMEOUT_S for watches, so a connection that died silently is noticed.
Errors back off (0.5 s doubling to 10 s) and retry.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping

from kvgate.epp.datastore import Datastore, parse_objectives, parse_rewrites, pool_endpoints

log = logging.getLogger(__name__)

POOL_GROUP, POOL_VERSION, POOL_PLURAL = "inference.networking.k8s.io", "v1", "inferencepools"
POLICY_GROUP, POLICY_VERSION = "inference.networking.x-k8s.io", "v1alpha2"
POLICY_PLURALS = ("inferenceobjectives", "inferencemodelrewrites")

REQUEST_TIMEOUT = (5.0, 15.0)  # (connect, read) seconds for every get and list
WATCH_TIMEOUT_S = 60  # the API server ends each pod watch after this; it is resumed, not re-listed
WATCH_REQUEST_TIMEOUT = (5.0, WATCH_TIMEOUT_S + 15.0)  # no byte for this long: the connection is dead
GONE = 410


def label_selector(pool: Mapping) -> str:
    """The pool's matchLabels as a label selector ("a=b,c=d"); "" when it selects nothing."""
    labels = ((pool.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def apply_pod_event(pods: dict[str, dict], event: Mapping) -> str | None:
    """One watch event into the pod cache (name -> pod); returns the event's resourceVersion, if any."""
    obj = event.get("raw_object") or event.get("object") or {}
    meta = obj.get("metadata") or {}
    kind, name = event.get("type"), meta.get("name")
    if kind in ("ADDED", "MODIFIED") and name:
        pods[name] = obj
    elif kind == "DELETED" and name:
        pods.pop(name, None)
    return meta.get("resourceVersion")


class PoolWatcher:
    def __init__(self, datastore: Datastore, pool_name: str, namespace: str, resync: float = 5.0,
                 core=None, custom=None) -> None:
        if core is None or custom is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            core, custom = client.CoreV1Api(), client.CustomObjectsApi()
        self.core, self.custom = core, custom
        self.datastore = datastore
        self.pool_name, self.namespace = pool_name, namespace
        self.resync = resync
        self._stop = threading.Event()
        self._pool_known = threading.Event()
        self._lock = threading.Lock()
        self._pool: Mapping = {}
        self._pods: dict[str, dict] = {}
        self._selector: str | None = None  # the selector the pod cache was listed with; None: list again
        self._resource_version: str | None = None
        self._watch = None  # the running kubernetes Watch, stopped to break out of it
        self._interrupted = threading.Event()  # set when sync_pool broke the watch on purpose
        self._threads: list[threading.Thread] = []
        self._forbidden: set[str] = set()

    def start(self) -> None:
        for target, name in ((self._sync_loop, "pool-sync"), (self._pod_watch_loop, "pod-watch")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        self._stop.set()
        self._pool_known.set()
        self._interrupt_watch()

    def _interrupt_watch(self) -> None:
        watch = self._watch
        if watch is not None:
            watch.stop()

    def _publish(self) -> None:  # with self._lock held
        self.datastore.set_endpoints(pool_endpoints(self._pool, list(self._pods.values())))

    # --- the pool and its policies ---------------------------------------------------------------------

    def _list_policies(self, plural: str) -> list[dict]:
        from kubernetes.client.exceptions import ApiException

        try:
            items = self.custom.list_namespaced_custom_object(POLICY_GROUP, POLICY_VERSION, self.namespace, plural,
                                                              _request_timeout=REQUEST_TIMEOUT)
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

    def sync_pool(self) -> None:
        """Re-read the pool and the policies; a new selector makes the pod watch re-list."""
        pool = self.custom.get_namespaced_custom_object(POOL_GROUP, POOL_VERSION, self.namespace, POOL_PLURAL,
                                                        self.pool_name, _request_timeout=REQUEST_TIMEOUT)
        with self._lock:
            reselect = self._selector is not None and label_selector(pool) != self._selector
            self._pool = pool
            if reselect:
                self._selector = None
            elif self._selector is not None:
                self._publish()  # the target ports may have changed
        self._pool_known.set()
        if reselect and self._watch is not None:
            self._interrupted.set()
            self._interrupt_watch()
        objectives, rewrites = (self._list_policies(plural) for plural in POLICY_PLURALS)
        self.datastore.set_policies(parse_objectives(objectives, self.pool_name),
                                    parse_rewrites(rewrites, self.pool_name))

    def _sync_loop(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                self.sync_pool()
                backoff = 0.5
                self._stop.wait(self.resync)
            except Exception as exc:  # noqa: BLE001 - API hiccups: log, back off, retry
                log.warning("syncing pool %s/%s failed: %s", self.namespace, self.pool_name, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)

    # --- the pods ----------------------------------------------------------------------------------------

    def relist_pods(self) -> None:
        """List the pool's pods (label-selected): the cache and the resourceVersion to watch from."""
        with self._lock:
            selector = label_selector(self._pool)
        if not selector:  # a pool without a selector selects nothing: do not list the namespace
            items, version = [], None
        else:
            resp = self.core.list_namespaced_pod(self.namespace, label_selector=selector, _preload_content=False,
                                                 _request_timeout=REQUEST_TIMEOUT)
            body = json.loads(resp.data)
            items, version = body.get("items") or [], (body.get("metadata") or {}).get("resourceVersion")
        with self._lock:
            self._pods = {p["metadata"]["name"]: p for p in items if (p.get("metadata") or {}).get("name")}
            self._selector, self._resource_version = selector, version
            self._publish()

    def watch_pods(self) -> None:
        """One watch request from the last resourceVersion, until the server ends it (or stop/reselect)."""
        from kubernetes import watch

        with self._lock:
            selector, version = self._selector, self._resource_version
        if not selector or version is None:
            self._stop.wait(self.resync)  # nothing to watch until the pool selects pods
            with self._lock:
                self._selector = None
            return
        self._interrupted.clear()
        w = watch.Watch()
        self._watch = w
        try:
            for event in w.stream(self.core.list_namespaced_pod, self.namespace, label_selector=selector,
                                  resource_version=version, allow_watch_bookmarks=True,
                                  timeout_seconds=WATCH_TIMEOUT_S, _request_timeout=WATCH_REQUEST_TIMEOUT):
                with self._lock:
                    if self._selector != selector:  # the pool's selector changed meanwhile: re-list
                        break
                    version = apply_pod_event(self._pods, event) or version
                    self._resource_version = version
                    if event.get("type") != "BOOKMARK":
                        self._publish()
                if self._stop.is_set():
                    break
        finally:
            self._watch = None
            w.stop()

    def pod_watch_step(self) -> None:
        """List when there is no valid cache, else watch; a 410 Gone drops the cache (the next step lists)."""
        from kubernetes.client.exceptions import ApiException

        with self._lock:
            listed = self._selector is not None
        try:
            self.watch_pods() if listed else self.relist_pods()
        except ApiException as exc:
            if exc.status != GONE:
                raise
            log.info("pod watch of %s/%s: resourceVersion too old (410 Gone), listing again", self.namespace,
                     self.pool_name)
            with self._lock:
                self._selector = None

    def _pod_watch_loop(self) -> None:
        self._pool_known.wait()
        backoff = 0.5
        while not self._stop.is_set():
            try:
                self.pod_watch_step()
                backoff = 0.5
            except Exception as exc:  # noqa: BLE001 - a dropped connection, an API error: resume after a pause
                if self._stop.is_set() or self._interrupted.is_set():  # we broke the watch: a new selector
                    self._interrupted.clear()
                    continue
                log.warning("pod watch of %s/%s failed: %s", self.namespace, self.pool_name, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 10.0)
