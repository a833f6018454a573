"""The suite's view of the cluster under test: apply the upstream manifests, read statuses, wait.

Objects are plain dicts through the operator's API layer (kvgate.operator.apply.Kube: retries, server-side
apply), with field manager `kvgate-conformance`. Manifests are the upstream suite's files (manifests/),
applied as upstream applies them, with three substitutions:

  * `{GATEWAY_CLASS_NAME}` → the gateway class under test;
  * the upstream test EPP image → `--epp-image` when given (our EPP in place of upstream's `lwepp`; the
    container then runs `kvgate epp` with upstream's arguments, which it accepts);
  * on API servers older than 1.24, gRPC probes → tcpSocket probes on the same port (no gRPC probes there).
"""

from __future__ import annotations

import re
import time
from importlib import resources
from typing import Callable

import yaml

from kvgate.conformance.epp_config import CONFORMANCE_EPP_CONFIG
from kvgate.operator.apply import KINDS, ApiError, Kind, Kube, kind_for

FIELD_MANAGER = "kvgate-conformance"
UPSTREAM_EPP_IMAGE = re.compile(r"(^|/)lwepp(:|@|$)")
POD_TEMPLATE_KINDS = {"Deployment", "ReplicaSet", "StatefulSet", "DaemonSet"}

POOL = KINDS[("inference.networking.k8s.io/v1", "InferencePool")]
HTTPROUTE = KINDS[("gateway.networking.k8s.io/v1", "HTTPRoute")]
GATEWAY = KINDS[("gateway.networking.k8s.io/v1", "Gateway")]
DEPLOYMENT = KINDS[("apps/v1", "Deployment")]
SERVICE = KINDS[("v1", "Service")]
POD = KINDS[("v1", "Pod")]
NAMESPACE = KINDS[("v1", "Namespace")]


class ConformanceError(AssertionError):
    """A conformance expectation that did not hold (the test fails with this message)."""


def manifest_text(name: str) -> str:
    return resources.files("kvgate.conformance").joinpath("manifests", name).read_text()


def load_manifest(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(manifest_text(name)) if d]


def grpc_probe_to_tcp(probe: dict) -> dict:
    """A gRPC probe as a tcpSocket probe on its port (servers before 1.24 have no gRPC probes)."""
    if "grpc" not in probe:
        return probe
    out = {k: v for k, v in probe.items() if k != "grpc"}
    out["tcpSocket"] = {"port": probe["grpc"]["port"]}
    return out


def prepare(doc: dict, gateway_class: str, epp_image: str | None, grpc_probes: bool) -> dict:
    """One upstream document as this run applies it (see the module docstring)."""
    text = yaml.safe_dump(doc).replace("{GATEWAY_CLASS_NAME}", gateway_class)
    out = yaml.safe_load(text)
    if out.get("kind") not in POD_TEMPLATE_KINDS:
        return out
    pod = out["spec"]["template"]["spec"]
    for c in pod.get("containers") or []:
        if epp_image and UPSTREAM_EPP_IMAGE.search(c.get("image", "")):
            c["image"] = epp_image
            c["command"] = ["kvgate", "epp"]
            # Upstream's EPP listens on every interface by default; ours on loopback unless told.
            c["args"] = [*(c.get("args") or []), "--grpc-host", "0.0.0.0", "--config-text", CONFORMANCE_EPP_CONFIG]
            c.pop("imagePullPolicy", None)
        if not grpc_probes:
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                if probe in c:
                    c[probe] = grpc_probe_to_tcp(c[probe])
    return out


class Cluster:
    def __init__(self, kube: Kube, gateway_class: str, epp_image: str | None = None) -> None:
        self.kube, self.gateway_class, self.epp_image = kube, gateway_class, epp_image
        version = kube.request("GET", "/version") or {}
        minor = int(re.sub(r"\D", "", str(version.get("minor", "0"))) or 0)
        self.server_version = f"{version.get('major', '?')}.{version.get('minor', '?')}"
        self.grpc_probes = int(version.get("major", 1) or 1) > 1 or minor >= 24

    @classmethod
    def connect(cls, gateway_class: str, epp_image: str | None = None, kubeconfig: str | None = None) -> "Cluster":
        from kubernetes import client, config

        if kubeconfig:
            api = config.new_client_from_config(config_file=kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api = client.ApiClient()
        # The suite owns what it applies (upstream's manifests, by its own field manager): no operator ownership guard.
        return cls(Kube(api, field_manager=FIELD_MANAGER, attempts=4, guard_ownership=False), gateway_class, epp_image)

    # --- manifests ------------------------------------------------------------------------------------------
    def documents(self, manifest: str) -> list[dict]:
        return [prepare(d, self.gateway_class, self.epp_image, self.grpc_probes) for d in load_manifest(manifest)]

    def apply(self, manifest: str) -> list[dict]:
        docs = self.documents(manifest)
        for doc in docs:
            self.apply_object(doc)
        return docs

    def apply_object(self, doc: dict) -> dict:
        try:
            return self.kube.apply(doc)
        except ApiError as exc:
            raise ConformanceError(f"applying {doc['kind']} {doc['metadata'].get('namespace', '')}/"
                                   f"{doc['metadata']['name']} failed: {exc}") from exc

    def delete(self, docs: list[dict], wait_s: float = 0.0) -> None:
        for doc in reversed(docs):
            self.kube.delete(doc)
        if wait_s > 0:
            wait_until(lambda: all(self.get_doc(d) is None for d in docs), wait_s,
                       "the test's objects to be deleted")

    def get_doc(self, doc: dict) -> dict | None:
        meta = doc["metadata"]
        return self.kube.get(kind_for(doc), meta["name"], meta.get("namespace"))

    def get(self, kind: Kind, name: str, namespace: str | None = None) -> dict | None:
        return self.kube.get(kind, name, namespace)

    def list(self, kind: Kind, namespace: str | None = None, label_selector: str | None = None) -> list[dict]:
        return self.kube.list(kind, namespace, label_selector)

    # --- what tests read ------------------------------------------------------------------------------------
    def ready_pods(self, namespace: str, selector: dict[str, str]) -> list[dict]:
        labels = ",".join(f"{k}={v}" for k, v in selector.items())
        return [p for p in self.list(POD, namespace, labels)
                if not p["metadata"].get("deletionTimestamp") and (p.get("status") or {}).get("podIP")
                and any(c.get("type") == "Ready" and c.get("status") == "True"
                        for c in (p.get("status") or {}).get("conditions") or [])]

    def gateway_address(self, namespace: str, name: str, listener: str | None = None) -> str:
        """host:port of a Gateway: its first status address and the listener's port (default: the first)."""
        gw = self.get(GATEWAY, name, namespace)
        if gw is None:
            raise ConformanceError(f"Gateway {namespace}/{name} not found")
        addresses = [a.get("value") for a in (gw.get("status") or {}).get("addresses") or [] if a.get("value")]
        if not addresses:
            raise ConformanceError(f"Gateway {namespace}/{name} has no status.addresses")
        listeners = (gw.get("spec") or {}).get("listeners") or []
        chosen = next((l for l in listeners if listener in (None, l.get("name"))), None)
        if chosen is None:
            raise ConformanceError(f"Gateway {namespace}/{name} has no listener {listener!r}")
        host = addresses[0]
        return f"[{host}]:{chosen['port']}" if ":" in host else f"{host}:{chosen['port']}"


def conditions_of(entry: dict | None) -> dict[str, dict]:
    return {c.get("type"): c for c in (entry or {}).get("conditions") or []}


def parent_entry(obj: dict | None, gateway_ns: str, gateway_name: str, default_ns: str | None = None) -> dict | None:
    """The status.parents entry of `obj` (InferencePool or HTTPRoute) for a Gateway parentRef."""
    for entry in ((obj or {}).get("status") or {}).get("parents") or []:
        ref = entry.get("parentRef") or {}
        if (ref.get("kind", "Gateway") == "Gateway" and ref.get("name") == gateway_name
                and ref.get("namespace", default_ns or (obj or {}).get("metadata", {}).get("namespace")) == gateway_ns):
            return entry
    return None


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.5,
               describe: Callable[[], str] | None = None):
    """Poll `predicate` until truthy (returned) or `timeout_s` passes (ConformanceError naming `what`)."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        try:
            value = predicate()
            if value:
                return value
            last_error = None
        except ApiError as exc:
            last_error = exc
        if time.monotonic() >= deadline:
            detail = f"; last API error: {last_error}" if last_error else ""
            if describe is not None:
                try:
                    detail += f"; observed: {describe()}"
                except Exception as exc:  # noqa: BLE001 - a description must not hide the timeout
                    detail += f"; (describing failed: {exc})"
            raise ConformanceError(f"timed out after {timeout_s:.0f}s waiting for {what}{detail}")
        time.sleep(interval_s)
