"""Versioned xDS snapshots of one Gateway, built from its xDS file set (xds_files.py).

A resource's type is its `@type`; its name is `name` (listeners, route tables, clusters) or `cluster_name`
(endpoints). Each type's version is a digest of that type's resources as canonical JSON, so that every operator
replica computes the same versions from the same ConfigMap, an Envoy that reconnects to another replica is not
sent anything new, and a route change leaves the clusters' version (and Envoy's clusters) alone. The snapshot's
version is the digest of the four; it is what a Gateway's Programmed condition waits for.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import pkgutil
from dataclasses import dataclass

from google.protobuf import any_pb2, json_format, symbol_database

from kvgate.common.gateway_routes import BOOTSTRAP_FILE

CLUSTER = "type.googleapis.com/envoy.config.cluster.v3.Cluster"
ENDPOINT = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment"
LISTENER = "type.googleapis.com/envoy.config.listener.v3.Listener"
ROUTE = "type.googleapis.com/envoy.config.route.v3.RouteConfiguration"
# Make before break (the xDS protocol's eventual-consistency rules for ADS): clusters, then their endpoints, then
# the listeners and route tables that use them.
TYPE_ORDER = (CLUSTER, ENDPOINT, LISTENER, ROUTE)
MAX_RESOURCES = 10_000  # per snapshot: far above a Gateway's, a bound on what a ConfigMap may make us build


class SnapshotError(ValueError):
    """A file set that is not a snapshot (an unknown type, a resource without a name, a field Envoy's protos
    do not have)."""


def _name(resource: dict) -> str:
    name = resource.get("name") if resource.get("@type") != ENDPOINT else resource.get("cluster_name")
    if not isinstance(name, str) or not name:
        raise SnapshotError(f"a {resource.get('@type')} resource without a name")
    return name


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def resources_by_type(files: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """{type: {name: resource}} of every file but the bootstrap."""
    out: dict[str, dict[str, dict]] = {t: {} for t in TYPE_ORDER}
    count = 0
    for file, doc in sorted(files.items()):
        if file == BOOTSTRAP_FILE:
            continue
        for resource in (doc or {}).get("resources") or []:
            type_url = resource.get("@type") if isinstance(resource, dict) else None
            if type_url not in out:
                raise SnapshotError(f"{file}: a resource of unknown type {type_url!r}")
            count += 1
            if count > MAX_RESOURCES:
                raise SnapshotError(f"more than {MAX_RESOURCES} resources")
            out[type_url][_name(resource)] = resource
    return out


def versions_of(by_type: dict[str, dict[str, dict]]) -> tuple[dict[str, str], str]:
    """Each type's version, and the snapshot's."""
    versions = {t: _digest(by_type.get(t) or {}) for t in TYPE_ORDER}
    return versions, _digest([versions[t] for t in TYPE_ORDER])


def config_version(files: dict[str, dict]) -> str:
    """The snapshot version of an xDS file set (what the leader compares Envoys' ACKs with)."""
    return versions_of(resources_by_type(files))[1]


# --- packing into protobuf ---------------------------------------------------------------------------------------

_imported_packages: set[str] = set()


def _import_type(type_url: str) -> None:
    """Register the proto of `type_url` (and its package's siblings) in the default pool: json_format resolves
    nested `@type`s (filters, protocol options, tracers) only among imported messages."""
    package = type_url.rsplit("/", 1)[-1].rsplit(".", 1)[0]
    if package in _imported_packages:
        return
    _imported_packages.add(package)
    try:
        module = importlib.import_module(package)
    except ImportError:
        return
    for info in pkgutil.iter_modules(module.__path__):
        if info.name.endswith("_pb2"):
            importlib.import_module(f"{package}.{info.name}")


def _type_urls(node, out: set[str]) -> set[str]:
    if isinstance(node, dict):
        if isinstance(node.get("@type"), str):
            out.add(node["@type"])
        for value in node.values():
            _type_urls(value, out)
    elif isinstance(node, list):
        for value in node:
            _type_urls(value, out)
    return out


def pack(resource: dict) -> any_pb2.Any:
    """A resource dict (with its `@type`) as the Any a DiscoveryResponse carries; SnapshotError when Envoy's
    protos do not take it."""
    for type_url in sorted(_type_urls(resource, set())):
        _import_type(type_url)
    try:
        message_class = symbol_database.Default().GetSymbol(resource["@type"].rsplit("/", 1)[-1])
        message = json_format.ParseDict({k: v for k, v in resource.items() if k != "@type"}, message_class())
    except (KeyError, json_format.ParseError) as exc:
        raise SnapshotError(f"{resource.get('@type')} {_name(resource)!r}: {exc}") from None
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


ANY_ADDRESS = "0.0.0.0"


def bound_to(listener: dict, host: str) -> dict:
    """`listener` bound to `host` instead of the any-address."""
    address = (listener.get("address") or {}).get("socket_address") or {}
    if address.get("address") != ANY_ADDRESS:
        return listener
    return {**listener, "address": {**listener["address"], "socket_address": {**address, "address": host}}}


@dataclass(frozen=True)
class Snapshot:
    """One Gateway's resources, packed, by type and name; each type's version and the snapshot's; the
    listeners also as dicts, for Envoys that bind them to their pod's address (select's listen_host)."""
    resources: dict[str, dict[str, any_pb2.Any]]
    versions: dict[str, str]
    version: str
    listeners: dict[str, dict] = None

    @classmethod
    def from_files(cls, files: dict[str, dict]) -> "Snapshot":
        by_type = resources_by_type(files)
        versions, version = versions_of(by_type)
        packed = {t: {name: pack(r) for name, r in sorted(by_type[t].items())} for t in TYPE_ORDER}
        return cls(packed, versions, version, dict(sorted(by_type[LISTENER].items())))

    def select(self, type_url: str, names: list[str] | None, listen_host: str | None = None) -> list[any_pb2.Any]:
        """The resources of `type_url`: all (listeners, clusters), or those named (route tables, endpoints);
        with `listen_host`, listeners on the any-address are bound to it instead."""
        if type_url == LISTENER and listen_host:
            return [pack(bound_to(listener, listen_host)) for listener in (self.listeners or {}).values()]
        have = self.resources.get(type_url) or {}
        if type_url in (LISTENER, CLUSTER) or not names:
            return list(have.values())
        return [have[n] for n in sorted(set(names)) if n in have]
