"""Active-active EPPs deployed by the operator on the rig (a pool's kvgate.dev/epp-replicas: "2" and
kvgate.dev/epp-mode: active-active): both EPP replicas serve the Gateway's requests, each finds the other by its
pod watch and applies the other's picks over the keyed sync port (the key in the Secret the operator made), and
the pool's NetworkPolicy refuses the sync port to a pod of the same namespace that is not one of the pool's EPPs
while the node (this test) reaches it.

Opt-in (about 2 minutes on the 2-core sandbox, beyond the e2e tier's budget): KVGATE_E2E_OPERATOR_HA=1.
"""

from __future__ import annotations

import os
import re
import socket

import httpx
import pytest
from k8srig.kube import CORE, wait_default_service_account, wait_for
from operator_run import is_ready, pod_story, print_log_tail, sample_namespace, start_operator, stop_operator
from test_network_policy_e2e import _probe_pod, _probe_result

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.environ.get("KVGATE_E2E_OPERATOR_HA") != "1",
                                                   reason="opt-in: KVGATE_E2E_OPERATOR_HA=1 (about 2 minutes)")]
SYNC_PORT = 9004
EPP = "app.kubernetes.io/name=kvgate-epp,app.kubernetes.io/instance=demo-pool"


def epp_metrics(ip: str) -> dict[str, float]:
    text = httpx.get(f"http://{ip}:9090/metrics", timeout=5).text
    out = {f"sync_{m[0]}": float(m[1]) for m in re.findall(r'kvgate_epp_peer_sync_total\{event="([^"]+)"\} (\S+)',
                                                            text)}
    found = re.search(r"^kvgate_epp_peer_sync_peers (\S+)$", text, re.M)
    out["peers"] = float(found.group(1)) if found else -1.0
    routed = re.search(r'^kvgate_epp_requests_total\{code="200"\} (\S+)$', text, re.M)
    out["routed"] = float(routed.group(1)) if routed else 0.0
    return out


def test_active_active_epps_both_serve_sync_and_keep_the_sync_port_to_themselves(k8s, tmp_path):
    if getattr(k8s, "network_policy", "") != "enforced":
        pytest.skip(f"the rig does not enforce NetworkPolicy here: {getattr(k8s, 'network_policy', 'unknown')}")
    client = k8s.client
    ns, _, docs = sample_namespace(k8s, "e2e-epp-aa")
    wait_default_service_account(client, ns, token=True)
    log_path = tmp_path / "operator.log"
    operator = None
    try:
        operator = start_operator(k8s.kubeconfig, log_path, "--epp-high-availability", "enabled")
        docs["InferencePool"]["metadata"]["annotations"] = {"kvgate.dev/epp-replicas": "2",
                                                            "kvgate.dev/epp-mode": "active-active"}
        for kind in ("GatewayClass", "InferencePool", "ModelServer", "Gateway", "HTTPRoute"):
            client.apply(docs[kind])

        def ready_ips(selector: str) -> list[str]:
            return sorted(p["status"]["podIP"] for p in client.list(CORE["Pod"], ns, labelSelector=selector)["items"]
                          if is_ready(p))

        wait_for(lambda: len(ready_ips(EPP)) == 2, timeout_s=150, what="two EPP pods Ready")
        epps = ready_ips(EPP)
        wait_for(lambda: all(epp_metrics(ip)["peers"] == 1 for ip in epps), timeout_s=60,
                 what="each EPP hearing the other (pod watch, keyed sync)")
        secret = client.get(CORE["Secret"], "demo-pool-epp-peer-sync", ns)
        assert secret["metadata"]["ownerReferences"][0]["kind"] == "InferencePool"

        envoy = "app.kubernetes.io/name=kvgate-gateway,app.kubernetes.io/instance=inference-gateway"
        codes: list[int] = []

        def served(n: int) -> bool:
            for ip in ready_ips(envoy)[:1]:
                for i in range(n):
                    try:
                        r = httpx.post(f"http://{ip}:8080/v1/completions", timeout=10,
                                       json={"model": "demo", "prompt": f"tenant {i % 4}: hello", "max_tokens": 2})
                    except httpx.HTTPError:
                        return False
                    codes.append(r.status_code)
                return True
            return False

        # Envoy's config names both EPP pods once both are Ready (pod-ip mode): its streams spread over them.
        wait_for(lambda: served(1) and codes[-1] == 200, timeout_s=120, interval_s=1,
                 what="a completion through the Gateway")
        wait_for(lambda: served(20) and all(epp_metrics(ip)["routed"] > 0 for ip in epps), timeout_s=120,
                 interval_s=1, what="both EPPs routing the Gateway's requests")
        before = len(codes)
        assert served(20) and codes[before:] == [200] * 20
        for ip in epps:
            m = epp_metrics(ip)
            print(f"[epp-aa] EPP {ip}: routed {m['routed']:.0f}, picks sent {m.get('sync_picks_sent', 0):.0f}, "
                  f"peer picks applied {m.get('sync_picks_applied', 0):.0f}, failed handshakes "
                  f"{m.get('sync_handshakes_failed', 0):.0f}", flush=True)
            assert m.get("sync_picks_applied", 0) > 0  # the other's picks reached it, through the pool's key

        policy = client.get(client.resource_for("networking.k8s.io/v1", "NetworkPolicy"), "demo-pool-epp", ns)
        sync_rules = [r for r in policy["spec"]["ingress"] if any(p["port"] == SYNC_PORT for p in r["ports"])]
        assert sync_rules == [{"from": [{"podSelector": {"matchLabels": policy["spec"]["podSelector"]["matchLabels"]}}],
                               "ports": [{"protocol": "TCP", "port": SYNC_PORT}]}]
        targets = [f"{ip}:{SYNC_PORT}" for ip in epps]
        for ip in epps:  # the node reaches the port: what the neighbour meets is the policy
            socket.create_connection((ip, SYNC_PORT), timeout=3).close()
        # Same namespace, even the EPP's app name: only the pool's EPPs' full labels are admitted.
        client.create(CORE["Pod"], _probe_pod("neighbour", ns, {"app.kubernetes.io/name": "kvgate-epp"}, targets))

        def finished() -> bool:
            phase = (client.get(CORE["Pod"], "neighbour", ns).get("status") or {}).get("phase")
            assert phase != "Failed", "the neighbour probe failed"
            return phase == "Succeeded"
        wait_for(finished, timeout_s=60, what="the neighbour probe done")
        result = _probe_result(k8s, ns, "neighbour")
        assert all(result[t] == "ConnectionRefusedError" for t in targets), result
        assert all(epp_metrics(ip)["peers"] == 1 for ip in epps)  # the EPPs still reach each other
    except BaseException:
        print_log_tail(log_path)
        print(pod_story(k8s, ns, EPP))
        raise
    finally:
        stop_operator(operator)
