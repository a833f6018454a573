"""Route and pool changes reach a running Envoy without restarting it.

`kvgate operator` runs the samples on the rig (as in test_operator_e2e: a local process with
`--epp-address-mode pod-ip`). With the Gateway serving, the HTTPRoute changes twice and is then put back:

1. a rule is added whose backendRef does not resolve (Envoy itself answers 500 on that path): a route-only
   change, carried by the Gateway's route table file;
2. a second InferencePool (the same engine pods and EPP) and a rule sending /tokenize to it, applied at once:
   new clusters (EPP, ORIGINAL_DST, fallback) and the routes naming them in one ConfigMap update;
3. the sample's route again: both rules and the second pool's clusters go.

Each is timed from the API write to the first request that sees it at the Envoy pod (polled every 20 ms):
the operator's reconcile and ConfigMap write (timed too), the rig's volume refresh (every VOLUME_REFRESH_S,
like the kubelet's sync) and Envoy's reload. Meanwhile keep-alive completions flow on the unchanged rule. Envoy must
be the same pod throughout (same uid, no restart), the Deployment's pod template unchanged, no completion
failed, and no config update rejected.
"""

from __future__ import annotations

import copy
import threading
import time

import httpx
import pytest
from k8srig.kube import CORE, DEPLOYMENT, wait_default_service_account, wait_for
from operator_run import is_ready, print_log_tail, sample_namespace, start_operator, stop_operator

pytestmark = pytest.mark.e2e
ENVOY_SELECTOR = "app.kubernetes.io/name=kvgate-gateway,app.kubernetes.io/instance=inference-gateway"
ADMIN_PORT = 19000  # kvgate.operator.gateway.ADMIN_PORT: on the rig, the pod's own address
UNRESOLVED_PATH = "/kvgate-e2e/unresolved"


def propagation_s(since: float, check, written=lambda: True, timeout_s: float = 60.0,
                  what: str = "the change") -> tuple[float, float]:
    """Seconds from `since` until check() holds, polled every 20 ms, and until written() first held (the
    operator's ConfigMap write)."""
    written_s = None
    while True:
        if written_s is None and written():
            written_s = time.monotonic() - since
        if check():
            seen_s = time.monotonic() - since
            return seen_s, seen_s if written_s is None else written_s
        if time.monotonic() - since > timeout_s:
            raise AssertionError(f"{what} did not reach Envoy within {timeout_s:g} s")
        time.sleep(0.02)


def test_route_and_pool_changes_reach_envoy_in_place(k8s, tmp_path):
    client = k8s.client
    ns, class_name, samples = sample_namespace(k8s, "e2e-envoy-prop")
    gc_res = client.resource_for("gateway.networking.k8s.io/v1", "GatewayClass", wait_s=30)
    route_res = client.resource_for("gateway.networking.k8s.io/v1", "HTTPRoute", wait_s=30)
    pool_res = client.resource_for("inference.networking.k8s.io/v1", "InferencePool", wait_s=30)

    log_path = tmp_path / "operator.log"
    operator = None
    stop_load = threading.Event()
    try:
        wait_default_service_account(client, ns, token=True)
        operator = start_operator(k8s.kubeconfig, log_path)
        for kind in ("GatewayClass", "InferencePool", "ModelServer", "Gateway", "HTTPRoute"):
            client.apply(samples[kind])

        def pods(selector: str) -> list[dict]:
            return client.list(CORE["Pod"], ns, labelSelector=selector)["items"]

        def deployment_ready(name: str) -> bool:
            dep = client.get_or_none(DEPLOYMENT, name, ns)
            return bool(dep) and (dep.get("status") or {}).get("readyReplicas", 0) >= 1

        wait_for(lambda: len([p for p in pods("app=demo-llm") if is_ready(p)]) == 2, timeout_s=90,
                 what="2 engine pods Ready")
        wait_for(lambda: deployment_ready("demo-pool-epp"), timeout_s=60, what="the EPP Deployment Ready")
        wait_for(lambda: deployment_ready("inference-gateway-envoy"), timeout_s=60,
                 what="the Envoy Deployment Ready")

        def completion(http: httpx.Client, ip: str) -> httpx.Response:
            return http.post(f"http://{ip}:8080/v1/completions",
                             json={"model": "demo", "prompt": "Hello", "max_tokens": 4})

        def envoy_serving() -> str | None:
            # The Envoy config follows the EPP pod's IP: the first Envoy pod may roll once while it settles.
            ready = [p for p in pods(ENVOY_SELECTOR) if is_ready(p)]
            if len(ready) != 1 or len(pods(ENVOY_SELECTOR)) != 1:
                return None
            ip = ready[0]["status"]["podIP"]
            try:
                return ip if completion(httpx.Client(timeout=10), ip).status_code == 200 else None
            except httpx.HTTPError:
                return None
        ip = wait_for(envoy_serving, timeout_s=90, interval_s=1, what="one Envoy pod serving a completion")
        (envoy_pod,) = pods(ENVOY_SELECTOR)
        uid, name = envoy_pod["metadata"]["uid"], envoy_pod["metadata"]["name"]
        restarts = envoy_pod["status"]["containerStatuses"][0]["restartCount"]
        template = client.get(DEPLOYMENT, "inference-gateway-envoy", ns)["spec"]["template"]
        admin = f"http://{ip}:{ADMIN_PORT}"

        def stat(name: str) -> int:
            text = httpx.get(f"{admin}/stats", params={"filter": f"^{name}$"}, timeout=5).text
            return int(text.split(": ")[1]) if ": " in text else 0

        outcomes: list = []

        def load() -> None:  # keep-alive completions on the sample's rule, which never changes
            with httpx.Client(timeout=30) as http:
                while not stop_load.is_set():
                    try:
                        r = completion(http, ip)
                        outcomes.append((r.status_code, r.text[:120] if r.status_code != 200 else ""))
                    except httpx.HTTPError as exc:
                        outcomes.append((type(exc).__name__, str(exc)[:120]))
                    time.sleep(0.05)
        loader = threading.Thread(target=load, daemon=True)
        loader.start()
        probe = httpx.Client(base_url=f"http://{ip}:8080", timeout=10)

        def config_version() -> str:
            return client.get(CORE["ConfigMap"], "inference-gateway-envoy", ns)["metadata"]["resourceVersion"]

        def update_route(rules: list[dict]):
            """Replace the route's rules; returns when, and a check that the operator has since written the
            Envoy ConfigMap."""
            route = client.get(route_res, "demo-route", ns)
            route["spec"]["rules"] = rules
            version = config_version()
            began = time.monotonic()
            client.replace(route_res, route, ns)
            return began, lambda: config_version() != version

        times: dict[str, tuple[float, float]] = {}  # what -> (served, ConfigMap written) after the route write
        sample_rules = copy.deepcopy(samples["HTTPRoute"]["spec"]["rules"])
        unresolved_rule = {"matches": [{"path": {"type": "Exact", "value": UNRESOLVED_PATH}}],
                           "backendRefs": [{"name": "no-such-service", "port": 80}]}
        before = probe.get(UNRESOLVED_PATH)
        assert before.status_code == 404 and "x-kvgate-endpoint" in before.headers  # the engine's 404

        # 1. A route-only change.
        began, written = update_route(sample_rules + [unresolved_rule])
        times["rule added (route table only)"] = propagation_s(
            began, lambda: probe.get(UNRESOLVED_PATH).text == "backend not resolved\n", written,
            what="the added rule")

        # 2. A new pool (the same pods, the same EPP) and a rule to it, in one update.
        pool_b = copy.deepcopy(samples["InferencePool"])
        pool_b["metadata"] = {"name": "demo-pool-b", "namespace": ns}
        client.apply(pool_b)
        pool_b_cluster = f"cluster.pool-{ns}-demo-pool-b.upstream_rq_total"
        time.sleep(2)  # the pool alone changes nothing Envoy serves: no route uses it yet
        assert stat(pool_b_cluster) == 0
        tokenize_rule = {"matches": [{"path": {"type": "PathPrefix", "value": "/tokenize"}}],
                         "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                          "name": "demo-pool-b"}]}
        began, written = update_route(sample_rules + [unresolved_rule, tokenize_rule])

        def served_by_pool_b() -> bool:
            r = probe.post("/tokenize", json={"model": "demo", "prompt": "Hello"})
            return r.status_code == 200 and stat(pool_b_cluster) > 0
        times["pool and rule added at once (clusters and route table)"] = propagation_s(
            began, served_by_pool_b, written, what="the new pool's rule")
        assert "x-kvgate-endpoint" in probe.post("/tokenize", json={"model": "demo", "prompt": "Hi"}).headers

        # 3. Back to the sample's route: the rules and the second pool's clusters go.
        began, written = update_route(sample_rules)
        times["rules removed"] = propagation_s(
            began, lambda: "x-kvgate-endpoint" in probe.get(UNRESOLVED_PATH).headers, written, what="the removal")
        client.delete(pool_res, "demo-pool-b", ns)

        time.sleep(0.5)
        stop_load.set()
        loader.join(timeout=40)
        probe.close()

        (after,) = pods(ENVOY_SELECTOR)
        assert (after["metadata"]["uid"], after["metadata"]["name"]) == (uid, name), "the Envoy pod was replaced"
        assert after["status"]["containerStatuses"][0]["restartCount"] == restarts, "Envoy restarted"
        assert client.get(DEPLOYMENT, "inference-gateway-envoy", ns)["spec"]["template"] == template
        rejected = {n: stat(n) for n in ("cluster_manager.cds.update_rejected",
                                         "http.gateway_8080.rds.gateway-8080.update_rejected")}
        assert rejected == dict.fromkeys(rejected, 0), rejected
        assert stat("http.gateway_8080.rds.gateway-8080.update_success") >= 4  # initial + 3 changes
        failed = [o for o in outcomes if o[0] != 200]
        assert outcomes and not failed, failed[:10]
        print(f"\n[envoy-propagation-e2e] Envoy pod {name} (uid {uid}) kept, restartCount {restarts}; "
              f"{len(outcomes)} keep-alive completions during the changes, none failed; "
              + "; ".join(f"{what}: served after {s:.2f}s (ConfigMap written after {w:.2f}s)"
                          for what, (s, w) in times.items()), flush=True)
        assert operator.poll() is None, "the operator exited"
    except BaseException:
        print_log_tail(log_path)
        raise
    finally:
        stop_load.set()
        stop_operator(operator)
        client.delete(gc_res, class_name)
        client.delete(CORE["Namespace"], ns)
