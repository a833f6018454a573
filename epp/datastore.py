"""The pool as the EPP knows it: endpoints, InferenceObjectives (priorities) and InferenceModelRewrites.

Standalone mode fills it from `--endpoints` (or a file, reloaded when it changes); Kubernetes mode from a
watch of the InferencePool and its pods (k8s_watch.py). The translation from API objects is pure.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import random
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kvgate.common import bounded_file, bounded_yaml
from kvgate.common.epp_protocol import ENGINE_TYPE_LABEL
from kvgate.epp.types import Endpoint

log = logging.getLogger(__name__)


def parse_endpoint(item: str) -> Endpoint:
    """One `ip:port` (`[v6]:port`) -> an endpoint; raises ValueError naming what is wrong."""
    host, sep, port = item.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"endpoint {item!r} is not ip:port")
    try:
        ipaddress.ip_address(host.strip("[]"))
    except ValueError as exc:
        raise ValueError(f"endpoint {item!r}: {host!r} is not an IP address") from exc
    return Endpoint(address=item, name=item)


def _kv_events_annotations(meta: Mapping) -> dict[str, str]:
    from kvgate.common.epp_protocol import KV_EVENTS_ANNOTATIONS

    annotations = meta.get("annotations") or {}
    return {k: str(annotations[k]) for k in KV_EVENTS_ANNOTATIONS if k in annotations}


def parse_endpoints(text: str) -> list[Endpoint]:
    """`ip:port,ip:port` (or one per line) -> endpoints; raises ValueError on a bad entry (`--endpoints`)."""
    endpoints = []
    for item in text.replace("\n", ",").split(","):
        item = item.strip()
        if not item or item.startswith("#"):
            continue
        endpoints.append(parse_endpoint(item))
    return endpoints


def parse_endpoints_lines(text: str) -> tuple[list[Endpoint], list[tuple[int, str]]]:
    """An endpoints file -> (endpoints, [(line number, problem)]): one or more `ip:port` per line (comma
    separated), `#` starts a comment (also after an entry); a bad or repeated entry is a problem, not an error."""
    endpoints: list[Endpoint] = []
    seen: set[str] = set()
    problems: list[tuple[int, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        for item in line.split("#", 1)[0].split(","):
            item = item.strip()
            if not item:
                continue
            try:
                endpoint = parse_endpoint(item)
            except ValueError as exc:
                problems.append((number, str(exc)))
                continue
            if endpoint.address in seen:
                problems.append((number, f"endpoint {item!r} is listed twice"))
                continue
            seen.add(endpoint.address)
            endpoints.append(endpoint)
    return endpoints, problems


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
                                labels=dict(labels), engine_type=labels.get(ENGINE_TYPE_LABEL, "vllm"),
                                annotations=_kv_events_annotations(meta)))
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
    """The objects of `--manifests` (a YAML stream), read within kvgate.common.bounded_yaml's limits (1 MiB, 64 levels,
    10,000 nodes); OSError or ValueError (yaml.YAMLError wrapped) saying why not."""
    try:
        docs = bounded_yaml.load_all(bounded_file.read_text(path, bounded_yaml.MAX_CHARS))
    except yaml.YAMLError as exc:
        raise ValueError(f"not valid YAML: {' '.join(str(exc).split())[:500]}") from None
    return [d for d in docs if isinstance(d, dict)]


class EndpointsFile:
    """Standalone mode's hot reload of `--endpoints-file`, polled by the EPP's main loop.

    The file is read whole at every poll (it is small: MAX_BYTES at most) and a new content is installed only
    when it is complete: it did not change while being read (fstat before and after), and either it was last
    modified at least `settle` seconds ago or the previous poll read the same bytes. That covers both ways of
    writing it: an atomic rename (`mv`, a ConfigMap volume's symlink swap) is complete at once, and an editor
    or `>` rewriting the file in place is done within milliseconds. A bad line is logged (`file:line: why`) and
    skipped; a file that cannot be read (gone, a directory, no permission, not UTF-8, too large) or whose every
    entry is bad leaves the last good set serving. Each problem is logged once, until the file changes.
    """

    MAX_BYTES = 1 << 20  # ~40,000 entries; more is a mistake, not a pool

    def __init__(self, path: str | Path, datastore: Datastore, settle: float = 0.25,
                 clock: Callable[[], float] = time.time) -> None:
        self.path = Path(path)
        self.datastore = datastore
        self.settle = settle
        self._clock = clock  # wall clock: it is compared with the file's mtime
        self._done: bytes | None = None  # the last content acted on (installed or rejected)
        self._pending: bytes | None = None  # read at the previous poll while too fresh to trust alone
        self._reported: tuple | None = None  # the last problem logged, to log it once

    def poll(self) -> bool:
        """Re-read the file; True when a new endpoint set was installed. Never raises for the file's sake."""
        try:
            read = self._read()
        except OSError as exc:
            self._report(("unreadable", type(exc), exc.errno), "cannot read it (%s)", exc.strerror or exc)
            return False
        except ValueError as exc:  # not a regular file, too large
            self._report(("invalid", str(exc)), "%s", exc)
            return False
        if read is None:  # changed while being read: a writer is at work, look again at the next poll
            return False
        data, mtime = read
        if self._reported is not None and self._reported[0] in ("unreadable", "invalid"):
            log.info("endpoints file %s: readable again", self.path)
            self._reported = None
        if data == self._done:
            self._pending = None
            return False
        if self._clock() - mtime < self.settle and data != self._pending:
            self._pending = data  # maybe half-written: trust it once it settles or reads the same next poll
            return False
        self._pending, self._done = None, data
        return self._install(data)

    def _read(self) -> tuple[bytes, float] | None:
        if not stat.S_ISREG(os.stat(self.path).st_mode):  # before open(): opening a FIFO would block
            raise ValueError("not a regular file")
        with open(self.path, "rb") as f:
            before = os.fstat(f.fileno())
            data = f.read(self.MAX_BYTES + 1)
            after = os.fstat(f.fileno())
        if len(data) > self.MAX_BYTES:
            raise ValueError(f"larger than {self.MAX_BYTES} bytes")
        signature = (before.st_size, before.st_mtime_ns, before.st_ctime_ns)
        if signature != (after.st_size, after.st_mtime_ns, after.st_ctime_ns) or len(data) != after.st_size:
            return None
        return data, after.st_mtime

    def _install(self, data: bytes) -> bool:
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            self._report(("utf-8", data), "not UTF-8 text (byte %d)", exc.start)
            return False
        endpoints, problems = parse_endpoints_lines(text)
        for number, problem in problems:
            log.warning("%s:%d: %s; line skipped", self.path, number, problem)
        if problems and not endpoints:
            self._report(("no entries", data), "no valid entry")
            return False
        self._reported = None
        self.datastore.set_endpoints(endpoints)
        return True

    def _report(self, key: tuple, message: str, *args) -> None:
        if key == self._reported:
            return
        self._reported = key
        kept = f"keeping the last good set of {len(self.datastore.endpoints)} endpoints" if self.datastore.synced \
            else "no endpoints yet (not ready)"
        log.warning("endpoints file %s: " + message + "; %s", self.path, *args, kept)
