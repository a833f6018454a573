"""EPP leader failover under streaming load on the rig: the samples with their pool asking for
two EPP replicas (annotation kvgate.dev/epp-replicas), run by `kvgate operator --epp-high-availability enabled`
with its EPPs under their own ServiceAccount and Role (the Lease rules the operator grants: a 403 would show in
their logs), and requests streamed through the Gateway while the leading EPP pod is deleted.

The leader answers SERVING on the gRPC readiness Envoy health-checks, the follower NOT_SERVING; deleted, the
leader sleeps in preStop (still leading), then on SIGTERM releases the Lease and drains; the follower takes the
Lease at its next try and turns SERVING, and the Deployment's replacement pod comes up as the new follower.
Printed: requests sent / failed during the failover, and how long until the follower served.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from k8srig.kube import CORE, wait_default_service_account, wait_for
from operator_run import (Stages, gateway_serves, grpc_health, is_ready, print_log_tail, sample_namespace,
                          sample_resources, start_operator, stop_operator)

from kvgate.bench.chaos.load import StreamLoad, Tally
from kvgate.operator.naming import EPP_HEALTH_PORT
from kvgate.operator.pool import REPLICAS_ANNOTATION

pytestmark = pytest.mark.e2e
ENGINES = "app=demo-llm"
ENVOY = "app.kubernetes.io/name=kvgate-gateway,app.kubernetes.io/instance=inference-gateway"
EPP = "app.kubernetes.io/name=kvgate-epp,app.kubernetes.io/instance=demo-pool"
CONCURRENCY = 6
MAX_TOKENS = 32


def readiness(ip: str) -> str:
    return grpc_health(f"{ip}:{EPP_HEALTH_PORT}", "readiness")


def test_leader_failover_under_streaming_load(k8s, tmp_path):
    client = k8s.client
    mark = Stages("failover")
    ns, class_name, docs = sample_namespace(k8s, "e2e-failover")
    docs["InferencePool"]["metadata"].setdefault("annotations", {})[REPLICAS_ANNOTATION] = "2"
    res = sample_resources(client)
    gw_res, gc_res = res["Gateway"], res["GatewayClass"]
    log_path = tmp_path / "operator.log"
    operator = load = load_thread = None

    def pods(selector: str) -> list[dict]:
        return client.list(CORE["Pod"], ns, labelSelector=selector)["items"]

    def ready_ips(selector: str) -> set[str]:
        return {p["status"]["podIP"] for p in pods(selector) if is_ready(p)}

    def epp_states() -> dict[str, str]:
        return {ip: readiness(ip) for ip in ready_ips(EPP)}

    def epp_logs() -> list:
        return sorted((k8s.dir / "runner" / "pods").glob(f"{ns}_demo-pool-epp-*/*.log"))

    try:
        wait_default_service_account(client, ns, token=True)
        operator = start_operator(k8s.kubeconfig, log_path, "--epp-high-availability", "enabled")
        for kind in ("GatewayClass", "InferencePool", "ModelServer", "InferenceObjective", "InferenceModelRewrite",
                     "Gateway", "HTTPRoute"):
            client.apply(docs[kind])
        wait_for(lambda: len(ready_ips(ENGINES)) == 2 and len(ready_ips(EPP)) == 2 and len(ready_ips(ENVOY)) == 1,
                 timeout_s=120, interval_s=0.5, what="2 engine pods, 2 EPP pods and Envoy Ready")
        states = wait_for(lambda: (s := epp_states()) and sorted(s.values()) == ["NOT_SERVING", "SERVING"] and s,
                          timeout_s=60, what="one EPP leading (SERVING), the other following (NOT_SERVING)")
        leader_ip = next(ip for ip, s in states.items() if s == "SERVING")
        follower_ip = next(ip for ip, s in states.items() if s == "NOT_SERVING")
        gateway = wait_for(lambda: (g := client.get(gw_res, "inference-gateway", ns)).get("status", {})
                           .get("addresses") and g, timeout_s=30, what="the Gateway's address")
        url = f"http://{gateway['status']['addresses'][0]['value']}:8080"
        mark(f"leader {leader_ip}, follower {follower_ip}; Gateway at {url}")
        wait_for(lambda: gateway_serves(url), timeout_s=60, interval_s=0.5,  # the leader found ready by Envoy
                 what="a completion served through the Gateway's address")

        load = StreamLoad(url, "demo", concurrency=CONCURRENCY, max_tokens=MAX_TOKENS, timeout_s=60)
        load_thread = threading.Thread(target=lambda: asyncio.run(load.run()), name="stream-load", daemon=True)
        load_thread.start()
        wait_for(lambda: sum(o.ok(MAX_TOKENS) for o in load.outcomes) >= 20, timeout_s=60,
                 what="streams served through the leading EPP")

        leader_pod = next(p for p in pods(EPP) if p["status"].get("podIP") == leader_ip)
        began = time.monotonic()
        client.delete(CORE["Pod"], leader_pod["metadata"]["name"], ns)

        def new_leader() -> str | None:
            """The one EPP other than the deleted leader answering SERVING (the follower, or the Deployment's
            replacement once it can route: a replica still starting never takes the Lease)."""
            serving = [ip for ip in ready_ips(EPP) - {leader_ip} if readiness(ip) == "SERVING"]
            assert len(serving) <= 1, serving
            return serving[0] if serving else None
        successor = wait_for(new_leader, timeout_s=60, interval_s=0.05, what="another EPP to lead")
        took_over = time.monotonic()
        mark(f"{'the follower' if successor == follower_ip else 'the replacement'} {successor} SERVING "
             f"{took_over - began:.2f}s after the leader pod's deletion")
        wait_for(lambda: leader_ip not in {p["status"].get("podIP") for p in pods(EPP)}, timeout_s=90,
                 what="the old leader pod gone")
        wait_for(lambda: len(ready_ips(EPP)) == 2, timeout_s=90, what="two EPP pods Ready again")
        (other,) = ready_ips(EPP) - {successor}
        wait_for(lambda: readiness(other) == "NOT_SERVING", timeout_s=30, what="the other EPP to follow")
        ended = time.monotonic()
        mark(f"old leader gone, {other} following, {ended - began:.1f}s after the deletion")
        time.sleep(3.0)  # traffic through the new leader
        forbidden = [str(log) for log in epp_logs() if " 403" in log.read_text(errors="replace")]
    except BaseException:
        print_log_tail(log_path)
        for log in epp_logs():
            print_log_tail(log, chars=3000, what=str(log.parent.name))
        raise
    finally:
        if load is not None:
            load.stop()
        if load_thread is not None:
            load_thread.join(timeout=70)
        stop_operator(operator)
        client.delete(gc_res, class_name)
        client.delete(CORE["Namespace"], ns)

    outcomes = load.outcomes
    window = [o for o in outcomes if began <= o.sent_at <= ended or o.running_at(began)]
    tally, total = Tally.of(window, MAX_TOKENS), Tally.of(outcomes, MAX_TOKENS)
    failed = [(round(o.sent_at - began, 2), o.status, o.error) for o in window if not o.ok(MAX_TOKENS)]
    print(f"[failover] during the failover ({ended - began:.1f}s): sent {tally.sent}, succeeded {tally.succeeded}, "
          f"failed {tally.failed}; whole load: sent {total.sent}, failed {total.failed}; the follower served "
          f"{took_over - began:.2f}s after the deletion")
    assert not forbidden, f"an EPP was refused by the API server (RBAC): {forbidden}"
    assert tally.sent >= 20 and not failed, failed[:10]
    assert total.failed == 0, (total, [(round(o.sent_at - began, 2), o.status, o.error) for o in outcomes
                                       if not o.ok(MAX_TOKENS)][:10])
