"""Tenants cannot escalate through the operator, on the rig, as a user holding only a tenant's permissions: a
ServiceAccount whose Role allows ModelServers and InferencePools in one namespace and nothing else.

Against `kvgate operator` with its defaults (no --allow-host-path, no --allow-image-prefix) the tenant tries
  - a ModelServer mounting the node's `/` (hostPath)                  -> Ready=False HostPathNotAllowed
  - a ModelServer running another image (spec.image)                  -> Ready=False ImageNotAllowed
  - podLabels that match another pool's selector                      -> Ready=False JoinsOtherPool
  - a pool of its own whose selector lands inside another pool's      -> Ready=False JoinsOtherPool
  - a ModelServer named like another user's Deployment                -> Ready=False NameConflict
each refused with a condition and nothing written: no Deployment, the other user's Deployment untouched. A
valid ModelServer of the same tenant comes up Ready (the operator still serves it), with the engine pods'
restrictive securityContext and drain settings; and the tenant's own API access is what a tenant's is (it may
not create a Deployment itself).

The operator runs as a local process with the rig's admin kubeconfig (tests/e2e/operator_run.py).
"""

from __future__ import annotations

import base64
import secrets
import time

import pytest
from k8srig import objects
from k8srig.kube import CORE, DEPLOYMENT, ApiError, Client, Kubeconfig, wait_default_service_account, wait_for
from operator_run import condition_status, install_crds, print_log_tail, start_operator, stop_operator

pytestmark = pytest.mark.e2e

TENANT_VERBS = ["get", "list", "watch", "create", "update", "patch", "delete"]


def _tenant_client(client: Client, ns: str) -> Client:
    """A client authenticated as ServiceAccount `tenant` of `ns`, bound to a Role that allows ModelServers
    and InferencePools in `ns` only (its 1.20 token Secret, made by the token controller)."""
    rbac = "rbac.authorization.k8s.io/v1"
    client.create(CORE["ServiceAccount"], {"apiVersion": "v1", "kind": "ServiceAccount",
                                           "metadata": {"name": "tenant", "namespace": ns}}, ns)
    client.create(client.resource_for(rbac, "Role"), {
        "apiVersion": rbac, "kind": "Role", "metadata": {"name": "tenant", "namespace": ns},
        "rules": [{"apiGroups": ["kvgate.dev"], "resources": ["modelservers"], "verbs": TENANT_VERBS},
                  {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
                   "verbs": TENANT_VERBS}]}, ns)
    client.create(client.resource_for(rbac, "RoleBinding"), {
        "apiVersion": rbac, "kind": "RoleBinding", "metadata": {"name": "tenant", "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tenant"},
        "subjects": [{"kind": "ServiceAccount", "name": "tenant", "namespace": ns}]}, ns)

    def token() -> str | None:
        sa = client.get(CORE["ServiceAccount"], "tenant", ns)
        for ref in sa.get("secrets") or []:
            secret = client.get_or_none(CORE["Secret"], ref["name"], ns)
            if secret and (secret.get("data") or {}).get("token"):
                return base64.b64decode(secret["data"]["token"]).decode()
        return None
    tok = wait_for(token, timeout_s=30, what="the tenant ServiceAccount's token")
    return Client(Kubeconfig(server=client.config.server, ca_pem=client.config.ca_pem, token=tok))


def _pool(name: str, ns: str, selector: dict) -> dict:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"selector": {"matchLabels": selector}, "targetPorts": [{"number": 8000}],
                     "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}}}}


def _modelserver(name: str, ns: str, pool: str, **spec) -> dict:
    body = {"poolRef": {"name": pool}, "replicas": 1, "model": {"servedModelName": "demo"},
            "engine": {"backend": "sim"}}
    body.update(spec)
    return {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelServer",
            "metadata": {"name": name, "namespace": ns}, "spec": body}


def test_tenant_cannot_escalate_through_modelservers(k8s, tmp_path):
    client = k8s.client
    t0 = time.monotonic()
    install_crds(k8s)
    ns = f"e2e-tenant-{secrets.token_hex(2)}"
    client.create(CORE["Namespace"], objects.namespace(ns))
    ms_res = client.resource_for("kvgate.dev/v1alpha1", "ModelServer", wait_s=30)
    pool_res = client.resource_for("inference.networking.k8s.io/v1", "InferencePool", wait_s=30)
    log_path = tmp_path / "operator.log"
    operator = None
    try:
        wait_default_service_account(client, ns, token=True)
        tenant = _tenant_client(client, ns)
        # Another user's objects in the namespace: a pool (its pods would get that pool's prompts) and an app.
        client.create(pool_res, _pool("victim", ns, {"tier": "gold"}), ns)
        users_app = client.create(DEPLOYMENT, {
            "apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "users-app", "namespace": ns},
            "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "users-app"}},
                     "template": {"metadata": {"labels": {"app": "users-app"}},
                                  "spec": {"containers": [{"name": "c", "image": "ghcr.io/kvgate/kvgate:latest"}]}}}},
            ns)
        operator = start_operator(k8s.kubeconfig, log_path)

        # The tenant is a tenant: its own pool and ModelServers, no Deployments of its own.
        with pytest.raises(ApiError) as forbidden:
            tenant.create(DEPLOYMENT, {**users_app, "metadata": {"name": "direct", "namespace": ns}}, ns)
        assert forbidden.value.status == 403
        tenant.create(pool_res, _pool("tenant-pool", ns, {"app": "tenant-llm"}), ns)
        tenant.create(pool_res, _pool("sneaky-pool", ns, {"tier": "gold", "team": "t"}), ns)
        attempts = {
            "hostpath": (_modelserver("hostpath", ns, "tenant-pool",
                                      model={"path": "/host", "servedModelName": "demo", "hostPath": {"path": "/"}}),
                         "HostPathNotAllowed"),
            "other-image": (_modelserver("other-image", ns, "tenant-pool", image="docker.io/someone/else:1"),
                            "ImageNotAllowed"),
            "joiner": (_modelserver("joiner", ns, "tenant-pool", podLabels={"tier": "gold"}), "JoinsOtherPool"),
            "sneaky": (_modelserver("sneaky", ns, "sneaky-pool"), "JoinsOtherPool"),
            "users-app": (_modelserver("users-app", ns, "tenant-pool"), "NameConflict"),
        }
        for doc, _ in attempts.values():
            tenant.create(ms_res, doc, ns)
        tenant.create(ms_res, _modelserver("good", ns, "tenant-pool", engine={"backend": "sim",
                                                                              "shutdownGracePeriodSeconds": 20}), ns)

        def ready(name: str) -> dict:
            conds = (tenant.get(ms_res, name, ns).get("status") or {}).get("conditions") or []
            return next((c for c in conds if c["type"] == "Ready"), {})

        for name, (_, reason) in attempts.items():
            wait_for(lambda: ready(name).get("reason") == reason, timeout_s=60,
                     what=f"ModelServer {name}: Ready=False {reason}")
            assert ready(name)["status"] == "False" and ready(name)["message"], ready(name)
            print(f"[tenant-e2e] {time.monotonic() - t0:6.1f}s {name}: {reason}: {ready(name)['message'][:160]}")
        for name in ("hostpath", "other-image", "joiner", "sneaky"):
            assert client.get_or_none(DEPLOYMENT, name, ns) is None, f"a Deployment was made for {name}"
        assert "'victim'" in ready("joiner")["message"] and "'victim'" in ready("sneaky")["message"]
        after = client.get(DEPLOYMENT, "users-app", ns)  # (the deployment controller writes its status)
        assert not after["metadata"].get("ownerReferences") and "app.kubernetes.io/managed-by" not in (
            after["metadata"].get("labels") or {}), after["metadata"]
        assert all(f.get("manager") != "kvgate-operator" for f in after["metadata"].get("managedFields") or [])
        assert after["spec"]["template"]["spec"]["containers"] == users_app["spec"]["template"]["spec"]["containers"]
        assert after["spec"]["selector"] == {"matchLabels": {"app": "users-app"}}

        # The operator still serves the tenant's valid ModelServer, with locked-down, drain-ready pods.
        wait_for(lambda: condition_status((tenant.get(ms_res, "good", ns).get("status") or {}).get("conditions"),
                                          "Ready") == "True", timeout_s=120, what="ModelServer good Ready")
        pod = client.get(DEPLOYMENT, "good", ns)["spec"]["template"]["spec"]
        (c,) = pod["containers"]
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert pod["terminationGracePeriodSeconds"] == 30  # 20 s drain + preStop 5 s + 5 s to exit
        assert c["command"][c["command"].index("--shutdown-timeout") + 1] == "20"
        assert c["livenessProbe"]["httpGet"]["path"] == "/live"  # 503 only once the engine loop died
        print(f"[tenant-e2e] {time.monotonic() - t0:6.1f}s the valid ModelServer is Ready")

        # Fixing a refused ModelServer lets it through: the refusal was the spec's, not a stuck state.
        tenant.patch(ms_res, "joiner", {"spec": {"podLabels": {"tier": "silver"}}}, ns)
        wait_for(lambda: client.get_or_none(DEPLOYMENT, "joiner", ns) is not None, timeout_s=60,
                 what="the fixed ModelServer's Deployment")
        assert operator.poll() is None, "the operator exited"
    except BaseException:
        print_log_tail(log_path)
        raise
    finally:
        stop_operator(operator)
        client.delete(CORE["Namespace"], ns)
