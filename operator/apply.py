"""The operator's few verbs against the API server: get, list, server-side apply, create (if absent), status
merge-patch, delete.

A thin layer over the `kubernetes` client's ApiClient (auth, TLS and config come from it: in-cluster, or
$KUBECONFIG). Objects are plain dicts, exactly as the pure reconcile functions build them. Every call retries
transient failures (429, 5xx, connection errors) with exponential backoff and says what it did in one log
line; 404 on get is None, not an error.

Writes are server-side apply with field manager `kvgate-operator` and force=true: the operator owns the
fields it sets and nothing else, so a user's (or an HPA's) changes to other fields survive, and re-applying an
unchanged object is a no-op on the server (no new resourceVersion, no watch event).

Force would also take over an object that is not the operator's: a user's ConfigMap or Deployment that happens
to have the name the operator wants. So `apply` first reads the object and refuses (NameConflict) unless it is
absent or the operator's own for the same owner (naming.takeover_refusal: managed-by label and owner
reference); `delete` refuses objects without the managed-by label. Callers turn NameConflict into a status
condition. That guard is the operator's: another client of this layer that owns what it writes by its own field
manager (the conformance suite, which applies and deletes upstream's manifests) turns it off
(`guard_ownership=False`). (An object created in the milliseconds between the read and the apply is not caught:
Kubernetes has no "create only" form of apply.)
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from urllib.parse import quote

from kvgate.operator import naming

log = logging.getLogger("kvgate.operator.apply")

FIELD_MANAGER = "kvgate-operator"
RETRY_STATUSES = {429, 500, 502, 503, 504}


@dataclass(frozen=True)
class Kind:
    api_version: str
    kind: str
    plural: str
    namespaced: bool = True

    def path(self, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
        base = "/api/v1" if self.api_version == "v1" else f"/apis/{self.api_version}"
        if self.namespaced and namespace:
            base += f"/namespaces/{quote(namespace)}"
        base += f"/{self.plural}"
        if name:
            base += f"/{quote(name)}"
        if sub:
            base += f"/{sub}"
        return base


def _kinds() -> dict[tuple[str, str], Kind]:
    table = [
        Kind("v1", "Pod", "pods"), Kind("v1", "Service", "services"), Kind("v1", "ConfigMap", "configmaps"),
        Kind("v1", "ServiceAccount", "serviceaccounts"), Kind("v1", "Secret", "secrets"), Kind("v1", "Namespace", "namespaces", False),
        Kind("apps/v1", "Deployment", "deployments"),
        Kind("rbac.authorization.k8s.io/v1", "Role", "roles"),
        Kind("rbac.authorization.k8s.io/v1", "RoleBinding", "rolebindings"),
        Kind("networking.k8s.io/v1", "NetworkPolicy", "networkpolicies"),
        Kind("policy/v1", "PodDisruptionBudget", "poddisruptionbudgets"),
        Kind("policy/v1beta1", "PodDisruptionBudget", "poddisruptionbudgets"),  # Kubernetes < 1.21
        Kind("kvgate.dev/v1alpha1", "ModelServer", "modelservers"),
        Kind("inference.networking.k8s.io/v1", "InferencePool", "inferencepools"),
        Kind("gateway.networking.k8s.io/v1", "GatewayClass", "gatewayclasses", False),
        Kind("gateway.networking.k8s.io/v1", "Gateway", "gateways"),
        Kind("gateway.networking.k8s.io/v1", "HTTPRoute", "httproutes"),
        Kind("gateway.networking.k8s.io/v1beta1", "ReferenceGrant", "referencegrants"),
        Kind("keda.sh/v1alpha1", "ScaledObject", "scaledobjects"),  # autoscaling.provider keda (keda.py)
    ]
    return {(k.api_version, k.kind): k for k in table}


KINDS = _kinds()
# The kinds the reconcilers read and write, by name.
MODELSERVER = KINDS[("kvgate.dev/v1alpha1", "ModelServer")]
POOL = KINDS[("inference.networking.k8s.io/v1", "InferencePool")]
GATEWAYCLASS = KINDS[("gateway.networking.k8s.io/v1", "GatewayClass")]
GATEWAY = KINDS[("gateway.networking.k8s.io/v1", "Gateway")]
HTTPROUTE = KINDS[("gateway.networking.k8s.io/v1", "HTTPRoute")]
REFERENCEGRANT = KINDS[("gateway.networking.k8s.io/v1beta1", "ReferenceGrant")]
DEPLOYMENT = KINDS[("apps/v1", "Deployment")]
SERVICE = KINDS[("v1", "Service")]
CONFIGMAP = KINDS[("v1", "ConfigMap")]
POD = KINDS[("v1", "Pod")]
SECRET = KINDS[("v1", "Secret")]
NAMESPACE = KINDS[("v1", "Namespace")]
NETWORKPOLICY = KINDS[("networking.k8s.io/v1", "NetworkPolicy")]
PDB = KINDS[("policy/v1", "PodDisruptionBudget")]
PDB_V1BETA1 = KINDS[("policy/v1beta1", "PodDisruptionBudget")]
SCALEDOBJECT = KINDS[("keda.sh/v1alpha1", "ScaledObject")]


def kind_of(api_version: str, kind: str) -> Kind:
    try:
        return KINDS[(api_version, kind)]
    except KeyError:
        raise ValueError(f"the operator does not handle {kind} in {api_version}") from None


def kind_for(obj: dict) -> Kind:
    return kind_of(obj["apiVersion"], obj["kind"])


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, body: str = ""):
        self.status, self.method, self.path, self.body = status, method, path, body
        message = body
        try:
            message = json.loads(body).get("message", body)
        except (ValueError, AttributeError):
            pass
        super().__init__(f"{method} {path}: HTTP {status}: {str(message)[:500]}")


class NameConflict(Exception):
    """An object of the name the operator wants exists and is not the operator's: nothing was written."""

    reason = "NameConflict"

    def __init__(self, obj: dict, why: str):
        self.obj, self.why = obj, why
        super().__init__(f"{describe(obj)}: {why}; the operator leaves it alone (rename or delete it)")


def describe(obj: dict) -> str:
    meta = obj.get("metadata") or {}
    where = f"{meta['namespace']}/" if meta.get("namespace") else ""
    return f"{obj.get('kind', '?')} {where}{meta.get('name', '?')}"


def load_config():
    """An ApiClient from the in-cluster service account, else $KUBECONFIG / ~/.kube/config."""
    from kubernetes import client, config

    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


class Kube:
    """Dict-in, dict-out API calls with retries. Thread-safe as the ApiClient's connection pool is."""

    def __init__(self, api_client=None, *, attempts: int = 5, base_delay_s: float = 0.5, max_delay_s: float = 8.0,
                 timeout_s: float = 30.0, field_manager: str = FIELD_MANAGER, guard_ownership: bool = True):
        self.api = api_client if api_client is not None else load_config()
        self.field_manager = field_manager
        self.guard_ownership = guard_ownership  # refuse to take over or delete objects not the operator's
        self.attempts, self.base_delay_s, self.max_delay_s = attempts, base_delay_s, max_delay_s
        self.timeout_s = timeout_s

    # --- transport ------------------------------------------------------------------------------------------
    def _once(self, method: str, path: str, body, query: list, content_type: str | None):
        from kubernetes.client.exceptions import ApiException

        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type or "application/json"
        request = self.api.param_serialize(method, path, query_params=query, header_params=headers, body=body,
                                           auth_settings=["BearerToken"])
        try:
            resp = self.api.call_api(*request, _request_timeout=self.timeout_s)
            resp.read()
            status, data = resp.status, resp.data
        except ApiException as exc:
            status, data = exc.status or 0, exc.body or ""
        text = data.decode(errors="replace") if isinstance(data, bytes) else (data or "")
        if not 200 <= status < 300:
            raise ApiError(status, method, path, text)
        return json.loads(text) if text else None

    def request(self, method: str, path: str, body=None, *, query: dict | None = None,
                content_type: str | None = None):
        """One API call; transient failures retried with exponential backoff and jitter."""
        query_list = [(k, v) for k, v in (query or {}).items() if v is not None]
        for attempt in range(1, self.attempts + 1):
            try:
                return self._once(method, path, body, query_list, content_type)
            except ApiError as exc:
                if exc.status not in RETRY_STATUSES or attempt == self.attempts:
                    raise
                why = str(exc)
            except OSError as exc:  # connection refused/reset, timeouts (urllib3 errors are OSErrors)
                if attempt == self.attempts:
                    raise
                why = f"{method} {path}: {exc}"
            except Exception as exc:  # urllib3's MaxRetryError/ProtocolError are not all OSErrors
                if type(exc).__module__.split(".")[0] != "urllib3" or attempt == self.attempts:
                    raise
                why = f"{method} {path}: {exc}"
            delay = min(self.max_delay_s, self.base_delay_s * 2 ** (attempt - 1)) * (0.5 + random.random() / 2)
            log.warning("API call failed (attempt %d/%d), retrying in %.1fs: %s", attempt, self.attempts, delay, why)
            time.sleep(delay)
        raise AssertionError("unreachable")

    # --- verbs ----------------------------------------------------------------------------------------------
    def get(self, kind: Kind, name: str, namespace: str | None = None) -> dict | None:
        try:
            return self.request("GET", kind.path(namespace, name))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    def list(self, kind: Kind, namespace: str | None = None, label_selector: str | None = None) -> list[dict]:
        """Items of `kind` (in `namespace`, or everywhere); [] when the API server does not serve the kind
        (a CRD that is not installed)."""
        try:
            out = self.request("GET", kind.path(namespace), query={"labelSelector": label_selector})
        except ApiError as exc:
            if exc.status == 404:
                return []
            raise
        items = out.get("items") or []
        for item in items:  # list items carry no apiVersion/kind; owner references need them
            item.setdefault("apiVersion", kind.api_version)
            item.setdefault("kind", kind.kind)
        return items

    def apply(self, obj: dict) -> dict:
        """Server-side apply `obj` (our field manager, force): create or update, idempotently. NameConflict when
        an object of that name exists and is not the operator's for `obj`'s owner (nothing is written)."""
        kind = kind_for(obj)
        meta = obj["metadata"]
        before = self.get(kind, meta["name"], meta.get("namespace"))
        if before is not None and self.guard_ownership:
            before.setdefault("kind", kind.kind)
            if (why := naming.takeover_refusal(before, obj)) is not None:
                raise NameConflict(obj, why)
        out = self.request("PATCH", kind.path(meta.get("namespace"), meta["name"]), obj,
                           query={"fieldManager": self.field_manager, "force": "true"},
                           content_type="application/apply-patch+yaml")
        if before is None:
            log.info("created %s", describe(obj))
        elif ((before.get("metadata") or {}).get("resourceVersion")
              != (out.get("metadata") or {}).get("resourceVersion")):
            log.info("updated %s", describe(obj))
        return out

    def create(self, obj: dict) -> bool:
        """Create `obj` unless an object of its name exists (then nothing is written, nor read): True when
        created. For what must never be overwritten once made, such as a generated key (no read permission
        needed either)."""
        kind = kind_for(obj)
        meta = obj["metadata"]
        try:
            self.request("POST", kind.path(meta.get("namespace")), obj)
        except ApiError as exc:
            if exc.status == 409:
                return False
            raise
        log.info("created %s", describe(obj))
        return True

    def patch_status(self, obj: dict, status: dict) -> dict | None:
        """Merge-patch `obj`'s status subresource to `status` when it differs from the status read; the
        lists in it (conditions, parents) are replaced whole. None when the object is gone."""
        status = _no_empty_messages(status)
        if (obj.get("status") or {}) == status or _contains(obj.get("status") or {}, status):
            return obj
        kind = kind_for(obj)
        meta = obj["metadata"]
        try:
            out = self.request("PATCH", kind.path(meta.get("namespace"), meta["name"], "status"), {"status": status},
                               content_type="application/merge-patch+json")
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise
        log.info("status of %s: %s", describe(obj), summarize_status(status))
        return out

    def delete(self, obj: dict, *, propagation: str = "Background") -> None:
        """Delete `obj` (as read: its uid is a precondition); NameConflict for an object that is not the
        operator's (no managed-by label)."""
        if self.guard_ownership and not naming.is_managed(obj):
            raise NameConflict(obj, "it is not the operator's, so the operator does not delete it")
        kind = kind_for(obj)
        meta = obj["metadata"]
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": propagation}
        if meta.get("uid"):
            body["preconditions"] = {"uid": meta["uid"]}
        try:
            self.request("DELETE", kind.path(meta.get("namespace"), meta["name"]), body)
            log.info("deleted %s", describe(obj))
        except ApiError as exc:
            if exc.status not in (404, 409):  # gone already, or replaced by a new object of that name
                raise


def _no_empty_messages(node):
    """Conditions with an empty message get their reason as message: Kubernetes 1.20 rejects a merge patch
    whose condition message is "" as null against the Gateway API schema (message is required)."""
    if isinstance(node, dict):
        out = {k: _no_empty_messages(v) for k, v in node.items()}
        if "type" in out and "status" in out and out.get("message") == "":
            out["message"] = out.get("reason", "") or out["type"]
        return out
    if isinstance(node, list):
        return [_no_empty_messages(x) for x in node]
    return node


def _contains(current: dict, wanted: dict) -> bool:
    """Whether every key of `wanted` has the same value in `current` (a merge patch would change nothing)."""
    return all(current.get(k) == v for k, v in wanted.items())


def summarize_status(status: dict) -> str:
    """A short log form of a status: its conditions, or its parents' conditions."""
    def conds(cs):
        return ",".join(f"{c.get('type')}={c.get('status')}" for c in cs or [])
    parts = []
    if status.get("conditions"):
        parts.append(conds(status["conditions"]))
    for p in status.get("parents") or []:
        ref = p.get("parentRef") or {}
        parts.append(f"{ref.get('kind', 'Gateway')} {ref.get('name')}: {conds(p.get('conditions'))}")
    if "readyReplicas" in status:
        parts.append(f"ready {status['readyReplicas']}/{status.get('replicas', 0)}")
    return "; ".join(parts) or "{}"
