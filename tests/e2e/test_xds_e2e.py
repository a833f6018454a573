"""Gateways configured over xDS on the rig: route and pool changes under load, each served within a second of the
API write, with no failed request and no Envoy restart.

`kvgate operator --envoy-config-source xds` runs next to the rig (as in test_operator_e2e), its xDS server on
127.0.0.2 (the rig maps 127.0.0.1 in a pod's config files to the pod's own address; its pods live in 127.N/16,
N >= 16), which the rig's pods reach; the Envoys bind their listeners to their pod IP (`--envoy-bind-address
pod-ip`: the rig's pods share the host's network namespace). The samples run with a second and a third pool over the same engine pods and
EPP. Under keep-alive completions from two clients:

1. the HTTPRoute's split across pools a and b goes from 100/0 to 0/100;
2. a third pool is created and the route moved to it in the same step (its clusters are new: the xDS server sends
   them, and the route table only once Envoy ACKed them);
3. pool b, which no route uses any more, is deleted;
4. the operator is killed (SIGKILL) and started again, and the route moved back to the sample's pool.

Each change is timed from the API write to the last request Envoy sent to the pool it left (its cluster's
`upstream_rq_total` stops growing; polled every 50 ms at Envoy's admin) and to the first one to the pool it moved
to. The Gateway's Programmed condition names the config version its Envoy ACKed.
"""

from __future__ import annotations

import copy
import os
import signal
import time

import httpx
import pytest
from gateway_traffic import (ENVOY_SELECTOR, ClosedLoopLoad, EnvoyAdmin, completion, pool_ref, set_route_refs,
                             switch)
from k8srig.kube import CORE, DEPLOYMENT, wait_default_service_account, wait_for
from operator_run import is_ready, print_log_tail, sample_namespace, start_operator, stop_operator

from tests.procs import free_port

pytestmark = pytest.mark.e2e
SWITCH_BOUND_S = 1.0
XDS_HOST = "127.0.0.2"  # the operator's xDS server: a host address outside the rig's pod networks


def test_route_and_pool_changes_over_xds_under_load(k8s, tmp_path):
    client = k8s.client
    ns, class_name, samples = sample_namespace(k8s, "e2e-xds")
    gc_res = client.resource_for("gateway.networking.k8s.io/v1", "GatewayClass", wait_s=30)
    gw_res = client.resource_for("gateway.networking.k8s.io/v1", "Gateway", wait_s=30)
    route_res = client.resource_for("gateway.networking.k8s.io/v1", "HTTPRoute", wait_s=30)
    pool_res = client.resource_for("inference.networking.k8s.io/v1", "InferencePool", wait_s=30)
    log_path = tmp_path / "operator.log"
    xds_port = free_port()
    operator = load = None
    try:
        wait_default_service_account(client, ns, token=True)
        xds_args = ("--envoy-config-source", "xds", "--xds-host", XDS_HOST, "--xds-port", str(xds_port),
                    "--xds-address", f"{XDS_HOST}:{xds_port}", "--envoy-bind-address", "pod-ip")
        operator = start_operator(k8s.kubeconfig, log_path, *xds_args)

        def pool(name: str) -> dict:
            out = copy.deepcopy(samples["InferencePool"])
            out["metadata"] = {"name": name, "namespace": ns}
            return out

        for kind in ("GatewayClass", "InferencePool", "ModelServer", "Gateway", "HTTPRoute"):
            client.apply(samples[kind])

        def pods(selector: str) -> list[dict]:
            return client.list(CORE["Pod"], ns, labelSelector=selector)["items"]

        last = ["no ready Envoy pod"]

        def envoy_serving() -> str | None:
            ready = [p for p in pods(ENVOY_SELECTOR) if is_ready(p)]
            if len(ready) != 1:
                return None
            ip = ready[0]["status"]["podIP"]
            try:
                r = completion(httpx.Client(timeout=10), ip)
            except httpx.HTTPError as exc:
                last[0] = repr(exc)
                return None
            last[0] = f"{r.status_code} {r.text[:200]}"
            return ip if r.status_code == 200 else None
        try:
            ip = wait_for(envoy_serving, timeout_s=150, interval_s=1, what="the Envoy pod serving a completion")
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; last answer: {last[0]}") from None

        def programmed() -> str | None:
            conds = (client.get(gw_res, "inference-gateway", ns).get("status") or {}).get("conditions") or []
            c = next((c for c in conds if c["type"] == "Programmed"), {})
            return c.get("message") if c.get("status") == "True" else None
        sample_message = wait_for(programmed, timeout_s=60, what="the Gateway Programmed by the Envoy's ACK")
        assert " serve config " in sample_message, sample_message

        def set_refs(*refs: dict) -> None:
            set_route_refs(client, route_res, ns, *refs)

        # Pool b over the same pods (created once the engines run: a ModelServer refuses to start pods that two
        # pools would select), in the route at weight 0.
        client.apply(pool("demo-pool-b"))
        set_refs(pool_ref("demo-pool", 100), pool_ref("demo-pool-b", 0))
        first_message = wait_for(lambda: (m := programmed()) and m != sample_message and m, timeout_s=60,
                                 what="the Gateway Programmed with pool b in its config")
        (envoy_pod,) = pods(ENVOY_SELECTOR)
        uid = envoy_pod["metadata"]["uid"]
        restarts = envoy_pod["status"]["containerStatuses"][0]["restartCount"]
        template = client.get(DEPLOYMENT, "inference-gateway-envoy", ns)["spec"]["template"]
        admin = EnvoyAdmin(ip, ns)
        load = ClosedLoopLoad(ip, clients=2).start()
        outcomes = load.outcomes
        time.sleep(2)
        assert admin.requests_to("demo-pool") > 0 and admin.requests_to("demo-pool-b") == 0

        def switch_(write, left: str, to: str) -> tuple[float, float, int]:
            return switch(admin, load, write, left, to)

        times = {"weights 100/0 -> 0/100": switch_(
            lambda: set_refs(pool_ref("demo-pool", 0), pool_ref("demo-pool-b", 100)), "demo-pool", "demo-pool-b")}

        def new_pool() -> None:
            client.apply(pool("demo-pool-c"))
            set_refs(pool_ref("demo-pool-c", 1))
        times["pool c created, route moved to it"] = switch_(new_pool, "demo-pool-b", "demo-pool-c")
        deleted_at = len(outcomes)
        client.delete(pool_res, "demo-pool-b", ns)
        time.sleep(2)
        during_delete = len(outcomes) - deleted_at
        final_message = wait_for(lambda: (m := programmed()) and m != first_message and m, timeout_s=30,
                                 what="the Gateway Programmed with the last config")

        # 4. The operator killed: Envoy keeps serving what it has; a new operator is sent the Envoy's stream back
        # and answers nothing it already has, and the next change is served as fast.
        connected = admin.connected

        def updates() -> dict[str, int]:  # what Envoy was sent: listeners and route tables do not change here
            names = ("listener_manager.lds.update_success", "http.gateway_8080.rds.gateway-8080.update_success")
            return {n: admin.stat(n) for n in names}
        sent_before = updates()
        os.killpg(operator.pid, signal.SIGKILL)
        operator.wait(timeout=15)
        killed_at = len(outcomes)
        wait_for(lambda: not connected(), timeout_s=30, interval_s=0.1, what="Envoy's xDS stream down")
        time.sleep(2)
        operator = start_operator(k8s.kubeconfig, log_path.with_suffix(".2.log"), *xds_args)
        wait_for(connected, timeout_s=90, interval_s=0.2, what="Envoy's xDS stream back")
        time.sleep(2)  # the new operator's first reconcile
        while_down = len(outcomes) - killed_at
        assert updates() == sent_before, "the reconnected Envoy was sent listeners or routes it had"
        times["after an operator restart: route moved back to pool a"] = switch_(
            lambda: set_refs(pool_ref("demo-pool", 1)), "demo-pool-c", "demo-pool")

        load.stop()
        failed = [o for o in outcomes if o[0] != 200]
        assert outcomes and not failed, failed[:10]
        for what, (left_s, reached_s, _) in times.items():
            assert left_s <= SWITCH_BOUND_S and reached_s <= SWITCH_BOUND_S, (what, times)
        (after,) = pods(ENVOY_SELECTOR)
        assert after["metadata"]["uid"] == uid, "the Envoy pod was replaced"
        assert after["status"]["containerStatuses"][0]["restartCount"] == restarts, "Envoy restarted"
        assert client.get(DEPLOYMENT, "inference-gateway-envoy", ns)["spec"]["template"] == template
        assert not admin.rejected(), admin.rejected()
        print(f"\n[xds-e2e] {len(outcomes)} completions from 2 keep-alive clients, none failed; "
              + "; ".join(f"{what}: last request to the old pool {l:.2f}s, first to the new {r:.2f}s after the "
                          f"write ({n} requests meanwhile)" for what, (l, r, n) in times.items())
              + f"; pool b deleted under {during_delete} requests; Gateway: {final_message}; operator killed and "
              f"started again under {while_down} requests", flush=True)
        assert operator.poll() is None, "the operator exited"
    except BaseException:
        print_log_tail(log_path)
        raise
    finally:
        if load:
            load.stop()
        stop_operator(operator)
        client.delete(gc_res, class_name)
        client.delete(CORE["Namespace"], ns)
