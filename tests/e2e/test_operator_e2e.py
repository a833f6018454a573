"""`kvgate operator` against the rig: crds/samples/ become engine pods, an EPP and an Envoy that serve a
completion; scaling the ModelServer grows the EPP's endpoints; the EPP's NetworkPolicy admits the Gateway's
Envoy pods; a pool's own EndpointPickerConfig rolls the EPP, an invalid one is a status condition while the EPP
keeps its last good config; deleting the resources garbage-collects everything the operator made.

The operator runs as a local process with the rig's kubeconfig and `--epp-address-mode pod-ip` (the rig has
no kube-proxy, so Envoy must reach the EPP by its pod IP rather than its Service name).
"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter

import httpx
import pytest
from k8srig.kube import CORE, DEPLOYMENT, ApiError, wait_default_service_account, wait_for
from operator_run import (TUNED_EPP_CONFIG, condition_status, is_ready, pod_story, print_log_tail,
                          sample_namespace, start_operator, stop_operator)

pytestmark = pytest.mark.e2e
MANAGED = "app.kubernetes.io/managed-by=kvgate-operator"
DIGEST = "kvgate.dev/config-digest"


def test_operator_runs_the_samples(k8s, tmp_path):
    client = k8s.client
    t0 = time.monotonic()
    timings: dict[str, float] = {}

    def mark(what: str) -> None:
        timings[what] = time.monotonic() - t0
        print(f"[operator-e2e] {timings[what]:6.1f}s {what}", flush=True)

    ns, class_name, docs = sample_namespace(k8s, "e2e-operator")
    mark("CRDs installed, namespace created")
    ms_res = client.resource_for("kvgate.dev/v1alpha1", "ModelServer", wait_s=30)
    pool_res = client.resource_for("inference.networking.k8s.io/v1", "InferencePool", wait_s=30)
    gw_res = client.resource_for("gateway.networking.k8s.io/v1", "Gateway", wait_s=30)
    route_res = client.resource_for("gateway.networking.k8s.io/v1", "HTTPRoute", wait_s=30)
    gc_res = client.resource_for("gateway.networking.k8s.io/v1", "GatewayClass", wait_s=30)
    netpol_res = client.resource_for("networking.k8s.io/v1", "NetworkPolicy")
    made = [DEPLOYMENT, CORE["Service"], CORE["ConfigMap"], CORE["ServiceAccount"],
            client.resource_for("rbac.authorization.k8s.io/v1", "Role"),
            client.resource_for("rbac.authorization.k8s.io/v1", "RoleBinding"), netpol_res]

    log_path = tmp_path / "operator.log"
    operator = None
    try:
        wait_default_service_account(client, ns, token=True)
        operator = start_operator(k8s.kubeconfig, log_path)
        for kind in ("GatewayClass", "InferencePool", "ModelServer", "InferenceObjective", "InferenceModelRewrite",
                     "Gateway", "HTTPRoute"):
            client.apply(docs[kind])
        mark("operator started, samples applied")

        def pods(selector: str) -> list[dict]:
            return client.list(CORE["Pod"], ns, labelSelector=selector)["items"]

        def ready_ips(selector: str) -> set[str]:
            return {p["status"]["podIP"] for p in pods(selector) if is_ready(p)}

        def deployment_ready(name: str) -> bool:
            dep = client.get_or_none(DEPLOYMENT, name, ns)
            return bool(dep) and (dep.get("status") or {}).get("readyReplicas", 0) >= 1

        wait_for(lambda: len(ready_ips("app=demo-llm")) == 2, timeout_s=90, what="2 engine pods Ready")
        mark("engine pods Ready")
        wait_for(lambda: deployment_ready("demo-pool-epp"), timeout_s=60, what="the EPP Deployment Ready")
        mark("EPP Deployment Ready")
        wait_for(lambda: deployment_ready("inference-gateway-envoy"), timeout_s=60,
                 what="the Envoy Deployment Ready")
        mark("Envoy Deployment Ready")

        envoy_selector = "app.kubernetes.io/name=kvgate-gateway,app.kubernetes.io/instance=inference-gateway"
        served: list[str] = []
        last = [""]

        def completion_served() -> bool:
            # The Envoy config follows the EPP pod's IP: the first Envoy pod may roll once while it settles.
            for ip in ready_ips(envoy_selector):
                try:
                    r = httpx.post(f"http://{ip}:8080/v1/completions", timeout=10,
                                   json={"model": "demo", "prompt": "Hello", "max_tokens": 4})
                except httpx.HTTPError as exc:
                    last[0] = repr(exc)
                    continue
                last[0] = f"{ip}: {r.status_code} {r.text[:200]}"
                if r.status_code == 200 and "x-kvgate-endpoint" in r.headers:
                    served.append(r.headers["x-kvgate-endpoint"])
                    return True
            return False

        try:
            wait_for(completion_served, timeout_s=60, interval_s=1, what="a completion served through Envoy")
        except Exception as exc:  # say what the last attempt got, which the wait's own message cannot know
            raise AssertionError(f"{exc}; last attempt: {last[0]}") from exc
        mark("completion served through Envoy")
        engine_ips = ready_ips("app=demo-llm")
        assert served[-1].rsplit(":", 1)[0] in engine_ips, (served, engine_ips)

        def pool_parent_ok() -> bool:
            pool = client.get(pool_res, "demo-pool", ns)
            parents = (pool.get("status") or {}).get("parents") or []
            entry = next((p for p in parents if p["parentRef"]["name"] == "inference-gateway"), None)
            return bool(entry) and all(condition_status(entry["conditions"], t) == "True"
                                       for t in ("Accepted", "ResolvedRefs"))
        wait_for(pool_parent_ok, timeout_s=30, what="InferencePool status Accepted and ResolvedRefs for the Gateway")
        route = client.get(route_res, "demo-route", ns)
        assert condition_status(route["status"]["parents"][0]["conditions"], "Accepted") == "True"
        assert condition_status(client.get(gc_res, class_name)["status"]["conditions"], "Accepted") == "True"
        wait_for(lambda: condition_status((client.get(gw_res, "inference-gateway", ns).get("status") or {})
                                          .get("conditions"), "Programmed") == "True",
                 timeout_s=30, what="Gateway Programmed")
        wait_for(lambda: condition_status((client.get(ms_res, "demo-llm", ns).get("status") or {})
                                          .get("conditions"), "Ready") == "True",
                 timeout_s=30, what="ModelServer Ready")
        mark("statuses: pool, route, class, gateway, modelserver")

        # The EPP's NetworkPolicy: its pods, ext-proc and health from the Gateway's Envoy pods only, no metrics
        # peer (the operator ran without --epp-metrics-from). The rig enforces it (the completion above went Envoy →
        # EPP → engine under it); test_network_policy_e2e.py shows what it refuses.
        policy = client.get(netpol_res, "demo-pool-epp", ns)
        assert policy["spec"]["podSelector"] == {"matchLabels": {"app.kubernetes.io/instance": "demo-pool",
                                                                 "app.kubernetes.io/name": "kvgate-epp"}}
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        assert policy["spec"]["ingress"] == [{
            "from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": "inference-gateway",
                                                      "app.kubernetes.io/name": "kvgate-gateway"}}}],
            "ports": [{"protocol": "TCP", "port": 9002}, {"protocol": "TCP", "port": 9003}]}]
        assert policy["metadata"]["ownerReferences"][0]["kind"] == "InferencePool"

        # Scale as `kubectl scale modelserver demo-llm --replicas 4` does: through the scale subresource.
        epp_ip = next(iter(ready_ips("app.kubernetes.io/name=kvgate-epp,app.kubernetes.io/instance=demo-pool")))

        def epp_endpoints() -> set[str]:
            """The endpoints the EPP has fresh metrics for (what it routes to)."""
            try:
                text = httpx.get(f"http://{epp_ip}:9090/metrics", timeout=2).text
            except httpx.HTTPError:
                return set()
            return set(re.findall(r'kvgate_epp_endpoint_stale\{endpoint="([^"]+)"\} 0\.0', text))

        def epp_follows_pods(n: int) -> bool:
            eps = epp_endpoints()
            return len(eps) == n and {e.rsplit(":", 1)[0] for e in eps} == ready_ips("app=demo-llm")

        scaled_at = time.monotonic()
        client.patch(ms_res, "demo-llm", {"spec": {"replicas": 4}}, ns, sub="scale")
        seen: dict[str, float] = {}

        def scaled_up() -> bool:
            now = time.monotonic() - scaled_at
            if len(pods("app=demo-llm")) == 4:
                seen.setdefault("pods created", now)
            if len(ready_ips("app=demo-llm")) == 4:
                seen.setdefault("pods Ready", now)
            return epp_follows_pods(4)
        wait_for(scaled_up, timeout_s=90, interval_s=0.2, what="the EPP to route to 4 endpoints")
        scale_up_s = time.monotonic() - scaled_at
        ready_s = seen.get("pods Ready", scale_up_s)
        mark(f"EPP routes to 4 endpoints {scale_up_s:.1f}s after scaling (pods created at "
             f"{seen.get('pods created', 0):.1f}s, Ready at {ready_s:.1f}s: the EPP followed {scale_up_s - ready_s:.1f}s "
             f"after readiness)")
        assert scale_up_s - ready_s <= 5.0, "the EPP took more than 5 s to route to pods that became Ready"
        wait_for(lambda: (client.get(ms_res, "demo-llm", ns).get("status") or {}).get("readyReplicas") == 4,
                 timeout_s=30, what="ModelServer status readyReplicas 4")

        # Scale down under load: requests keep flowing through Envoy while two pods go; none may fail.
        envoy_ip = next(iter(ready_ips(envoy_selector)))
        outcomes: list[tuple[int | str, str]] = []
        stop_load = threading.Event()

        def load() -> None:
            with httpx.Client(timeout=30) as http:
                while not stop_load.is_set():
                    try:
                        r = http.post(f"http://{envoy_ip}:8080/v1/completions",
                                      json={"model": "demo", "prompt": "drain", "max_tokens": 16})
                        outcomes.append((r.status_code, r.headers.get("x-kvgate-endpoint", r.text[:120])))
                    except httpx.HTTPError as exc:
                        outcomes.append((type(exc).__name__, str(exc)[:120]))

        before = ready_ips("app=demo-llm")
        workers = [threading.Thread(target=load, daemon=True) for _ in range(4)]
        for w in workers:
            w.start()
        time.sleep(1.0)
        scaled_at = time.monotonic()
        client.patch(ms_res, "demo-llm", {"spec": {"replicas": 2}}, ns, sub="scale")
        wait_for(lambda: epp_follows_pods(2) and len(pods("app=demo-llm")) == 2, timeout_s=90, interval_s=0.2,
                 what="scale-down to 2 pods, followed by the EPP")
        scale_down_s = time.monotonic() - scaled_at
        time.sleep(1.0)
        stop_load.set()
        for w in workers:
            w.join(timeout=40)
        removed = before - ready_ips("app=demo-llm")
        failed = [o for o in outcomes if o[0] != 200]
        served_by_removed = sum(1 for code, who in outcomes if code == 200 and who.rsplit(":", 1)[0] in removed)
        mark(f"scaled 4 -> 2 under load in {scale_down_s:.1f}s: {len(outcomes)} requests, {len(failed)} failed, "
             f"{served_by_removed} served by the removed pods while they drained")
        assert outcomes and not failed, failed[:10]

        # Bad input the schema cannot catch becomes a status condition, and the operator keeps serving the rest.
        client.create(ms_res, {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelServer",
                               "metadata": {"name": "orphan", "namespace": ns},
                               "spec": {"poolRef": {"name": "no-such-pool"}, "replicas": 1,
                                        "model": {"servedModelName": "demo"}, "engine": {"backend": "sim"}}}, ns)

        def orphan_condition() -> dict | None:
            conds = (client.get(ms_res, "orphan", ns).get("status") or {}).get("conditions") or []
            return next((c for c in conds if c["type"] == "PoolFound"), None)
        wait_for(lambda: (orphan_condition() or {}).get("status") == "False", timeout_s=30,
                 what="the orphan ModelServer's PoolFound=False condition")
        assert orphan_condition()["reason"] == "PoolNotFound"
        assert not client.list(DEPLOYMENT, ns, labelSelector="app.kubernetes.io/instance=orphan")["items"]
        served.clear()
        wait_for(completion_served, timeout_s=30, interval_s=1, what="a completion still served through Envoy")
        client.delete(ms_res, "orphan", ns)

        # Wrong fields the schema can state are refused by the API server itself, with the field named ...
        for bad, field in (({"replicas": -1}, "spec.replicas"), ({"engine": {"blockSize": 7}}, "spec.engine.blockSize"),
                           ({"engine": {"backend": "gpu"}}, "spec.engine.backend")):
            spec = {"poolRef": {"name": "demo-pool"}, "replicas": 1, "engine": {"backend": "sim"}}
            spec.update(bad)
            with pytest.raises(ApiError) as refused:
                client.create(ms_res, {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelServer",
                                       "metadata": {"name": "bad-fields", "namespace": ns}, "spec": spec}, ns)
            assert refused.value.status == 422 and field in str(refused.value), str(refused.value)
        # ... and what only the operator can judge becomes a Ready=False condition with the reason.
        client.create(ms_res, {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelServer",
                               "metadata": {"name": "two-sources", "namespace": ns},
                               "spec": {"poolRef": {"name": "demo-pool"}, "replicas": 1, "engine": {"backend": "sim"},
                                        "model": {"path": "/models/m", "pvc": {"claimName": "m"},
                                                  "hostPath": {"path": "/models"}}}}, ns)

        def ready_condition(name: str) -> dict:
            conds = (client.get(ms_res, name, ns).get("status") or {}).get("conditions") or []
            return next((c for c in conds if c["type"] == "Ready"), {})
        wait_for(lambda: ready_condition("two-sources").get("reason") == "InvalidSpec", timeout_s=30,
                 what="the two-sources ModelServer's Ready=False InvalidSpec condition")
        assert ready_condition("two-sources")["status"] == "False"
        assert "volume source" in ready_condition("two-sources")["message"]
        served.clear()
        wait_for(completion_served, timeout_s=30, interval_s=1, what="a completion still served through Envoy")
        client.delete(ms_res, "two-sources", ns)
        mark("invalid ModelServer reported by a condition; the pool still serves")

        # The pool's own EndpointPickerConfig: a labelled ConfigMap named by kvgate.dev/epp-config rolls the EPP.
        def epp_digest() -> str:
            return client.get(DEPLOYMENT, "demo-pool-epp", ns)["spec"]["template"]["metadata"]["annotations"][DIGEST]

        def epp_entry() -> dict:
            parents = (client.get(pool_res, "demo-pool", ns).get("status") or {}).get("parents") or []
            entry = next((p for p in parents if p["controllerName"] == "kvgate.dev/endpoint-picker"), {})
            return next((c for c in entry.get("conditions") or [] if c["type"] == "Accepted"), {})

        default_digest = epp_digest()
        wait_for(lambda: epp_entry().get("status") == "True", timeout_s=30,
                 what="the pool's EPP entry Accepted=True (the default config)")
        tuned_yaml = TUNED_EPP_CONFIG
        client.create(CORE["ConfigMap"], {"apiVersion": "v1", "kind": "ConfigMap",
                                          "metadata": {"name": "tuned", "namespace": ns,
                                                       "labels": {"kvgate.dev/epp-config": "true"}},
                                          "data": {"epp.yaml": tuned_yaml}}, ns)
        client.patch(pool_res, "demo-pool", {"metadata": {"annotations": {"kvgate.dev/epp-config": "tuned"}}}, ns)
        wait_for(lambda: epp_digest() != default_digest, timeout_s=30, what="the EPP's pods to roll to the new config")
        wait_for(lambda: "ConfigMap 'tuned'" in epp_entry().get("message", "") and epp_entry()["status"] == "True",
                 timeout_s=30, what="the pool's EPP entry to report the ConfigMap's config")
        def epp_rolled() -> bool:  # the new pod Ready and the old one gone
            dep = client.get(DEPLOYMENT, "demo-pool-epp", ns)
            st = dep.get("status") or {}
            return (st.get("observedGeneration") == dep["metadata"]["generation"]
                    and st.get("updatedReplicas") == st.get("replicas") == st.get("readyReplicas") == 1)
        try:
            wait_for(epp_rolled, timeout_s=60, what="the rolled EPP Ready, the old pod gone")
        except TimeoutError:
            print(pod_story(k8s, ns, "app.kubernetes.io/name=kvgate-epp,app.kubernetes.io/instance=demo-pool"))
            raise
        tuned_digest = epp_digest()
        served.clear()
        wait_for(completion_served, timeout_s=60, interval_s=1, what="a completion served by the rolled EPP")
        # An invalid config is a condition; the EPP keeps the last good one (no roll, still serving).
        client.patch(CORE["ConfigMap"], "tuned", {"data": {"epp.yaml": tuned_yaml.replace("queue-scorer", "nope")}}, ns)
        wait_for(lambda: epp_entry().get("reason") == "InvalidConfig", timeout_s=30,
                 what="the pool's EPP entry Accepted=False InvalidConfig")
        assert "nope" in epp_entry()["message"] and "last good config" in epp_entry()["message"], epp_entry()
        assert epp_digest() == tuned_digest
        served.clear()
        wait_for(completion_served, timeout_s=30, interval_s=1, what="a completion still served")
        mark("per-pool EndpointPickerConfig rolled out; an invalid one reported, the last good one kept")

        # Delete the pool while requests flow through the Gateway's address (its Service's cluster IP): every
        # request gets an answer — served, then the Gateway API's 500 for a route whose backend is gone — and
        # none hangs or breaks its connection; the same Envoy pod answers throughout (no restart).
        gateway = client.get(gw_res, "inference-gateway", ns)
        address = f"{gateway['status']['addresses'][0]['value']}:8080"
        envoy_pods = {p["metadata"]["uid"] for p in pods(envoy_selector)}
        answers: list[int | str] = []
        stop_load.clear()

        def pool_load() -> None:
            with httpx.Client(timeout=30) as http:
                while not stop_load.is_set():
                    try:
                        r = http.post(f"http://{address}/v1/completions",
                                      json={"model": "demo", "prompt": "bye", "max_tokens": 4})
                        answers.append(r.status_code)
                    except httpx.HTTPError as exc:
                        answers.append(type(exc).__name__)
                    time.sleep(0.02)

        workers = [threading.Thread(target=pool_load, daemon=True) for _ in range(2)]
        for w in workers:
            w.start()
        wait_for(lambda: answers.count(200) >= 5, timeout_s=30, what="requests served through the Gateway address")
        deleted_at = time.monotonic()
        client.delete(pool_res, "demo-pool", ns)
        wait_for(lambda: answers[-5:] == [500] * 5, timeout_s=60, interval_s=0.1,
                 what="the route to answer 500 once its pool is gone")
        stop_routing_s = time.monotonic() - deleted_at
        stop_load.set()
        for w in workers:
            w.join(timeout=40)
        mark(f"pool deleted under load: routing stopped after {stop_routing_s:.1f}s; answers "
             f"{dict(Counter(answers))}")
        assert set(answers) <= {200, 500}, Counter(answers)
        assert {p["metadata"]["uid"] for p in pods(envoy_selector)} == envoy_pods, "Envoy was restarted"

        # Delete the user's objects: the garbage collector removes everything the operator made.
        for res, name in ((gw_res, "inference-gateway"), (ms_res, "demo-llm")):
            client.delete(res, name, ns)

        def leftovers() -> list[str]:
            out = [f"{r.kind}/{o['metadata']['name']}" for r in made
                   for o in client.list(r, ns, labelSelector=MANAGED)["items"]]
            return out + [f"Pod/{p['metadata']['name']}" for p in client.list(CORE["Pod"], ns)["items"]]

        wait_for(lambda: not leftovers(), timeout_s=90, interval_s=1,
                 what="the garbage collector to remove the operator's objects")
        mark("everything the operator made is gone")
        assert operator.poll() is None, "the operator exited"
    except BaseException:
        print_log_tail(log_path)
        raise
    finally:
        stop_operator(operator)
        client.delete(gc_res, class_name)
        client.delete(CORE["Namespace"], ns)
    print(f"[operator-e2e] operator log: {log_path}; timings: "
          + ", ".join(f"{k} {v:.1f}s" for k, v in timings.items()))
