"""The pool as the EPP knows it: endpoints, InferenceObjectives (priorities) and InferenceModelRewrites.

Standalone mode fills it from `--endpoints` (or a file, reloaded when it changes); Kubernetes mode from a
watch of the InferencePool and its pods (k8s_watch.py). The translation from API objects is pure.
"""

from __future__ import annotations

import ipaddress
import random
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvgate.epp.types import Endpoint

ENGINE_TYPE_LABEL = "inference.networking.k8s.io/engine-type"


def parse_endpoints(text: str) -> list[Endpoint]:
    """`ip:port,ip:port` (or one per line) -> endpoints; raises ValueError on a bad entry."""
    endpoints = []
    for item in text.replace("\n", ",").split(","):
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"endpoint {item!r} is not ip:port")
        try:
            ipaddress.ip_address(host.strip("[]"))
        except ValueError as exc:
            raise ValueError(f"endpoint {item!r}: {host!r} is not an IP address") from exc
        endpoints.append(Endpoint(address=item, name=item))
    return endpoints


def _pod_ready(pod: Mapping) -> bool:
    for cond in (pod.get("status") or {}).get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def pool_endpoints(pool: Mapping, pods: Iterable[Mapping]) -> list[Endpoint]:
    """InferencePool + pods -> endpoints: each ready, running, selected pod with an IP x each target port."""
    spec = pool.get("spec") or {}
    selector = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = [p.get("number") for p in spec.get("targetPorts") or [] if isinstance(p, Mapping)]
    namespace = (pool.get("metadata") or {}).get("namespace", "")
    if not selector or not ports:
        return []
    out = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        labels = meta.get("labels") or {}
        if meta.get("namespace", namespace) != namespace or meta.get("deletionTimestamp"):
            continue
        if any(labels.get(k) != v for k, v in selector.items()):
            continue
        ip = status.get("podIP")
        if not ip or status.get("phase") != "Running" or not _pod_ready(pod):
            continue
        host = f"[{ip}]" if ":" in ip else ip
        for port in ports:
            out.append(Endpoint(address=f"{host}:{port}", name=meta.get("name", ""), namespace=namespace,
                                labels=dict(labels), engine_type=labels.get(ENGINE_TYPE_LABEL, "vllm")))
    return sorted(out, key=lambda e: e.address)


@dataclass
class RewriteRule:
    model: str
    targets: list[tuple[str, int]]  # (target model, weight)


def parse_objectives(objects: Iterable[Mapping], pool_name: str | None = None) -> dict[str, int]:
    """InferenceObjective objects (for this pool) -> {name: priority}."""
    out = {}
    for obj in objects:
        if obj.get("kind") not in (None, "InferenceObjective"):
            continue
        spec = obj.get("spec") or {}
        ref = (spec.get("poolRef") or {}).get("name")
        if pool_name and ref and ref != pool_name:
            continue
        name = (obj.get("metadata") or {}).get("name")
        if name:
            out[name] = int(spec.get("priority") or 0)
    return out


def parse_rewrites(objects: Iterable[Mapping], pool_name: str | None = None) -> list[RewriteRule]:
    """InferenceModelRewrite objects -> rules (client model -> weighted target models)."""
    rules = []
    for obj in objects:
        if obj.get("kind") not in (None, "InferenceModelRewrite"):
            continue
        spec = obj.get("spec") or {}
        ref = (spec.get("poolRef") or {}).get("name")
        if pool_name and ref and ref != pool_name:
            continue
        for rule in spec.get("rules") or []:
            targets = [(t.get("modelRewrite") or t.get("model"), int(t.get("weight", 1)))
                       for t in rule.get("targets") or []]
            targets = [(m, w) for m, w in targets if m and w > 0]
            for match in rule.get("matches") or []:
                model = (match.get("model") or {}).get("value") if isinstance(match.get("model"), Mapping) \
                    else match.get("model")
                if model and targets:
                    rules.append(RewriteRule(model, targets))
    return rules


@dataclass
class Datastore:
    endpoints: list[Endpoint] = field(default_factory=list)
    objectives: dict[str, int] = field(default_factory=dict)
    rewrites: list[RewriteRule] = field(default_factory=list)
    synced: bool = False  # endpoints have been loaded at least once (readiness)
    listeners: list[Callable[[list[Endpoint]], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def set_endpoints(self, endpoints: list[Endpoint]) -> None:
        with self._lock:
            changed = endpoints != self.endpoints or not self.synced
            self.endpoints = list(endpoints)
            self.synced = True
        if changed:
            for listener in self.listeners:
                listener(list(endpoints))

    def set_policies(self, objectives: dict[str, int], rewrites: list[RewriteRule]) -> None:
        with self._lock:
            self.objectives, self.rewrites = dict(objectives), list(rewrites)

    def priority(self, objective: str | None) -> int:
        return self.objectives.get(objective, 0) if objective else 0

    def rewrite(self, model: str, rng: random.Random) -> str:
        for rule in self.rewrites:
            if rule.model == model:
                models, weights = zip(*rule.targets)
                return rng.choices(models, weights=weights)[0]
        return model


def load_manifests(path: str | Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(Path(path).read_text()) if isinstance(d, dict)]


class EndpointsFile:
    """Standalone mode's hot reload: re-read the endpoints file when its mtime changes."""

    def __init__(self, path: str | Path, datastore: Datastore) -> None:
        self.path = Path(path)
        self.datastore = datastore
        self._mtime = -1.0

    def poll(self) -> None:
        try:
            mtime = self.path.stat().st_mtime
        except FileNotFoundError:
            return
        if mtime != self._mtime:
            self._mtime = mtime
            self.datastore.set_endpoints(parse_endpoints(self.path.read_text()))
