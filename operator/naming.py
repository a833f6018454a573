"""Deterministic names, labels and owner references of the objects the operator makes.

Every object the operator creates carries `app.kubernetes.io/managed-by: kvgate-operator` and an owner
reference to the resource it was made for, so that deleting that resource garbage-collects it and so that
the operator can tell its own objects from a user's (is_managed, is_owned_by, takeover_refusal).
"""

from __future__ import annotations

MANAGED_BY_KEY = "app.kubernetes.io/managed-by"
MANAGED_BY = "kvgate-operator"
PART_OF = "kvgate"
CONTROLLER_NAME = "kvgate.dev/gateway-controller"

INFERENCE_GROUP = "inference.networking.k8s.io"
INFERENCE_X_GROUP = "inference.networking.x-k8s.io"
GATEWAY_GROUP = "gateway.networking.k8s.io"

# On engine pods: the InferencePool they serve (Prometheus relabels it to `pool`, as the EPP's instance label is for
# the EPP's own pods, so the dashboard's per-pool panels read the engines of a pool of mixed ModelServers).
POOL_LABEL = "kvgate.dev/pool"

EPP_GRPC_PORT = 9002
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090


def namespace_of(obj: dict, default: str = "default") -> str:
    return (obj.get("metadata") or {}).get("namespace") or default


def name_of(obj: dict) -> str:
    return (obj.get("metadata") or {}).get("name", "")


def key_of(obj: dict) -> tuple[str, str]:
    """(namespace, name): how the operator indexes objects of one kind."""
    return namespace_of(obj), name_of(obj)


def _dns_label(text: str, limit: int = 63) -> str:
    # Names derived from user names may exceed a DNS label; cut them but keep them unique by a short digest.
    if len(text) <= limit:
        return text
    import hashlib

    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{text[:limit - 9].rstrip('-.')}-{digest}"


def engine_deployment_name(modelserver: dict) -> str:
    return _dns_label(name_of(modelserver))


def epp_name(pool: dict) -> str:
    """Name of the EPP's Deployment, ServiceAccount, Role, RoleBinding and ConfigMap."""
    return _dns_label(f"{name_of(pool)}-epp")


def envoy_name(gateway: dict) -> str:
    """Name of a Gateway's Envoy Deployment, Service and ConfigMap."""
    return _dns_label(f"{name_of(gateway)}-envoy")


def component_labels(component: str, instance: str) -> dict[str, str]:
    """Labels of every object the operator makes; `instance` is the owning resource's name."""
    return {
        "app.kubernetes.io/name": f"kvgate-{component}",
        "app.kubernetes.io/instance": _dns_label(instance),
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/part-of": PART_OF,
        MANAGED_BY_KEY: MANAGED_BY,
    }


def pool_label(pool: dict) -> dict[str, str]:
    """The engine pods' `kvgate.dev/pool` label: the pool's name (cut to a label value as instance names are)."""
    return {POOL_LABEL: _dns_label(name_of(pool))}


def selector_labels(component: str, instance: str) -> dict[str, str]:
    """The subset of `component_labels` that selects pods: stable across operator versions."""
    labels = component_labels(component, instance)
    return {k: labels[k] for k in ("app.kubernetes.io/name", "app.kubernetes.io/instance")}


def owner_reference(owner: dict) -> dict:
    """A controller owner reference to `owner` (needs its metadata.uid once it exists in the cluster)."""
    return {
        "apiVersion": owner.get("apiVersion", ""),
        "kind": owner.get("kind", ""),
        "name": name_of(owner),
        "uid": (owner.get("metadata") or {}).get("uid", ""),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def object_meta(name: str, owner: dict, labels: dict[str, str], annotations: dict[str, str] | None = None) -> dict:
    meta = {"name": name, "namespace": namespace_of(owner), "labels": dict(sorted(labels.items())),
            "ownerReferences": [owner_reference(owner)]}
    if annotations:
        meta["annotations"] = dict(sorted(annotations.items()))
    return meta


def is_managed(obj: dict | None) -> bool:
    return bool(obj) and ((obj.get("metadata") or {}).get("labels") or {}).get(MANAGED_BY_KEY) == MANAGED_BY


def is_deleting(obj: dict | None) -> bool:
    """Whether `obj` is being deleted (a deletionTimestamp): the reconcilers treat it as gone."""
    return bool(obj) and bool((obj.get("metadata") or {}).get("deletionTimestamp"))


def is_owned_by(obj: dict | None, owner: dict) -> bool:
    """Whether `obj` has an owner reference to `owner` (by uid when both sides know it, else by kind+name)."""
    if not obj:
        return False
    uid = (owner.get("metadata") or {}).get("uid")
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") != owner.get("kind") or ref.get("name") != name_of(owner):
            continue
        if not uid or not ref.get("uid") or ref.get("uid") == uid:
            return True
    return False


def takeover_refusal(existing: dict | None, desired: dict) -> str | None:
    """Why the operator must not write `desired` over `existing` (an object of that kind and name that is
    already there); None when `existing` is absent or the operator's own for the same owner: it carries the
    managed-by label and an owner reference to `desired`'s owner. Server-side apply with force would otherwise
    silently take over a user's object of the same name (or another resource's: the EPP Deployment `x-epp`
    of pool `x` and the engine Deployment of a ModelServer named `x-epp`)."""
    if not existing:
        return None
    what = f"{existing.get('kind') or desired.get('kind', '?')} {name_of(desired)!r}"
    if not is_managed(existing):
        return f"{what} exists and is not the operator's (no label {MANAGED_BY_KEY}={MANAGED_BY})"
    for ref in (desired.get("metadata") or {}).get("ownerReferences") or []:
        owner = {"kind": ref.get("kind"), "metadata": {"name": ref.get("name"), "uid": ref.get("uid")}}
        if not is_owned_by(existing, owner):
            theirs = ", ".join(f"{r.get('kind')} {r.get('name')!r}"
                               for r in (existing.get("metadata") or {}).get("ownerReferences") or []) or "none"
            return (f"{what} exists and belongs to another resource (owner {theirs}, not "
                    f"{ref.get('kind')} {ref.get('name')!r})")
    return None


def selector_string(match_labels: dict[str, str]) -> str:
    """`a=1,b=2`: the label-selector form of the scale subresource's status.selector."""
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))
