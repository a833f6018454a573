"""Make current upstream manifests acceptable to the rig's Kubernetes 1.20 — in the rig, never in the product.

1.20 rejects CRD schemas that use CEL rules (`x-kubernetes-validations`) or a string `default: ""`, and it has
no gRPC probes (1.24+). The installer applies a copy with those keys dropped, and pod templates get a
tcpSocket probe on the gRPC probe's port instead. Everything else is passed through unchanged.
"""
from __future__ import annotations

import copy
from typing import Any

from kvgate.conformance.cluster import grpc_probe_to_tcp  # the suite does the same on old servers

DROPPED_SCHEMA_KEYS = ("x-kubernetes-validations",)
POD_TEMPLATE_KINDS = {"Deployment", "ReplicaSet", "StatefulSet", "DaemonSet", "Job"}


def _strip_schema(node: Any) -> Any:
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            if k in DROPPED_SCHEMA_KEYS:
                continue
            if k == "default" and v == "":
                continue
            # A property *named* "default" is a schema, not a default value: recurse normally.
            out[k] = _strip_schema(v)
        return out
    if isinstance(node, list):
        return [_strip_schema(x) for x in node]
    return node


def crd_for_1_20(crd: dict) -> dict:
    """A copy of a CustomResourceDefinition without CEL rules and empty-string defaults in its schemas."""
    if crd.get("kind") != "CustomResourceDefinition":
        return crd
    out = copy.deepcopy(crd)
    for version in out.get("spec", {}).get("versions") or []:
        schema = version.get("schema", {}).get("openAPIV3Schema")
        if schema is not None:
            version["schema"]["openAPIV3Schema"] = _strip_schema(schema)
    return out


def pod_spec_for_1_20(spec: dict) -> dict:
    out = copy.deepcopy(spec)
    for key in ("containers", "initContainers"):
        for c in out.get(key) or []:
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in c:
                    c[probe] = grpc_probe_to_tcp(c[probe])
    return out


def manifest_for_1_20(doc: dict) -> dict:
    """One manifest document made 1.20-compatible (CRD schemas, gRPC probes in pods and pod templates)."""
    kind = doc.get("kind")
    if kind == "CustomResourceDefinition":
        return crd_for_1_20(doc)
    if kind == "Pod":
        out = copy.deepcopy(doc)
        out["spec"] = pod_spec_for_1_20(doc.get("spec") or {})
        return out
    if kind in POD_TEMPLATE_KINDS and "template" in (doc.get("spec") or {}):
        out = copy.deepcopy(doc)
        tpl = out["spec"]["template"]
        tpl["spec"] = pod_spec_for_1_20(tpl.get("spec") or {})
        return out
    return doc


def install(client, files, timeout_s: float = 60.0) -> list[str]:
    """Apply the 1.20 copies of every CRD in `files` and wait until all are Established; returns their names."""
    from pathlib import Path

    from .kube import CRD, load_documents, wait_for

    names = [client.apply(crd_for_1_20(doc))["metadata"]["name"]
             for f in files for doc in load_documents(Path(f).read_text())]

    def established() -> bool:
        return all({c["type"]: c["status"] for c in client.get(CRD, n).get("status", {}).get("conditions") or []}
                   .get("Established") == "True" for n in names)
    wait_for(established, timeout_s=timeout_s, what="CRDs Established")
    return names
