"""A small Kubernetes REST client for the rig: JSON over HTTPS with a bearer token, from a kubeconfig.

The rig needs a handful of verbs (get, list, watch, create, replace, patch, delete, and a create-or-replace
"apply" for multi-document manifests with a discovery-based kind → resource mapping). Writing them over
http.client keeps the rig free of client-library version constraints and puts every timeout in plain sight.
Each request opens its own connection, so one Client is safe to share between threads.
"""
from __future__ import annotations

import base64
import contextlib
import http.client
import json
import os
import ssl
import tempfile
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any, Iterator

import yaml

DEFAULT_TIMEOUT_S = 15.0


class ApiError(Exception):
    """A non-2xx answer from the API server: .status is the HTTP code, .body the decoded Status (if JSON)."""

    def __init__(self, method: str, path: str, status: int, body: Any):
        self.status, self.body = status, body
        message = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{method} {path} -> {status}: {message}")


@contextlib.contextmanager
def _as_connection_error():
    """A connection cut mid-answer (the API server killed during a watch or a read) raises http.client's
    IncompleteRead or BadStatusLine, which are not OSErrors: re-raise them as ConnectionError, so every caller
    that retries on a dropped connection (`except OSError`) retries on these too instead of dying."""
    try:
        yield
    except http.client.HTTPException as exc:
        if isinstance(exc, OSError):
            raise
        raise ConnectionError(f"connection to the API server cut: {exc!r}") from exc


@dataclass
class Kubeconfig:
    server: str                 # https://127.0.0.1:PORT
    ca_pem: bytes | None        # None: verify with the system store
    token: str | None = None
    client_cert_pem: bytes | None = None
    client_key_pem: bytes | None = None
    insecure: bool = False

    @classmethod
    def load(cls, path: str | os.PathLike, context: str | None = None) -> "Kubeconfig":
        with open(path) as f:
            doc = yaml.safe_load(f)
        ctx_name = context or doc.get("current-context")
        ctx = next(c["context"] for c in doc["contexts"] if c["name"] == ctx_name)
        cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == ctx["cluster"])
        user = next((u["user"] for u in doc.get("users", []) if u["name"] == ctx.get("user")), {}) or {}

        def data(obj: dict, key: str) -> bytes | None:
            if obj.get(f"{key}-data"):
                return base64.b64decode(obj[f"{key}-data"])
            if obj.get(key):
                with open(obj[key], "rb") as fh:
                    return fh.read()
            return None

        token = user.get("token")
        if not token and user.get("tokenFile"):
            with open(user["tokenFile"]) as fh:
                token = fh.read().strip()
        return cls(server=cluster["server"], ca_pem=data(cluster, "certificate-authority"), token=token,
                   client_cert_pem=data(user, "client-certificate"), client_key_pem=data(user, "client-key"),
                   insecure=bool(cluster.get("insecure-skip-tls-verify")))

    def to_yaml(self, name: str = "k8srig") -> str:
        cluster: dict[str, Any] = {"server": self.server}
        if self.ca_pem:
            cluster["certificate-authority-data"] = base64.b64encode(self.ca_pem).decode()
        user: dict[str, Any] = {}
        if self.token:
            user["token"] = self.token
        if self.client_cert_pem and self.client_key_pem:
            user["client-certificate-data"] = base64.b64encode(self.client_cert_pem).decode()
            user["client-key-data"] = base64.b64encode(self.client_key_pem).decode()
        return yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": name,
            "clusters": [{"name": name, "cluster": cluster}],
            "users": [{"name": name, "user": user}],
            "contexts": [{"name": name, "context": {"cluster": name, "user": name}}],
        }, sort_keys=False)


@dataclass(frozen=True)
class Resource:
    """Where a kind lives: /api/v1 or /apis/GROUP/VERSION, its plural name, and whether it is namespaced."""
    api_version: str
    kind: str
    plural: str
    namespaced: bool

    def path(self, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        parts = [base]
        if self.namespaced and namespace:
            parts += ["namespaces", namespace]
        parts.append(self.plural)
        if name:
            parts.append(name)
        if sub:
            parts.append(sub)
        return "/".join(parts)


# Core kinds the rig itself uses, so that it never needs discovery for them.
CORE = {k: Resource("v1", k, p, ns) for k, p, ns in [
    ("Pod", "pods", True), ("Node", "nodes", False), ("Namespace", "namespaces", False),
    ("ConfigMap", "configmaps", True), ("Secret", "secrets", True), ("Service", "services", True),
    ("ServiceAccount", "serviceaccounts", True), ("Event", "events", True), ("Endpoints", "endpoints", True),
]}
LEASE = Resource("coordination.k8s.io/v1", "Lease", "leases", True)
DEPLOYMENT = Resource("apps/v1", "Deployment", "deployments", True)
REPLICASET = Resource("apps/v1", "ReplicaSet", "replicasets", True)
CRD = Resource("apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions", False)
ENDPOINTSLICE = Resource("discovery.k8s.io/v1beta1", "EndpointSlice", "endpointslices", True)


@dataclass
class Client:
    config: Kubeconfig
    timeout_s: float = DEFAULT_TIMEOUT_S
    _discovery: dict[tuple[str, str], Resource] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _ssl: ssl.SSLContext | None = field(default=None, repr=False)

    @classmethod
    def from_kubeconfig(cls, path: str | os.PathLike, **kw) -> "Client":
        return cls(Kubeconfig.load(path), **kw)

    # --- transport ---------------------------------------------------------------------------------------
    def _ssl_context(self) -> ssl.SSLContext:
        with self._lock:                  # built once; an SSLContext is safe to share between threads
            if self._ssl is None:
                self._ssl = self._new_ssl_context()
            return self._ssl

    def _new_ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        if self.config.insecure:
            ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        elif self.config.ca_pem:
            ctx.load_verify_locations(cadata=self.config.ca_pem.decode())
        if self.config.client_cert_pem and self.config.client_key_pem:
            with tempfile.TemporaryDirectory() as d:   # ssl wants files; they live only for the load
                cert, key = os.path.join(d, "c"), os.path.join(d, "k")
                with open(cert, "wb") as f:
                    f.write(self.config.client_cert_pem)
                with open(key, "wb") as f:
                    f.write(self.config.client_key_pem)
                ctx.load_cert_chain(cert, key)
        return ctx

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        url = urllib.parse.urlsplit(self.config.server)
        if url.scheme == "https":
            return http.client.HTTPSConnection(url.hostname, url.port or 443, timeout=timeout,
                                               context=self._ssl_context())
        return http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout)

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        h = {"Accept": "application/json", "User-Agent": "k8srig"}
        if self.config.token:
            h["Authorization"] = f"Bearer {self.config.token}"
        if content_type:
            h["Content-Type"] = content_type
        return h

    def request(self, method: str, path: str, body: Any = None, *, query: dict | None = None,
                content_type: str = "application/json", timeout: float | None = None) -> Any:
        if query:
            path = f"{path}?{urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})}"
        conn = self._connect(timeout or self.timeout_s)
        try:
            data = None if body is None else json.dumps(body).encode()
            with _as_connection_error():
                conn.request(method, path, body=data, headers=self._headers(content_type if data else None))
                resp = conn.getresponse()
                raw = resp.read()
        finally:
            conn.close()
        try:
            decoded = json.loads(raw) if raw else None
        except ValueError:
            decoded = raw.decode(errors="replace")
        if resp.status >= 300:
            raise ApiError(method, path, resp.status, decoded)
        return decoded

    def raw_get(self, path: str, timeout: float | None = None) -> tuple[int, str]:
        """GET a non-JSON endpoint such as /readyz: (status, body); connection errors propagate."""
        conn = self._connect(timeout or self.timeout_s)
        try:
            with _as_connection_error():
                conn.request("GET", path, headers=self._headers())
                resp = conn.getresponse()
                return resp.status, resp.read().decode(errors="replace")
        finally:
            conn.close()

    # --- verbs -------------------------------------------------------------------------------------------
    def get(self, res: Resource, name: str, namespace: str | None = None) -> dict:
        return self.request("GET", res.path(namespace, name))

    def get_or_none(self, res: Resource, name: str, namespace: str | None = None) -> dict | None:
        try:
            return self.get(res, name, namespace)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def list(self, res: Resource, namespace: str | None = None, **query) -> dict:
        return self.request("GET", res.path(namespace), query=query or None)

    def create(self, res: Resource, obj: dict, namespace: str | None = None) -> dict:
        return self.request("POST", res.path(namespace or obj.get("metadata", {}).get("namespace")), obj)

    def replace(self, res: Resource, obj: dict, namespace: str | None = None) -> dict:
        md = obj["metadata"]
        return self.request("PUT", res.path(namespace or md.get("namespace"), md["name"]), obj)

    def patch(self, res: Resource, name: str, patch: dict, namespace: str | None = None,
              sub: str | None = None, kind: str = "merge") -> dict:
        ctype = {"merge": "application/merge-patch+json", "strategic": "application/strategic-merge-patch+json",
                 "json": "application/json-patch+json"}[kind]
        return self.request("PATCH", res.path(namespace, name, sub), patch, content_type=ctype)

    def delete(self, res: Resource, name: str, namespace: str | None = None, *,
               grace_period_s: int | None = None, uid: str | None = None,
               propagation: str | None = None) -> dict | None:
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if grace_period_s is not None:
            body["gracePeriodSeconds"] = grace_period_s
        if uid:
            body["preconditions"] = {"uid": uid}
        if propagation:
            body["propagationPolicy"] = propagation
        try:
            return self.request("DELETE", res.path(namespace, name), body)
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    def watch(self, res: Resource, namespace: str | None = None, *, resource_version: str | None = None,
              timeout_s: int = 30, **query) -> Iterator[dict]:
        """Yield watch events ({type, object}) until the server ends the watch (at most timeout_s)."""
        q = {"watch": "1", "timeoutSeconds": str(timeout_s), "allowWatchBookmarks": "true",
             "resourceVersion": resource_version, **query}
        path = f"{res.path(namespace)}?{urllib.parse.urlencode({k: v for k, v in q.items() if v is not None})}"
        conn = self._connect(timeout_s + 10)      # socket timeout bounds a silent server
        try:
            with _as_connection_error():
                conn.request("GET", path, headers=self._headers())
                resp = conn.getresponse()
                if resp.status >= 300:
                    raise ApiError("WATCH", path, resp.status, resp.read().decode(errors="replace"))
            while True:
                with _as_connection_error():
                    line = resp.readline()
                if not line:
                    return
                yield json.loads(line)
        finally:
            conn.close()

    # --- discovery and apply ----------------------------------------------------------------------------
    def resource_for(self, api_version: str, kind: str, *, wait_s: float = 0.0) -> Resource:
        """Map apiVersion+kind to its Resource through discovery (waiting up to wait_s for new CRDs)."""
        key = (api_version, kind)
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                if key in self._discovery:
                    return self._discovery[key]
            path = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
            try:
                doc = self.request("GET", path)
                found = {}
                for r in doc.get("resources", []):
                    if "/" not in r["name"]:
                        found[(api_version, r["kind"])] = Resource(api_version, r["kind"], r["name"],
                                                                   r["namespaced"])
                with self._lock:
                    self._discovery.update(found)
                    if key in self._discovery:
                        return self._discovery[key]
            except ApiError as e:
                if e.status != 404:
                    raise
            if time.monotonic() >= deadline:
                raise LookupError(f"the API server does not serve {kind} in {api_version}")
            time.sleep(0.5)

    def apply(self, obj: dict, *, wait_s: float = 30.0) -> dict:
        """Create the object, or replace it (keeping its resourceVersion) if it already exists."""
        res = self.resource_for(obj["apiVersion"], obj["kind"], wait_s=wait_s)
        ns = obj["metadata"].get("namespace", "default") if res.namespaced else None
        try:
            return self.create(res, obj, ns)
        except ApiError as e:
            if e.status != 409:
                raise
        current = self.get(res, obj["metadata"]["name"], ns)
        obj = json.loads(json.dumps(obj))
        obj["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
        return self.replace(res, obj, ns)

    def apply_documents(self, docs: list[dict], *, wait_s: float = 30.0) -> list[dict]:
        """Apply documents in order (CRDs first is the caller's job) and return what the server stored."""
        return [self.apply(d, wait_s=wait_s) for d in docs if d]


def load_documents(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def wait_for(predicate, *, timeout_s: float, interval_s: float = 0.25, what: str = "condition"):
    """Poll predicate() until it returns something truthy; return it, or raise TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    last_exc: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
            last_exc = None
        except (ApiError, OSError) as e:
            last_exc = e
        if time.monotonic() >= deadline:
            suffix = f" (last error: {last_exc})" if last_exc else ""
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}{suffix}")
        time.sleep(interval_s)


WORKLOADS = [Resource(v, k, p, True) for v, k, p in [
    ("apps/v1", "Deployment", "deployments"), ("apps/v1", "StatefulSet", "statefulsets"),
    ("apps/v1", "DaemonSet", "daemonsets"), ("apps/v1", "ReplicaSet", "replicasets"), ("batch/v1", "Job", "jobs")]]


def delete_namespace(client: Client, name: str, timeout_s: float = 120.0, *, wait_gone: bool = True) -> None:
    """Delete a namespace: its workload controllers and pods first (waiting until the pods, and so their
    processes, are gone), then the namespace itself — waiting for it only with wait_gone, since 1.20's
    namespace controller takes ~5 s even for an empty namespace."""
    try:
        for res in WORKLOADS + [CORE["Pod"]]:
            client.request("DELETE", res.path(name), {"apiVersion": "v1", "kind": "DeleteOptions",
                                                      "propagationPolicy": "Background"})
        wait_for(lambda: not client.list(CORE["Pod"], name)["items"], timeout_s=30, interval_s=0.2,
                 what=f"the pods of namespace {name} to be deleted")
    except ApiError as e:
        if e.status != 404:
            raise
    except TimeoutError:
        pass                          # the namespace controller finishes the job below
    client.delete(CORE["Namespace"], name)
    if wait_gone:
        wait_for(lambda: client.get_or_none(CORE["Namespace"], name) is None, timeout_s=timeout_s,
                 interval_s=0.5, what=f"namespace {name} to be deleted")


def wait_default_service_account(client: Client, namespace: str, *, token: bool = True,
                                 timeout_s: float = 60.0) -> None:
    """Pods are admitted only once the namespace's default ServiceAccount exists (and, on 1.20, its token)."""
    def ready():
        sa = client.get_or_none(CORE["ServiceAccount"], "default", namespace)
        return sa is not None and (bool(sa.get("secrets")) or not token)
    wait_for(ready, timeout_s=timeout_s, what=f"default ServiceAccount in {namespace}")
