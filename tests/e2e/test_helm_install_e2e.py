"""`helm install` of charts/kvgate through the Helm SDK against the rig, in two of the chart's three modes: the
operator runs as a pod (the rig runs the kvgate image as the local `kvgate` command) with the chart's
ServiceAccount and least-privilege RBAC against an API server that enforces RBAC; then crds/samples/ come up
as with the operator run by hand: engine pods, EPP and Envoy Ready, a completion through the Gateway's address,
the pool Accepted and ResolvedRefs. `helm uninstall` removes the operator and its RBAC.

  default         the release namespace only: one operator, a Role there and a small ClusterRole; the samples
                  in the release namespace
  namespaced      watchNamespaces: one operator per watched namespace, a Role there and a small ClusterRole;
                  the samples in the watched namespace (which exists before the install: the Role goes there)

The chart's third mode, allNamespaces (one ClusterRole), is not installed here: its ClusterRole grants exactly the
default mode's Role and small ClusterRole together (tests/test_helm_chart.py
test_cluster_rbac_is_exactly_what_the_operator_uses), which this install shows are enough, and the operator's
cluster-wide watch is what every other operator e2e test runs; a third install cost the suite ~31 s.

The rig is Kubernetes 1.20: the chart's CRDs use CEL rules it does not know, so the test installs their 1.20
copies first (as a cluster admin installs CRDs ahead of a chart) and installs a copy of the chart without its
crds/ folder — what `helm install --skip-crds` does; the SDK's install has no such switch, and Helm's
server-side apply would otherwise re-apply the CEL rules. The Gateway API CRDs are the chart's documented
prerequisite.
"""

from __future__ import annotations

import re
import secrets
import shutil
import time
from pathlib import Path

import httpx
import pytest
from k8srig import objects
from k8srig.kube import CORE, DEPLOYMENT, delete_namespace, wait_default_service_account, wait_for
from operator_run import REPO, condition_status, install_crds, is_ready, samples

pytestmark = pytest.mark.e2e
helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")

CHART = REPO / "charts" / "kvgate"
RELEASE = "kvgate"

# How a refused API call shows in the operator's log: kopf's APIForbiddenError, the kubernetes client's
# "(403)\nReason: Forbidden", a Status body's "code": 403. Not a bare "403": log timestamps end in
# milliseconds (",403") and once failed CI that way.
RBAC_REFUSAL = re.compile(r"(?i)forbidden|\(403\)|['\"]code['\"]:\s*403\b|\bHTTP/\d(\.\d)?\"?\s+403\b")


@pytest.mark.parametrize("mode", ["default", "namespaced"])
def test_helm_install_runs_the_operator_and_the_samples(k8s, tmp_path, mode):
    client = k8s.client
    t0 = time.monotonic()

    def mark(what: str) -> None:
        print(f"[helm-e2e {mode}] {time.monotonic() - t0:6.1f}s {what}", flush=True)

    install_crds(k8s, CHART / "crds")
    chart = shutil.copytree(CHART, tmp_path / "kvgate", ignore=shutil.ignore_patterns("crds"))  # --skip-crds
    suffix = secrets.token_hex(2)
    release_ns, class_name = f"e2e-helm-{suffix}", f"kvgate-helm-{suffix}"  # a GatewayClass is cluster-scoped
    values = {
        "image": {"repository": "ghcr.io/kvgate/kvgate", "tag": "latest"},
        # No Service DNS on the rig: Envoy reaches the EPP by pod IP, and reads its config from files (the chart's
        # default, xDS, names the operator's xDS Service by DNS; tests/e2e/test_xds_e2e.py runs xDS on the rig).
        "operator": {"eppAddressMode": "pod-ip", "resyncSeconds": 10, "envoyConfigSource": "files"},
        "gatewayClass": {"name": class_name},
        "logLevel": "info",
    }
    namespaced = mode == "namespaced"
    if namespaced:
        app_ns = f"e2e-helm-team-{suffix}"
        values["watchNamespaces"] = [app_ns]
        operator_name, cluster_role = f"{RELEASE}-{app_ns}", f"{RELEASE}-cluster"
        client.create(CORE["Namespace"], objects.namespace(app_ns))
        wait_default_service_account(client, app_ns, token=True)
    else:
        app_ns, operator_name, cluster_role = release_ns, RELEASE, f"{RELEASE}-cluster"
    pool_res = client.resource_for("inference.networking.k8s.io/v1", "InferencePool", wait_s=30)
    gw_res = client.resource_for("gateway.networking.k8s.io/v1", "Gateway", wait_s=30)
    gc_res = client.resource_for("gateway.networking.k8s.io/v1", "GatewayClass", wait_s=30)
    role_res = client.resource_for("rbac.authorization.k8s.io/v1", "Role")
    crole_res = client.resource_for("rbac.authorization.k8s.io/v1", "ClusterRole")
    config = helm.Config(kubeconfig_path=str(k8s.kubeconfig), namespace=release_ns)
    installed = False
    try:
        info = config.install(str(chart), RELEASE, values, namespace=release_ns, create_namespace=True, timeout=120)
        installed = True
        mark(f"helm install: release {RELEASE} in {release_ns} ({len(str(info.get('manifest', '')))} bytes)")
        assert client.get_or_none(crole_res, cluster_role) is not None
        assert client.get_or_none(role_res, RELEASE, app_ns) is not None, "the Role in the served namespace"

        def pods(ns: str, selector: str) -> list[dict]:
            return client.list(CORE["Pod"], ns, labelSelector=selector)["items"]

        operator_selector = "app.kubernetes.io/component=operator"
        wait_for(lambda: any(is_ready(p) for p in pods(release_ns, operator_selector)), timeout_s=90,
                 what="the operator pod Ready (kopf liveness endpoint answering)")
        wait_for(lambda: condition_status((client.get(gc_res, class_name).get("status") or {}).get("conditions"),
                                          "Accepted") == "True", timeout_s=60,
                 what="the chart's GatewayClass Accepted by the operator in its pod")
        mark("operator pod Ready, GatewayClass Accepted")

        for kind, doc in samples(app_ns, class_name).items():
            if kind != "GatewayClass":  # the chart made one
                client.apply(doc)
        wait_for(lambda: sum(is_ready(p) for p in pods(app_ns, "app=demo-llm")) == 2, timeout_s=120,
                 what="2 engine pods Ready")
        for name in ("demo-pool-epp", "inference-gateway-envoy"):
            wait_for(lambda: ((client.get_or_none(DEPLOYMENT, name, app_ns) or {}).get("status") or {})
                     .get("readyReplicas", 0) >= 1, timeout_s=90, what=f"Deployment {name} Ready")
        mark(f"samples applied in {app_ns}: engine pods, EPP and Envoy Ready")

        def gateway_address() -> str | None:
            addresses = ((client.get(gw_res, "inference-gateway", app_ns).get("status") or {}).get("addresses")
                         or [])
            return addresses[0]["value"] if addresses else None
        address = wait_for(gateway_address, timeout_s=60, what="the Gateway's address")
        engine_ips = {p["status"]["podIP"] for p in pods(app_ns, "app=demo-llm") if is_ready(p)}
        served = []

        def completion_served() -> bool:
            try:
                r = httpx.post(f"http://{address}:8080/v1/completions", timeout=10,
                               json={"model": "demo", "prompt": "Hello", "max_tokens": 4})
            except httpx.HTTPError:
                return False
            if r.status_code == 200 and "x-kvgate-endpoint" in r.headers:
                served.append(r.headers["x-kvgate-endpoint"])
                return True
            return False
        wait_for(completion_served, timeout_s=60, interval_s=1, what="a completion through the Gateway address")
        assert served[-1].rsplit(":", 1)[0] in engine_ips, (served, engine_ips)
        mark(f"completion served through {address}:8080 by {served[-1]}")

        def pool_parent_ok() -> bool:
            parents = (client.get(pool_res, "demo-pool", app_ns).get("status") or {}).get("parents") or []
            entry = next((p for p in parents if p["parentRef"]["name"] == "inference-gateway"), None)
            return bool(entry) and all(condition_status(entry["conditions"], t) == "True"
                                       for t in ("Accepted", "ResolvedRefs"))
        wait_for(pool_parent_ok, timeout_s=30, what="InferencePool Accepted and ResolvedRefs for the Gateway")
        mark("pool status Accepted + ResolvedRefs")

        # The chart's RBAC was enough for everything the operator did: its log has no refusal.
        logs = list((Path(k8s.dir) / "runner" / "pods").glob(f"{release_ns}_{operator_name}-*/operator.log"))
        assert logs, "operator container log not found"
        text = "\n".join(p.read_text(errors="replace") for p in logs)
        refusals = [line for line in text.splitlines() if RBAC_REFUSAL.search(line)]
        assert not refusals, refusals[:20]

        config.uninstall(RELEASE, timeout=60)
        installed = False
        wait_for(lambda: not pods(release_ns, operator_selector), timeout_s=60,
                 what="the operator pod gone after helm uninstall")
        assert client.get_or_none(DEPLOYMENT, operator_name, release_ns) is None
        assert client.get_or_none(crole_res, cluster_role) is None
        assert client.get_or_none(gc_res, class_name) is None
        assert client.get_or_none(role_res, RELEASE, app_ns) is None
        mark("helm uninstall removed the operator and its RBAC")
    finally:
        if installed:
            config.uninstall(RELEASE, timeout=60, ignore_not_found=True)
        config.close()
        client.delete(gc_res, class_name)
        for ns in {app_ns, release_ns}:
            delete_namespace(client, ns, timeout_s=120)
