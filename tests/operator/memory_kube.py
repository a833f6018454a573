"""`Kube` with its HTTP transport replaced by an in-memory object store, for reconcile tests without a cluster.

Only `Kube.request` is replaced: get, list, apply (with its ownership check), patch_status and delete run as
in the operator. The store keeps the API server's few behaviours those verbs rely on: 404 for a missing object,
apply creates or merges (and bumps resourceVersion only on a change), status merge patches, uid and
resourceVersion on every object. (The real API server is exercised by tests/e2e/test_operator_e2e.py.)
"""

from __future__ import annotations

import copy
import itertools
import json

from kvgate.operator.apply import KINDS, ApiError, Kube

_PLURALS = {k.plural: k for k in KINDS.values()}


def _merge(base: dict, patch: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class MemoryKube(Kube):
    def __init__(self) -> None:
        super().__init__(api_client=object(), attempts=1)
        self.objects: dict[tuple[str, str, str], dict] = {}  # (plural, namespace, name) -> object
        self.calls: list[tuple[str, str]] = []
        self.events: list[dict] = []
        self._counter = itertools.count(1)

    def put(self, obj: dict) -> dict:
        """Create `obj` as a user would (no field manager): a uid and resourceVersion are added."""
        obj = copy.deepcopy(obj)
        kind = KINDS[(obj["apiVersion"], obj["kind"])]
        meta = obj["metadata"]
        meta.setdefault("uid", f"uid-{meta['name']}-{next(self._counter)}")
        meta["resourceVersion"] = str(next(self._counter))
        meta.setdefault("generation", 1)
        self.objects[(kind.plural, meta.get("namespace", "") if kind.namespaced else "", meta["name"])] = obj
        return obj

    def stored(self, kind: str, name: str, namespace: str = "default") -> dict | None:
        plural = next(k.plural for k in KINDS.values() if k.kind == kind)
        return self.objects.get((plural, namespace if KINDS_BY_PLURAL_NAMESPACED[plural] else "", name))

    def request(self, method, path, body=None, *, query=None, content_type=None):
        self.calls.append((method, path))
        parts = path.strip("/").split("/")
        parts = parts[2:] if parts[0] == "api" else parts[3:]  # drop api/v1 or apis/group/version
        namespace = ""
        if parts[0] == "namespaces" and len(parts) > 2:
            namespace, parts = parts[1], parts[2:]
        plural, name, sub = parts[0], (parts[1] if len(parts) > 1 else None), (parts[2] if len(parts) > 2 else None)
        key = (plural, namespace, name)
        if method == "GET" and name is None:
            items = [copy.deepcopy(o) for (p, ns, _), o in sorted(self.objects.items())
                     if p == plural and (not namespace or ns == namespace)]
            return {"items": items}
        current = self.objects.get(key)
        if method == "GET":
            if current is None:
                raise ApiError(404, method, path, json.dumps({"message": "not found"}))
            return copy.deepcopy(current)
        if method == "PATCH" and sub == "status":
            if current is None:
                raise ApiError(404, method, path, "")
            current["status"] = _merge(current.get("status") or {}, body["status"])
            for k, v in body["status"].items():  # merge patch: lists are replaced whole
                current["status"][k] = copy.deepcopy(v)
            return copy.deepcopy(current)
        if method == "PATCH" and content_type == "application/merge-patch+json":  # metadata, as the xDS side does
            if current is None:
                raise ApiError(404, method, path, "")
            annotations = current["metadata"].setdefault("annotations", {})
            for k, v in ((body.get("metadata") or {}).get("annotations") or {}).items():
                if v is None:
                    annotations.pop(k, None)
                else:
                    annotations[k] = v
            current["metadata"]["resourceVersion"] = str(next(self._counter))
            return copy.deepcopy(current)
        if method == "PATCH":
            assert content_type == "application/apply-patch+yaml" and query == {"fieldManager": "kvgate-operator",
                                                                                "force": "true"}
            if current is None:
                return copy.deepcopy(self.put(body))
            merged = _merge(current, body)
            if merged != current:
                merged["metadata"]["resourceVersion"] = str(next(self._counter))
                self.objects[key] = merged
            return copy.deepcopy(self.objects[key])
        if method == "POST" and plural == "events":  # Events are only recorded (the autoscaler's)
            self.events.append(copy.deepcopy(body))
            return copy.deepcopy(body)
        if method == "POST":
            key = (plural, namespace, body["metadata"]["name"])
            if key in self.objects:
                raise ApiError(409, method, path, json.dumps({"reason": "AlreadyExists"}))
            return copy.deepcopy(self.put(body))
        if method == "DELETE":
            if current is None:
                raise ApiError(404, method, path, "")
            del self.objects[key]
            return {}
        raise AssertionError(f"unexpected {method} {path}")


KINDS_BY_PLURAL_NAMESPACED = {p: k.namespaced for p, k in _PLURALS.items()}
