"""`kvgate epp --pool-name` against the rig's real API server: the pool's ready pods become endpoints."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from k8srig import crds, objects
from k8srig.kube import CORE, DEPLOYMENT, delete_namespace, wait_default_service_account, wait_for
from operator_run import print_log_tail

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
KVGATE = str(Path(sys.executable).parent / "kvgate")


def free_ports(n: int) -> list[int]:
    """n distinct free ports (held open together while chosen, so no two are the same)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_epp_follows_the_pool_and_its_pods(k8s, tmp_path):
    if not getattr(k8s, "local", False):
        pytest.skip("runs the EPP as a local process next to the rig's pods")
    client = k8s.client
    crds.install(client, sorted((REPO / "crds").glob("*.yaml")))
    ns = "e2e-epp"
    client.create(CORE["Namespace"], objects.namespace(ns))
    epp = None
    try:
        wait_default_service_account(client, ns, token=True)
        args = ["serve", "demo", "--backend", "sim", "--host", "0.0.0.0", "--port", "8000"]
        client.create(DEPLOYMENT, objects.deployment("llm", ns, [objects.kvgate_container(args, 8000)], replicas=2))
        client.apply({"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
                      "metadata": {"name": "pool", "namespace": ns},
                      "spec": {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 8000}],
                               "endpointPickerRef": {"name": "pool-epp", "port": {"number": 9002}}}})
        metrics_port, grpc_port, health_port = free_ports(3)
        log = open(tmp_path / "epp.log", "wb")
        epp = subprocess.Popen([KVGATE, "--log-level", "info", "epp", "--pool-name", "pool", "--pool-namespace", ns,
                                "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
                                "--metrics-port", str(metrics_port)], stdout=log, stderr=subprocess.STDOUT,
                               env=dict(os.environ, KUBECONFIG=str(k8s.kubeconfig)), start_new_session=True)

        def endpoints() -> set[str]:
            try:
                text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).text
            except httpx.HTTPError:
                return set()
            return set(re.findall(r'kvgate_epp_endpoint_stale\{endpoint="([^"]+)"\} 0\.0', text))

        def ready_pod_endpoints() -> set[str]:
            pods = client.list(CORE["Pod"], ns, labelSelector="app=llm")["items"]
            return {f"{p['status']['podIP']}:8000" for p in pods
                    if any(c["type"] == "Ready" and c["status"] == "True"
                           for c in p.get("status", {}).get("conditions") or [])
                    and not p["metadata"].get("deletionTimestamp")}

        def converged(n: int) -> bool:
            assert epp.poll() is None, f"the EPP exited with {epp.returncode}"
            want = ready_pod_endpoints()
            return len(want) == n and endpoints() == want

        try:
            wait_for(lambda: converged(2), timeout_s=180, what="the EPP to scrape the pool's 2 ready pods")
            for replicas in (3, 1):
                client.patch(DEPLOYMENT, "llm", {"spec": {"replicas": replicas}}, ns)
                start = time.monotonic()
                wait_for(lambda: converged(replicas), timeout_s=180, what=f"the EPP to follow {replicas} pods")
                print(f"[epp] followed the pool to {replicas} endpoints {time.monotonic() - start:.1f}s after scaling")
        except BaseException:
            pods = client.list(CORE["Pod"], ns)["items"]
            print(f"[epp] EPP exit code {epp.poll()}; it scrapes {sorted(endpoints())}; ready pods "
                  f"{sorted(ready_pod_endpoints())}; pods "
                  f"{[(p['metadata']['name'], p['status'].get('phase'), p['status'].get('podIP'), p['status'].get('conditions'), p['status'].get('containerStatuses')) for p in pods]}")
            print_log_tail(tmp_path / "epp.log", what="EPP log")
            raise
    finally:
        if epp is not None:
            os.killpg(epp.pid, 15)
            epp.wait(timeout=15)
        delete_namespace(client, ns, wait_gone=False)
