"""Kubernetes objects as the API server hands them to kvgate, with only the fields a test cares about (the EPP's
pool endpoints and watches, the operator's EPP backends)."""

from __future__ import annotations


def pod(name: str, ip: str, labels: dict | None = None, *, namespace: str = "ns", ready: bool = True,
        phase: str = "Running", deleting: bool = False, annotations: dict | None = None,
        rv: str | None = None, ports=()) -> dict:
    """A Pod at `ip` (labels default to app: llm); rv: its resourceVersion; ports: (name, containerPort) pairs of its
    one container."""
    meta: dict = {"name": name, "namespace": namespace, "labels": {"app": "llm"} if labels is None else labels}
    if annotations is not None:
        meta["annotations"] = annotations
    if rv is not None:
        meta["resourceVersion"] = rv
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    obj: dict = {"metadata": meta}
    if ports:
        obj["spec"] = {"containers": [{"name": "epp", "ports": [{"name": n, "containerPort": p} for n, p in ports]}]}
    obj["status"] = {"podIP": ip, "phase": phase,
                     "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return obj
