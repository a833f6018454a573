"""The engines' NetworkPolicy, enforced on the rig: a pool whose ModelServer publishes KV events, made by
the operator; a pod in another namespace and a pod of the pool's own namespace that is not the EPP try the engine's
HTTP, KV-event PUB and replay ports and are refused, while the EPP, under the same rules, still receives every
event batch (no gap, no failed replay) and the node (this test) reaches everything.

The rig enforces NetworkPolicy ingress like a CNI's policy agent (k8srig/podnet.py: a cgroup per pod,
nftables); where it cannot (not root, no nftables or cgroup v2) this test skips with the reason.
"""
from __future__ import annotations

import json
import re
import socket
import textwrap

import httpx
import pytest
from k8srig import objects
from k8srig.kube import CORE, wait_default_service_account, wait_for
from operator_run import is_ready, print_log_tail, sample_namespace, start_operator, stop_operator

pytestmark = pytest.mark.e2e
KV_PORT, REPLAY_PORT, HTTP_PORT = 5557, 5558, 8000
ECHO_PORT = 3000

# What an intruder runs: open each address, say what happened. A refused TCP handshake is the policy (the
# node reaches the same ports, checked below); "open" would be a hole.
PROBE = textwrap.dedent("""
    import json, socket, sys
    out = {}
    for target in sys.argv[1:]:
        host, port = target.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=3).close()
            out[target] = "open"
        except OSError as e:
            out[target] = type(e).__name__
    print("PROBE " + json.dumps(out), flush=True)
""")


def _kv_event_counts(epp_ip: str) -> dict[str, float]:
    text = httpx.get(f"http://{epp_ip}:9090/metrics", timeout=5).text
    counts = {m[0]: float(m[1]) for m in re.findall(r'kvgate_epp_kv_events_total\{event="([^"]+)"\} (\S+)', text)}
    for name in ("kvgate_epp_kv_events_subscribed_endpoints", "kvgate_epp_precise_index_blocks"):
        found = re.search(rf"^{name} (\S+)$", text, re.M)
        counts[name] = float(found.group(1)) if found else 0.0
    return counts


def _probe_pod(name: str, namespace: str, labels: dict, targets: list[str]) -> dict:
    return objects.pod(name, namespace, [{"name": "probe", "image": "python:3.12-slim",
                                         "command": ["python", "-c", PROBE, *targets]}],
                       restart_policy="Never", labels=labels)


def _probe_result(k8s, namespace: str, name: str) -> dict[str, str]:
    pod = k8s.client.get(CORE["Pod"], name, namespace)
    folder = k8s.dir / "runner" / "pods" / f"{namespace}_{name}_{pod['metadata']['uid'][:8]}"
    text = (folder / "probe.log").read_text()
    line = next(ln for ln in text.splitlines() if ln.startswith("PROBE "))
    return json.loads(line[len("PROBE "):])


def test_engine_kv_event_ports_closed_to_all_but_the_epp(k8s, tmp_path):
    if getattr(k8s, "network_policy", "") != "enforced":
        pytest.skip(f"the rig does not enforce NetworkPolicy here: {getattr(k8s, 'network_policy', 'unknown')}")
    client = k8s.client
    ns, _, docs = sample_namespace(k8s, "e2e-netpol")
    other_ns = f"{ns}-other"
    client.create(CORE["Namespace"], objects.namespace(other_ns))
    ms = docs["ModelServer"]
    ms["spec"]["replicas"] = 1
    ms["spec"]["engine"]["kvEvents"] = {"port": KV_PORT, "replayPort": REPLAY_PORT}
    log_path = tmp_path / "operator.log"
    operator = None
    try:
        wait_default_service_account(client, ns, token=True)
        wait_default_service_account(client, other_ns, token=True)
        operator = start_operator(k8s.kubeconfig, log_path)
        client.apply(docs["InferencePool"])
        client.apply(ms)
        # A bystander in the other namespace that nothing isolates: the intruders' control (their packets go
        # out fine; only the engine's policy stops them).
        client.create(CORE["Pod"], objects.pod("bystander", other_ns, [objects.echo_container(ECHO_PORT)]))

        def ready_ips(namespace: str, selector: str) -> list[str]:
            return [p["status"]["podIP"] for p in client.list(CORE["Pod"], namespace, labelSelector=selector)["items"]
                    if is_ready(p)]

        epp_selector = "app.kubernetes.io/name=kvgate-epp,app.kubernetes.io/instance=demo-pool"
        wait_for(lambda: ready_ips(ns, "app=demo-llm"), timeout_s=90, what="the engine pod Ready")
        wait_for(lambda: ready_ips(ns, epp_selector), timeout_s=90, what="the EPP pod Ready")
        wait_for(lambda: ready_ips(other_ns, "app=bystander"), timeout_s=60, what="the bystander Ready")
        engine_ip, epp_ip = ready_ips(ns, "app=demo-llm")[0], ready_ips(ns, epp_selector)[0]
        bystander_ip = ready_ips(other_ns, "app=bystander")[0]
        wait_for(lambda: _kv_event_counts(epp_ip)["kvgate_epp_kv_events_subscribed_endpoints"] == 1,
                 timeout_s=60, what="the EPP subscribed to the engine's KV events")
        policy = client.get(client.resource_for("networking.k8s.io/v1", "NetworkPolicy"), "demo-pool-engines", ns)
        assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} >= {KV_PORT, REPLAY_PORT}

        # The node (this test) reaches every port: what the intruders meet below is the policy, not a closed port.
        for port in (HTTP_PORT, KV_PORT, REPLAY_PORT):
            socket.create_connection((engine_ip, port), timeout=3).close()

        def served(n: int) -> None:
            for i in range(n):
                r = httpx.post(f"http://{engine_ip}:{HTTP_PORT}/v1/completions", timeout=30,
                               json={"model": "demo", "prompt": f"tenant secret {i}: " + "lorem ipsum " * 40,
                                     "max_tokens": 4})
                assert r.status_code == 200, r.text

        served(4)
        wait_for(lambda: _kv_event_counts(epp_ip).get("batches", 0) > 0, timeout_s=30,
                 what="the EPP received the first event batches")
        before = _kv_event_counts(epp_ip)

        targets = [f"{engine_ip}:{p}" for p in (HTTP_PORT, KV_PORT, REPLAY_PORT)]
        client.create(CORE["Pod"], _probe_pod("intruder", other_ns, {"app": "intruder"},
                                              targets + [f"{bystander_ip}:{ECHO_PORT}"]))
        # Same namespace, and even the EPP's app name: only the EPP's full labels are admitted.
        client.create(CORE["Pod"], _probe_pod("neighbour", ns, {"app.kubernetes.io/name": "kvgate-epp"},
                                              targets + [f"{bystander_ip}:{ECHO_PORT}"]))
        served(8)                          # events flow while the intruders knock

        def finished(namespace: str, name: str) -> bool:
            phase = ((client.get(CORE["Pod"], name, namespace).get("status") or {}).get("phase"))
            assert phase != "Failed", f"{namespace}/{name} failed"
            return phase == "Succeeded"
        wait_for(lambda: finished(other_ns, "intruder") and finished(ns, "neighbour"), timeout_s=60,
                 what="the intruder pods done")
        for namespace, name in ((other_ns, "intruder"), (ns, "neighbour")):
            result = _probe_result(k8s, namespace, name)
            assert result[f"{bystander_ip}:{ECHO_PORT}"] == "open", (name, result)
            assert all(result[t] == "ConnectionRefusedError" for t in targets), (name, result)

        seen: list[float] = []

        def caught_up() -> bool:     # new batches arrived, and none for a second: every published one is in
            now = _kv_event_counts(epp_ip)
            seen.append(now.get("batches", 0))
            return seen[-1] > before.get("batches", 0) and len(seen) >= 5 and len(set(seen[-5:])) == 1
        wait_for(caught_up, timeout_s=30, interval_s=0.25, what="the EPP received the new batches")
        after = _kv_event_counts(epp_ip)
        for key in ("gaps", "replays_failed", "bad_payloads", "error", "reconnects"):
            assert after.get(key, 0) == before.get(key, 0), (key, before, after)
        assert after.get("blocks_stored", 0) > before.get("blocks_stored", 0), (before, after)
        print(f"[netpol-e2e] EPP kv events before {before} after {after}", flush=True)
    except BaseException:
        print_log_tail(log_path)
        raise
    finally:
        stop_operator(operator)
        for name in (ns, other_ns):
            try:
                client.delete(CORE["Namespace"], name)
            except Exception:  # noqa: BLE001 - best effort: the rig goes at the session's end anyway
                pass
