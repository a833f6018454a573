"""Two `kvgate operator` replicas in xDS mode with leader election, a Gateway over pools of sim engines under
closed-loop load the whole time, and the leader SIGKILLed while a change is being reconciled.

Both replicas serve xDS (each on a host address of its own, 127.0.0.2 and 127.0.0.3, as two pods would) behind
one Service, `kvgate-xds`, whose EndpointSlice lists them: the rig's service proxy forwards each connection to a
replica that accepts it, as kube-proxy does, and the Envoys' bootstrap dials its cluster IP. The Envoy connects
while only the leader runs, so its stream is on the replica that is then killed. In sequence:

1. the HTTPRoute's split across pools a and b goes from 100/0 to 0/100 (leader a): every request after the
   write + 1 s goes to pool b;
2. pool c is created and the route moved to it, and leader a is SIGKILLed right after the write, before it
   reconciled: replica b takes the Lease (lease duration + retry period), reconciles, and Envoy, its stream
   reconnected to replica b, serves the change within FAILOVER_BOUND_S of the write;
3. pool d is created and the route moved to it (leader b), within 1 s; pools b and c are deleted, and their
   clusters leave Envoy's config once they lingered.

Then: no failed request, every object the operator made has exactly one live owner (nothing of the deleted pools
left), one Envoy pod never restarted, and the Gateway Programmed at the version of the config in its ConfigMap,
ACKed through replica b. Each change is timed as in test_xds_e2e (gateway_traffic.switch).

Opt-in (about 3 minutes on the 2-core sandbox, beyond the e2e tier's budget): KVGATE_E2E_OPERATOR_HA=1.
"""

from __future__ import annotations

import copy
import os
import signal
import threading
import time

import httpx
import pytest
from gateway_traffic import (ENVOY_SELECTOR, ClosedLoopLoad, EnvoyAdmin, completion, pool_ref, set_route_refs,
                             switch)
from k8srig.kube import CORE, DEPLOYMENT, ENDPOINTSLICE, wait_default_service_account, wait_for
from operator_ha import LEASE_S, RETRY_S, lease_holder, leader_election_flags, leader_gauge, made_objects
from operator_run import is_ready, pod_story, print_log_tail, sample_namespace, start_operator, stop_operator
from test_epp_kubernetes import free_ports

from kvgate.operator.xds.ack_report import reports_of
from kvgate.operator.xds.configmap_source import snapshot_of
from tests.procs import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.environ.get("KVGATE_E2E_OPERATOR_HA") != "1",
                                                   reason="opt-in: KVGATE_E2E_OPERATOR_HA=1 (about 3 minutes)")]
XDS_HOSTS = ("127.0.0.2", "127.0.0.3")  # host addresses outside the rig's pod networks, one per replica
SWITCH_BOUND_S = 1.0
RECONCILE_SLACK_S = 10.0  # the new leader's first reconcile and the xDS push, on a loaded 2-core machine
FAILOVER_BOUND_S = LEASE_S + RETRY_S + RECONCILE_SLACK_S
LINGER_BOUND_S = 90.0  # a pool's cluster lingers 30 s after its routes left (CLUSTER_LINGER_S), then a resync


def xds_service(namespace: str, port: int) -> list[dict]:
    """The replicas' xDS Service and its EndpointSlice (no selector: the replicas run next to the rig)."""
    return [{"apiVersion": "v1", "kind": "Service", "metadata": {"name": "kvgate-xds", "namespace": namespace},
             "spec": {"ports": [{"name": "xds", "port": port, "targetPort": port, "protocol": "TCP"}]}},
            {"apiVersion": ENDPOINTSLICE.api_version, "kind": "EndpointSlice",
             "metadata": {"name": "kvgate-xds-replicas", "namespace": namespace,
                          "labels": {"kubernetes.io/service-name": "kvgate-xds"}},
             "addressType": "IPv4", "ports": [{"name": "xds", "port": port, "protocol": "TCP"}],
             "endpoints": [{"addresses": [host], "conditions": {"ready": True}} for host in XDS_HOSTS]}]


def test_the_standby_finishes_an_xds_change_its_killed_leader_began(k8s, tmp_path):
    client = k8s.client
    ns, class_name, docs = sample_namespace(k8s, "e2e-xdsha")
    gc_res = client.resource_for("gateway.networking.k8s.io/v1", "GatewayClass", wait_s=30)
    gw_res = client.resource_for("gateway.networking.k8s.io/v1", "Gateway", wait_s=30)
    route_res = client.resource_for("gateway.networking.k8s.io/v1", "HTTPRoute", wait_s=30)
    pool_res = client.resource_for("inference.networking.k8s.io/v1", "InferencePool", wait_s=30)
    logs = [tmp_path / "operator-a.log", tmp_path / "operator-b.log"]
    metrics_ports, xds_port = free_ports(2), free_port()
    operators: list = []
    load = None
    try:
        wait_default_service_account(client, ns, token=True)
        for doc in xds_service(ns, xds_port):
            client.apply(doc)
        cluster_ip = client.get(CORE["Service"], "kvgate-xds", ns)["spec"]["clusterIP"]

        def start(i: int):
            return start_operator(k8s.kubeconfig, logs[i], *leader_election_flags(ns),
                                  "--metrics-port", str(metrics_ports[i]), "--envoy-config-source", "xds",
                                  "--xds-host", XDS_HOSTS[i], "--xds-port", str(xds_port),
                                  "--xds-address", f"{cluster_ip}:{xds_port}", "--envoy-bind-address", "pod-ip")

        operators.append(start(0))
        wait_for(lambda: leader_gauge(metrics_ports[0]) == 1, timeout_s=60, what="operator a leading")
        leader_a = lease_holder(client, ns)
        for kind in ("GatewayClass", "InferencePool", "ModelServer", "Gateway", "HTTPRoute"):
            client.apply(docs[kind])

        def pods(selector: str) -> list[dict]:
            return client.list(CORE["Pod"], ns, labelSelector=selector)["items"]

        last = ["no ready Envoy pod"]

        def envoy_serving() -> str | None:
            ready = [p for p in pods(ENVOY_SELECTOR) if is_ready(p)]
            if len(ready) != 1:
                return None
            ip = ready[0]["status"]["podIP"]
            try:
                with httpx.Client(timeout=10) as http:
                    r = completion(http, ip)
            except httpx.HTTPError as exc:
                last[0] = repr(exc)
                return None
            last[0] = f"{r.status_code} {r.text[:200]}"
            return ip if r.status_code == 200 else None
        try:
            ip = wait_for(envoy_serving, timeout_s=150, interval_s=1, what="the Envoy pod serving a completion")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; last answer: {last[0]}") from None
        admin = EnvoyAdmin(ip, ns)
        assert admin.connected() and admin.xds_connections() >= 1

        # The standby, started once the Envoy's stream is on the leader.
        operators.append(start(1))
        wait_for(lambda: leader_gauge(metrics_ports[1]) == 0, timeout_s=60, what="operator b standing by")

        def programmed() -> str | None:
            conds = (client.get(gw_res, "inference-gateway", ns).get("status") or {}).get("conditions") or []
            c = next((c for c in conds if c["type"] == "Programmed"), {})
            return c.get("message") if c.get("status") == "True" else None

        def pool(name: str) -> dict:
            out = copy.deepcopy(docs["InferencePool"])
            out["metadata"] = {"name": name, "namespace": ns}
            return out

        def set_refs(*refs: dict) -> None:
            set_route_refs(client, route_res, ns, *refs)

        # Pool b over the same pods (created once the engines run), in the route at weight 0.
        client.apply(pool("demo-pool-b"))
        set_refs(pool_ref("demo-pool", 100), pool_ref("demo-pool-b", 0))
        wait_for(lambda: (m := programmed()) and admin.has_pool("demo-pool-b") and m, timeout_s=60,
                 what="the Gateway Programmed with pool b in its config")
        (envoy_pod,) = pods(ENVOY_SELECTOR)
        uid = envoy_pod["metadata"]["uid"]
        restarts = envoy_pod["status"]["containerStatuses"][0]["restartCount"]

        load = ClosedLoopLoad(ip, clients=2).start()
        time.sleep(2)
        assert admin.requests_to("demo-pool") > 0 and admin.requests_to("demo-pool-b") == 0
        timeline: list[tuple] = []

        def step(what: str, write, left: str, to: str, bound_s: float) -> None:
            holder, n0, f0 = lease_holder(client, ns), len(load.outcomes), len(load.failed())
            left_s, reached_s, n = switch(admin, load, write, left, to)
            timeline.append((what, holder, lease_holder(client, ns), left_s, reached_s, n,
                             len(load.failed()) - f0, len(load.outcomes) - n0))
            assert left_s <= bound_s and reached_s <= bound_s, (what, left_s, reached_s, bound_s)

        # 1. Weights 100/0 -> 0/100, leader a.
        step("weights a/b 100/0 -> 0/100", lambda: set_refs(pool_ref("demo-pool", 0), pool_ref("demo-pool-b", 100)),
             "demo-pool", "demo-pool-b", SWITCH_BOUND_S)

        # 2. Pool c and the route moved to it; the leader killed right after the write, before it reconciled.
        connections = admin.xds_connections()
        led: list[float] = []

        def watch_standby() -> None:
            deadline = time.monotonic() + FAILOVER_BOUND_S + 30
            while not led and time.monotonic() < deadline:
                if leader_gauge(metrics_ports[1]) == 1:
                    led.append(time.monotonic())
                time.sleep(0.05)

        def new_pool_then_kill() -> None:
            client.apply(pool("demo-pool-c"))
            set_refs(pool_ref("demo-pool-c", 1))
            os.killpg(operators[0].pid, signal.SIGKILL)
            killed.append(time.monotonic())
            threading.Thread(target=watch_standby, daemon=True).start()
        killed: list[float] = []
        began_kill_step = [time.monotonic()]  # within milliseconds of the write: switch() begins right after
        step("pool c created, route moved to it; leader a SIGKILLed", new_pool_then_kill, "demo-pool-b",
             "demo-pool-c", FAILOVER_BOUND_S)
        operators[0].wait(timeout=15)
        wait_for(lambda: led, timeout_s=FAILOVER_BOUND_S + 30, what="operator b leading")
        took_lead = led[0] - killed[0]
        served_after_lead = timeline[-1][4] - (led[0] - began_kill_step[0])
        leader_b = lease_holder(client, ns)
        assert leader_b and leader_b != leader_a, (leader_a, leader_b)
        wait_for(admin.connected, timeout_s=30, interval_s=0.1, what="Envoy's xDS stream on replica b")
        assert admin.xds_connections() > connections, "Envoy never reconnected: its stream was not on the leader"

        # 3. Pool d created and the route moved to it (leader b); pools b and c deleted.
        step("pool d created, route moved to it", lambda: (client.apply(pool("demo-pool-d")),
                                                          set_refs(pool_ref("demo-pool-d", 1))),
             "demo-pool-c", "demo-pool-d", SWITCH_BOUND_S)
        deleted_at, deleted_t = len(load.outcomes), time.monotonic()
        client.delete(pool_res, "demo-pool-b", ns)
        client.delete(pool_res, "demo-pool-c", ns)
        wait_for(lambda: not admin.has_pool("demo-pool-b") and not admin.has_pool("demo-pool-c"),
                 timeout_s=LINGER_BOUND_S, interval_s=0.5, what="pools b and c gone from Envoy's config")
        timeline.append(("pools b, c deleted (clusters gone from Envoy)", leader_b, lease_holder(client, ns), None,
                         time.monotonic() - deleted_t, len(load.outcomes) - deleted_at,
                         len(load.failed(deleted_at)), len(load.outcomes) - deleted_at))

        # The Gateway Programmed at the version of the config in its ConfigMap, the Envoy's ACK written by b.
        (config_map,) = client.list(CORE["ConfigMap"], ns, labelSelector="app.kubernetes.io/component=gateway")[
            "items"]
        version = snapshot_of(config_map).version

        def programmed_at_version() -> str | None:
            m = programmed()
            return m if m and m.endswith(f"serve config {version}") else None
        final_message = wait_for(programmed_at_version, timeout_s=60, what=f"Programmed at {version}")
        (config_map,) = client.list(CORE["ConfigMap"], ns, labelSelector="app.kubernetes.io/component=gateway")[
            "items"]
        assert reports_of(config_map) == {envoy_pod["metadata"]["name"]: (version, "")}, reports_of(config_map)
        load.stop()

        failed = load.failed()
        assert load.outcomes and not failed, failed[:10]
        made = wait_for(lambda: _made_or_none(client, docs, ns), timeout_s=60, what="every object owned once")
        assert made["Deployment"] == ["demo-llm", "demo-pool-epp", "inference-gateway-envoy"], made
        assert not [n for names in made.values() for n in names if "pool-b" in n or "pool-c" in n], made
        (after,) = pods(ENVOY_SELECTOR)
        assert after["metadata"]["uid"] == uid, "the Envoy pod was replaced"
        assert after["status"]["containerStatuses"][0]["restartCount"] == restarts, "Envoy restarted"
        assert not admin.rejected(), admin.rejected()
        assert operators[1].poll() is None, "operator b exited"
        rows = "\n".join(
            f"| {what} | {before} -> {after_} | {'-' if left is None else f'{left:.2f}'} | {reached:.2f} | "
            f"{n} | {fails} |" for what, before, after_, left, reached, n, fails, _ in timeline)
        print(f"\n[xds-operator-ha] lease {LEASE_S} s, retry {RETRY_S} s; replica b led {took_lead:.1f} s after the "
              f"kill, the change served {served_after_lead:.2f} s after that; {len(load.outcomes)} completions from 2 keep-alive clients, {len(failed)} failed; Envoy's xDS "
              f"connections {admin.xds_connections()}; Gateway: {final_message}; objects: {made}\n"
              "| step | leader (Lease holder) | last request to the old pool (s) | first to the new (s) | "
              "requests meanwhile | failed |\n|---|---|---|---|---|---|\n" + rows, flush=True)
    except BaseException:
        for log in logs:
            print_log_tail(log, what=log.name)
        print(pod_story(k8s, ns, "app.kubernetes.io/managed-by=kvgate-operator"))
        raise
    finally:
        if load:
            load.stop()
        for proc in operators:
            stop_operator(proc)
        client.delete(gc_res, class_name)
        client.delete(CORE["Namespace"], ns)


def _made_or_none(client, docs, ns) -> dict | None:
    """made_objects once the garbage collector removed what deleted owners held; None meanwhile."""
    try:
        return made_objects(client, docs, ns)
    except AssertionError:
        return None
