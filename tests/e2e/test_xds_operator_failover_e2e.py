"""Two `kvgate operator` replicas in xDS mode with leader election, a Gateway over pools of sim engines under
closed-loop load the whole time, and the leader SIGKILLed twice while a change is being reconciled: once while
the Envoy's xDS stream is on the standby (the stream stays), once while it is on the leader (it reconnects).

Both replicas serve xDS (each on a host address of its own, 127.0.0.2 and 127.0.0.3, as two pods would) behind
one Service, `kvgate-xds`, whose EndpointSlice lists them: the rig's service proxy forwards each new connection
to a listed replica that accepts it, as kube-proxy does, and the Envoys' bootstrap dials its cluster IP. The
slice lists only replica b until step 2, so the Envoy's stream begins on the standby. In sequence:

1. the HTTPRoute's split across pools a and b goes from 100/0 to 0/100 (leader a, stream on standby b): every
   request after the write + 1 s goes to pool b, and the Gateway is Programmed by the ACK b recorded;
2. pool c is created and the route moved to it, and leader a is SIGKILLed right after the write: replica b takes
   the Lease (lease duration + retry period), reconciles, and serves the change on the stream it already held,
   within FAILOVER_BOUND_S of the write;
3. replica a is started again (standby); pool d is created and the route moved to it, and leader b is SIGKILLed
   right after the write: the Envoy's stream breaks and reconnects to a, which takes the Lease, reconciles and
   serves the change within FAILOVER_BOUND_S;
4. pool e is created and the route moved to it (leader a), within 1 s; pools b, c and d are deleted, and their
   clusters leave Envoy's config once they lingered.

Then: no failed request, every object the operator made has exactly one live owner (nothing of the deleted pools
left), one Envoy pod that never restarted, and the Gateway Programmed at the version of the config in its
ConfigMap. Each change is timed as in test_xds_e2e (gateway_traffic.switch).

Opt-in (about 2 minutes on the 2-core sandbox, beyond the e2e tier's budget): KVGATE_E2E_OPERATOR_HA=1.
"""

from __future__ import annotations

import copy
import os
import signal
import socket
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
                                                   reason="opt-in: KVGATE_E2E_OPERATOR_HA=1 (about 2 minutes)")]
XDS_HOSTS = ("127.0.0.2", "127.0.0.3")  # host addresses outside the rig's pod networks, one per replica
SWITCH_BOUND_S = 1.0
RECONCILE_SLACK_S = 10.0  # the new leader's first reconcile and the xDS push, on a loaded 2-core machine
FAILOVER_BOUND_S = LEASE_S + RETRY_S + RECONCILE_SLACK_S
LINGER_BOUND_S = 90.0  # a pool's cluster lingers 30 s after its routes left (CLUSTER_LINGER_S), then a resync


def xds_service(namespace: str, port: int) -> dict:
    """The replicas' xDS Service (no selector: the replicas run next to the rig; xds_endpoints lists them)."""
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "kvgate-xds", "namespace": namespace},
            "spec": {"ports": [{"name": "xds", "port": port, "targetPort": port, "protocol": "TCP"}]}}


def xds_endpoints(namespace: str, port: int, hosts) -> dict:
    """The xDS Service's EndpointSlice, listing the replicas at `hosts` as ready."""
    return {"apiVersion": ENDPOINTSLICE.api_version, "kind": "EndpointSlice",
            "metadata": {"name": "kvgate-xds-replicas", "namespace": namespace,
                         "labels": {"kubernetes.io/service-name": "kvgate-xds"}},
            "addressType": "IPv4", "ports": [{"name": "xds", "port": port, "protocol": "TCP"}],
            "endpoints": [{"addresses": [host], "conditions": {"ready": True}} for host in hosts]}


def test_the_standby_finishes_an_xds_change_its_killed_leader_began(k8s, tmp_path):
    client = k8s.client
    ns, class_name, docs = sample_namespace(k8s, "e2e-xdsha")
    gc_res = client.resource_for("gateway.networking.k8s.io/v1", "GatewayClass", wait_s=30)
    gw_res = client.resource_for("gateway.networking.k8s.io/v1", "Gateway", wait_s=30)
    route_res = client.resource_for("gateway.networking.k8s.io/v1", "HTTPRoute", wait_s=30)
    pool_res = client.resource_for("inference.networking.k8s.io/v1", "InferencePool", wait_s=30)
    logs = [tmp_path / "operator-a.log", tmp_path / "operator-b.log", tmp_path / "operator-a2.log"]
    metrics_ports, xds_port = free_ports(2), free_port()
    operators: list = [None, None]
    load = None
    try:
        wait_default_service_account(client, ns, token=True)
        client.apply(xds_service(ns, xds_port))
        client.apply(xds_endpoints(ns, xds_port, XDS_HOSTS[1:]))  # the Envoy's stream begins on the standby
        cluster_ip = client.get(CORE["Service"], "kvgate-xds", ns)["spec"]["clusterIP"]

        def start(i: int, log) -> None:
            operators[i] = start_operator(
                k8s.kubeconfig, log, *leader_election_flags(ns), "--metrics-port", str(metrics_ports[i]),
                "--envoy-config-source", "xds", "--xds-host", XDS_HOSTS[i], "--xds-port", str(xds_port),
                "--xds-address", f"{cluster_ip}:{xds_port}", "--envoy-bind-address", "pod-ip")

        def leader() -> str:
            """Which replica leads ("a", "b", "none") and its Lease identity."""
            slot = next((n for i, n in enumerate("ab") if leader_gauge(metrics_ports[i]) == 1), "none")
            return f"{slot} ({lease_holder(client, ns)})"

        def standing_by(i: int) -> bool:
            """Replica i follows, its xDS server listening: it listens once its first ConfigMap list is in,
            and runs its election from then on (its leader gauge reads 0 from its start)."""
            if leader_gauge(metrics_ports[i]) != 0:
                return False
            try:
                socket.create_connection((XDS_HOSTS[i], xds_port), timeout=1).close()
            except OSError:
                return False
            return True

        start(0, logs[0])
        wait_for(lambda: leader_gauge(metrics_ports[0]) == 1, timeout_s=60, what="operator a leading")
        start(1, logs[1])
        wait_for(lambda: standing_by(1), timeout_s=60, what="operator b standing by")
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
        assert admin.connected()

        def programmed() -> str | None:
            conds = (client.get(gw_res, "inference-gateway", ns).get("status") or {}).get("conditions") or []
            c = next((c for c in conds if c["type"] == "Programmed"), {})
            return c.get("message") if c.get("status") == "True" else None

        def gateway_config_map() -> dict:
            (config_map,) = client.list(CORE["ConfigMap"], ns,
                                        labelSelector="app.kubernetes.io/component=gateway")["items"]
            return config_map

        def programmed_at_current_version() -> tuple[str, str]:
            """(version, message) once the Gateway is Programmed at the version of its ConfigMap's config."""
            version = snapshot_of(gateway_config_map()).version
            return version, wait_for(lambda: (m := programmed()) and m.endswith(f"serve config {version}") and m,
                                     timeout_s=60, what=f"the Gateway Programmed at {version}")

        def pool(name: str) -> dict:
            out = copy.deepcopy(docs["InferencePool"])
            out["metadata"] = {"name": name, "namespace": ns}
            return out

        def set_refs(*refs: dict) -> None:
            set_route_refs(client, route_res, ns, *refs)

        # Pool b over the same pods (created once the engines run), in the route at weight 0.
        client.apply(pool("demo-pool-b"))
        set_refs(pool_ref("demo-pool", 100), pool_ref("demo-pool-b", 0))
        wait_for(lambda: admin.has_pool("demo-pool-b"), timeout_s=60, what="pool b in Envoy's config")
        programmed_at_current_version()
        (envoy_pod,) = pods(ENVOY_SELECTOR)
        uid, envoy_name = envoy_pod["metadata"]["uid"], envoy_pod["metadata"]["name"]
        restarts = envoy_pod["status"]["containerStatuses"][0]["restartCount"]

        load = ClosedLoopLoad(ip, clients=2).start()
        time.sleep(2)
        assert admin.requests_to("demo-pool") > 0 and admin.requests_to("demo-pool-b") == 0
        timeline: list[tuple] = []

        def step(what: str, write, left: str, to: str, bound_s: float) -> float:
            """Times write(), records the step; returns when switch() began (for the failover's lead time)."""
            before, n0, f0 = leader(), len(load.outcomes), len(load.failed())
            began = time.monotonic()
            left_s, reached_s, n = switch(admin, load, write, left, to)
            timeline.append((what, before, leader(), left_s, reached_s, n, len(load.failed()) - f0,
                             len(load.outcomes) - n0))
            assert left_s <= bound_s and reached_s <= bound_s, (what, left_s, reached_s, bound_s)
            return began

        # 1. Weights 100/0 -> 0/100: leader a renders, standby b serves it and records the Envoy's ACK.
        step("weights a/b 100/0 -> 0/100 (stream on standby b)",
             lambda: set_refs(pool_ref("demo-pool", 0), pool_ref("demo-pool-b", 100)),
             "demo-pool", "demo-pool-b", SWITCH_BOUND_S)
        programmed_at_current_version()
        client.apply(xds_endpoints(ns, xds_port, XDS_HOSTS))  # from now on a reconnect may reach either

        failovers: list[str] = []

        def failover(what: str, victim: int, survivor: int, pool_name: str, left: str) -> None:
            """Pool `pool_name` created and the route moved to it from `left`, the leader `victim` SIGKILLed right
            after the write; the standby `survivor` leads and the change is served within FAILOVER_BOUND_S."""
            led: list[float] = []
            killed: list[float] = []

            def watch_survivor() -> None:
                deadline = time.monotonic() + FAILOVER_BOUND_S + 30
                while not led and time.monotonic() < deadline:
                    if leader_gauge(metrics_ports[survivor]) == 1:
                        led.append(time.monotonic())
                    time.sleep(0.05)

            def write_then_kill() -> None:
                client.apply(pool(pool_name))
                set_refs(pool_ref(pool_name, 1))
                os.killpg(operators[victim].pid, signal.SIGKILL)
                killed.append(time.monotonic())
                threading.Thread(target=watch_survivor, daemon=True).start()
            connections = admin.xds_connections()
            began = step(what, write_then_kill, left, pool_name, FAILOVER_BOUND_S)
            operators[victim].wait(timeout=15)
            wait_for(lambda: led, timeout_s=FAILOVER_BOUND_S + 30, what=f"replica {'ab'[survivor]} leading")
            served_after_lead = timeline[-1][4] - (led[0] - began)
            failovers.append(f"{what}: {'ab'[survivor]} led {led[0] - killed[0]:.1f} s after the kill, the change "
                             f"served {served_after_lead:.2f} s after that, Envoy's xDS connections "
                             f"{connections} -> {admin.xds_connections()}")
            wait_for(admin.connected, timeout_s=30, interval_s=0.1, what="Envoy's xDS stream up")

        # 2. Leader a killed while the stream is on b: the stream stays.
        connections = admin.xds_connections()
        failover("pool c, route to it; leader a SIGKILLed (stream stays on b)", 0, 1, "demo-pool-c", "demo-pool-b")
        assert admin.xds_connections() == connections, "the Envoy's stream, on the standby, should have stayed"
        programmed_at_current_version()

        # 3. Replica a back as the standby; leader b killed while it holds the stream: the Envoy reconnects to a.
        start(0, logs[2])
        wait_for(lambda: standing_by(0), timeout_s=60, what="operator a standing by again")
        time.sleep(RETRY_S * 2)  # its election's first rounds: it has seen the Lease renewed
        failover("pool d, route to it; leader b SIGKILLed (stream moves to a)", 1, 0, "demo-pool-d", "demo-pool-c")
        assert admin.xds_connections() > connections, "the Envoy never reconnected: its stream was not on b"

        # 4. Pool e created and the route moved to it (leader a); pools b, c and d deleted.
        step("pool e, route to it", lambda: (client.apply(pool("demo-pool-e")), set_refs(pool_ref("demo-pool-e", 1))),
             "demo-pool-d", "demo-pool-e", SWITCH_BOUND_S)
        deleted_at, deleted_t, holder = len(load.outcomes), time.monotonic(), leader()
        gone = ("demo-pool-b", "demo-pool-c", "demo-pool-d")
        for name in gone:
            client.delete(pool_res, name, ns)
        wait_for(lambda: not any(admin.has_pool(name) for name in gone), timeout_s=LINGER_BOUND_S, interval_s=0.5,
                 what="pools b, c and d gone from Envoy's config")
        timeline.append(("pools b, c, d deleted (clusters gone from Envoy)", holder, leader(), None,
                         time.monotonic() - deleted_t, len(load.outcomes) - deleted_at,
                         len(load.failed(deleted_at)), len(load.outcomes) - deleted_at))

        # The Gateway Programmed at the version of the config in its ConfigMap: the Envoy's ACK, recorded by the
        # replica that holds its stream, is the only report.
        version, final_message = programmed_at_current_version()
        assert reports_of(gateway_config_map()) == {envoy_name: (version, "")}, reports_of(gateway_config_map())
        load.stop()

        failed = load.failed()
        assert load.outcomes and not failed, failed[:10]
        made = wait_for(lambda: _made_or_none(client, docs, ns), timeout_s=60, what="every object owned once")
        assert made["Deployment"] == ["demo-llm", "demo-pool-epp", "inference-gateway-envoy"], made
        assert not [n for names in made.values() for n in names if any(g in n for g in gone)], made
        (after,) = pods(ENVOY_SELECTOR)
        assert after["metadata"]["uid"] == uid, "the Envoy pod was replaced"
        assert after["status"]["containerStatuses"][0]["restartCount"] == restarts, "Envoy restarted"
        assert not admin.rejected(), admin.rejected()
        assert operators[0].poll() is None, "operator a exited"
        rows = "\n".join(
            f"| {what} | {before} -> {after_} | {'-' if left is None else f'{left:.2f}'} | {reached:.2f} | "
            f"{n} | {fails} |" for what, before, after_, left, reached, n, fails, _ in timeline)
        print(f"\n[xds-operator-ha] lease {LEASE_S} s, retry {RETRY_S} s; " + "; ".join(failovers)
              + f"; {len(load.outcomes)} completions from 2 keep-alive clients, {len(failed)} failed; Envoy's xDS "
              f"connections {admin.xds_connections()}; Gateway: {final_message}; objects: {made}\n"
              "| step | leader before -> after | last request to the old pool (s) | first to the new (s) | "
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
