"""What the operator's e2e tests share: the CRDs, the samples, and `kvgate operator` as a local process.

The operator runs next to the rig with the rig's kubeconfig and `--epp-address-mode pod-ip` (the rig has no
Service DNS, so Envoy reaches a pool's EPP by its pod IP).
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

from k8srig import crds, objects
from k8srig.kube import CORE, load_documents

from tests.upstream import gateway_api_crds

REPO = Path(__file__).resolve().parents[2]
KVGATE = str(Path(sys.executable).parent / "kvgate")
# A pool's own EndpointPickerConfig (the `kvgate.dev/epp-config` annotation), different from the default: rolls
# the pool's EPP when applied.
TUNED_EPP_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: prefix-cache-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: prefix-cache-scorer
    weight: 5
  - pluginRef: max-score-picker
"""


def gateway_serves(url: str, model: str = "demo") -> bool:
    """One short completion through a Gateway answers 200: its Envoy has its routes and a ready EPP."""
    import httpx

    try:
        r = httpx.post(f"{url}/v1/completions", timeout=10, json={"model": model, "prompt": "Hello", "max_tokens": 2})
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def grpc_health(address: str, service: str) -> str:
    """What the gRPC health service at `address` (host:port) answers for `service`: SERVING, NOT_SERVING, ...,
    or "error <code>"."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                               timeout=2).status
        except grpc.RpcError as e:
            return f"error {e.code().name}"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status)


def is_ready(pod: dict) -> bool:
    return (not pod["metadata"].get("deletionTimestamp") and bool(pod.get("status", {}).get("podIP"))
            and any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or []))


# The samples' kinds and their API versions (samples() below makes one object of each).
SAMPLE_KINDS = {"ModelServer": "kvgate.dev/v1alpha1", "InferencePool": "inference.networking.k8s.io/v1",
                "Gateway": "gateway.networking.k8s.io/v1", "GatewayClass": "gateway.networking.k8s.io/v1",
                "HTTPRoute": "gateway.networking.k8s.io/v1",
                "InferenceObjective": "inference.networking.x-k8s.io/v1alpha2"}


def sample_resources(client, wait_s: float = 30) -> dict:
    """Each sample kind's API resource, by kind, once the API server serves it (its CRD may be just installed)."""
    return {kind: client.resource_for(version, kind, wait_s=wait_s) for kind, version in SAMPLE_KINDS.items()}


class Stages:
    """A long e2e test's progress in its log: `mark(what)` prints the seconds since the test began (`t0`)."""

    def __init__(self, tag: str) -> None:
        self.tag, self.t0 = tag, time.monotonic()

    def __call__(self, what: str) -> None:
        print(f"[{self.tag}] {time.monotonic() - self.t0:6.1f}s {what}", flush=True)


def sample_namespace(k8s, prefix: str) -> tuple[str, str, dict[str, dict]]:
    """The CRDs installed, a fresh namespace `<prefix>-<4 hex>`, and the samples for it with a GatewayClass of its
    own (`kvgate-<namespace>`, cluster-scoped): (namespace, class name, samples by kind)."""
    install_crds(k8s)
    ns = f"{prefix}-{secrets.token_hex(2)}"
    k8s.client.create(CORE["Namespace"], objects.namespace(ns))
    class_name = f"kvgate-{ns}"
    return ns, class_name, samples(ns, class_name)


def condition_status(conditions: list[dict] | None, type_: str) -> str | None:
    return next((c["status"] for c in conditions or [] if c["type"] == type_), None)


def install_crds(k8s, ours: Path = REPO / "crds") -> None:
    """Our CRDs and the vendored Gateway API CRDs, as the rig's 1.20 takes them. Skips the test where the rig
    is not local (these tests run the operator, or its pod, next to it)."""
    import pytest

    if not getattr(k8s, "local", False):
        pytest.skip("runs the operator next to the local rig")
    crds.install(k8s.client, sorted(ours.glob("*.yaml")) + gateway_api_crds())


def samples(namespace: str, class_name: str) -> dict[str, dict]:
    """crds/samples/ by kind, in `namespace`, the GatewayClass named `class_name` (cluster-scoped: unique to
    a test) and the Gateway of that class."""
    docs = {}
    for f in sorted((REPO / "crds" / "samples").glob("*.yaml")):
        for doc in load_documents(f.read_text()):
            docs[doc["kind"]] = doc
    for kind, doc in docs.items():
        if kind == "GatewayClass":
            doc["metadata"]["name"] = class_name
        else:
            doc["metadata"]["namespace"] = namespace
    docs["Gateway"]["spec"]["gatewayClassName"] = class_name
    return docs


def start_operator(kubeconfig: Path, log_path: Path, *extra_args: str) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen([KVGATE, "operator", "--epp-address-mode", "pod-ip", "--resync-seconds", "10",
                                 *extra_args], stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=dict(os.environ, KUBECONFIG=str(kubeconfig), PYTHONUNBUFFERED="1"))


def stop_operator(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def pod_story(k8s, namespace: str, selector: str, lines: int = 12) -> str:
    """Where each pod of `selector` stands, as the kubelet sees it, for a timeout's message: bound node, phase,
    conditions, each container's state with its reason, and the rig pod runner's log lines that name the pod
    (a pod stuck Pending before any container started leaves no log of its own)."""
    runner_log = getattr(k8s, "dir", None) and Path(k8s.dir) / "logs" / "pod-runner.log"
    runner_lines = runner_log.read_text(errors="replace").splitlines() if runner_log and runner_log.exists() else []
    out = []
    for p in k8s.client.list(CORE["Pod"], namespace, labelSelector=selector)["items"]:
        md, st = p["metadata"], p.get("status") or {}
        conds = ", ".join(f"{c['type']}={c['status']}" + (f" ({c['reason']})" if c.get("reason") else "")
                          for c in st.get("conditions") or [])
        containers = []
        for c in st.get("containerStatuses") or []:
            state, detail = next(iter((c.get("state") or {"unknown": {}}).items()))
            why = " ".join(str(detail[k]) for k in ("reason", "message", "exitCode") if detail.get(k) is not None)
            containers.append(f"{c['name']} {state}{' ' + why if why else ''} restarts={c.get('restartCount')}")
        mine = [line for line in runner_lines if md["name"] in line][-lines:]
        out.append(f"pod {md['name']} node={p['spec'].get('nodeName')} phase={st.get('phase')} "
                   f"deleting={bool(md.get('deletionTimestamp'))} conditions [{conds}] "
                   f"containers [{'; '.join(containers)}]\n  pod runner on it:\n    " + "\n    ".join(mine or ["(nothing)"]))
    warnings = [line for line in runner_lines if " WARNING " in line or " ERROR " in line][-lines:]
    out.append("pod runner warnings (last):\n    " + "\n    ".join(warnings or ["(none)"]))
    return "\n".join(out)


def print_log_tail(log_path: Path, chars: int = 6000, what: str = "operator log") -> None:
    if log_path.exists():
        print(f"--- {what} ({log_path}):\n" + log_path.read_text(errors="replace")[-chars:])
