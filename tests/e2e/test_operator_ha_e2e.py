"""Two `kvgate operator --leader-election enabled` replicas against the rig: the leader is SIGKILLed right after a
new pool and its ModelServer are applied, while its reconcile is in flight; the standby takes the Lease within
lease duration + retry period, finishes that reconcile, and nothing is made twice or left without its owner; the
Gateway, whose Envoy and EPP pods do not depend on the operator, answers every request meanwhile.

Opt-in (about 2 minutes on the 2-core sandbox, beyond the e2e tier's budget): KVGATE_E2E_OPERATOR_HA=1.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time

import httpx
import pytest
from k8srig.kube import CORE, DEPLOYMENT, wait_default_service_account, wait_for
from operator_ha import MANAGED, LEASE_S, RETRY_S, leader_election_flags, leader_gauge, made_objects
from operator_run import (is_ready, pod_story, print_log_tail, sample_namespace, start_operator,
                          stop_operator)
from test_epp_kubernetes import free_ports

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.environ.get("KVGATE_E2E_OPERATOR_HA") != "1",
                                                   reason="opt-in: KVGATE_E2E_OPERATOR_HA=1 (about 2 minutes)")]


def test_the_standby_finishes_what_a_killed_leader_began(k8s, tmp_path):
    client = k8s.client
    ns, _, docs = sample_namespace(k8s, "e2e-opha")
    wait_default_service_account(client, ns, token=True)
    ports = free_ports(2)
    logs = [tmp_path / "operator-a.log", tmp_path / "operator-b.log"]
    flags = leader_election_flags(ns)
    operators = []
    stop_load = threading.Event()
    outcomes: list[str] = []
    try:
        operators.append(start_operator(k8s.kubeconfig, logs[0], *flags, "--metrics-port", str(ports[0])))
        wait_for(lambda: leader_gauge(ports[0]) == 1, timeout_s=60, what="operator a leading")
        operators.append(start_operator(k8s.kubeconfig, logs[1], *flags, "--metrics-port", str(ports[1])))
        wait_for(lambda: leader_gauge(ports[1]) == 0, timeout_s=60, what="operator b standing by")
        for kind in ("GatewayClass", "InferencePool", "ModelServer", "Gateway", "HTTPRoute"):
            client.apply(docs[kind])

        def ready_ips(selector: str) -> list[str]:
            return sorted(p["status"]["podIP"] for p in client.list(CORE["Pod"], ns, labelSelector=selector)["items"]
                          if is_ready(p))

        envoy = "app.kubernetes.io/name=kvgate-gateway,app.kubernetes.io/instance=inference-gateway"

        def completion(ip: str) -> str:
            try:
                r = httpx.post(f"http://{ip}:8080/v1/completions", timeout=10,
                               json={"model": "demo", "prompt": "Hello", "max_tokens": 2})
            except httpx.HTTPError as exc:
                return type(exc).__name__
            return str(r.status_code)

        wait_for(lambda: any(completion(ip) == "200" for ip in ready_ips(envoy)), timeout_s=150, interval_s=1,
                 what="a completion through the Gateway")
        assert leader_gauge(ports[1]) == 0  # the standby wrote nothing meanwhile: it never led
        (envoy_ip,) = ready_ips(envoy)[:1]

        def load() -> None:
            while not stop_load.is_set():
                outcomes.append(completion(envoy_ip))
                stop_load.wait(0.05)
        loader = threading.Thread(target=load, daemon=True)
        loader.start()

        # A second pool and its ModelServer; the leader dies right after, in the middle of reconciling them.
        ms, pool = copy.deepcopy(docs["ModelServer"]), copy.deepcopy(docs["InferencePool"])
        ms["metadata"]["name"], ms["spec"]["poolRef"]["name"], ms["spec"]["replicas"] = "second-llm", "second", 1
        pool["metadata"]["name"] = "second"
        pool["spec"]["selector"]["matchLabels"] = {"app": "second-llm"}
        pool["spec"]["endpointPickerRef"]["name"] = "second-epp"
        client.apply(pool)
        client.apply(ms)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not client.list(CORE["ServiceAccount"], ns,
                                                            labelSelector="app.kubernetes.io/instance=second")["items"]:
            time.sleep(0.01)  # its first objects appear: the reconcile is under way
        os.killpg(operators[0].pid, signal.SIGKILL)
        killed = time.monotonic()
        at_kill = {kind: [o["metadata"]["name"] for o in client.list(res, ns, labelSelector=MANAGED)["items"]
                          if "second" in o["metadata"]["name"]]
                   for kind, res in (("Deployment", DEPLOYMENT), ("ServiceAccount", CORE["ServiceAccount"]),
                                     ("Service", CORE["Service"]))}
        print(f"[operator-ha] second pool's objects when the leader was killed: {at_kill}", flush=True)

        wait_for(lambda: leader_gauge(ports[1]) == 1, timeout_s=LEASE_S + RETRY_S + 20, interval_s=0.1,
                 what="operator b leading")
        took = time.monotonic() - killed
        print(f"[operator-ha] the standby led {took:.1f} s after the kill (lease {LEASE_S} s, retry {RETRY_S} s)",
              flush=True)
        assert took < LEASE_S + RETRY_S + 10  # the bound, and slack for a loaded 2-core machine

        def deployment_ready(name: str) -> bool:
            dep = client.get_or_none(DEPLOYMENT, name, ns)
            return bool(dep) and (dep.get("status") or {}).get("readyReplicas", 0) >= 1
        wait_for(lambda: deployment_ready("second-epp") and deployment_ready("second-llm"), timeout_s=120,
                 what="the second pool's EPP and engine Deployments Ready (the standby's reconcile)")
        time.sleep(2)
        stop_load.set()
        loader.join(timeout=15)

        # Nothing twice, nothing orphaned: every object of the operator is owned by a live owner, each once.
        made = made_objects(client, docs, ns)
        assert sorted(made["Deployment"]) == ["demo-llm", "demo-pool-epp", "inference-gateway-envoy", "second-epp",
                                              "second-llm"], made
        epp_pods = client.list(CORE["Pod"], ns, labelSelector="app.kubernetes.io/instance=second,"
                                                              "app.kubernetes.io/name=kvgate-epp")["items"]
        assert len([p for p in epp_pods if not p["metadata"].get("deletionTimestamp")]) == 1
        failed = [o for o in outcomes if o != "200"]
        print(f"[operator-ha] {len(outcomes)} requests through the Gateway during the failover, "
              f"{len(failed)} failed", flush=True)
        assert outcomes and not failed, failed[:10]
    except BaseException:
        for log in logs:
            print_log_tail(log, what=log.name)
        print(pod_story(k8s, ns, "app.kubernetes.io/managed-by=kvgate-operator"))
        raise
    finally:
        stop_load.set()
        for proc in operators:
            stop_operator(proc)
