"""Rollouts under streaming load on the rig (the operator in Kubernetes mode), with crds/samples/ run
by `kvgate operator`, and requests sent to the Gateway's address (its Service's cluster IP):

1. a rolling update of the ModelServer (an engine argument changes, so its Deployment rolls: maxSurge 1,
   maxUnavailable 0; each old pod sleeps in preStop while the EPP drops it, then drains within
   --shutdown-timeout): every streamed request succeeds — 200, exactly max_tokens tokens, usage, [DONE];
2. during it, no request is served by an engine pod that was not Ready when it was served: each answer's
   `x-kvgate-endpoint` is compared with the pod readiness transitions a pod watch records, and no request sent
   after a pod's deletion reached the EPP is routed to it;
3. an EPP rollout (the pool's `kvgate.dev/epp-config` ConfigMap changes, so the EPP Deployment rolls with
   maxSurge 1): every streamed request succeeds while Envoy moves from the old EPP pod to the new one (the
   rig has no Service routing: the operator renders the EPP's pod IP, `--epp-address-mode pod-ip`) and the old
   EPP drains.

Counts (sent / succeeded / failed) and durations are printed for both rollouts.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass

import pytest
from k8srig.kube import CORE, DEPLOYMENT, ApiError, wait_default_service_account, wait_for
from operator_run import (TUNED_EPP_CONFIG, Stages, gateway_serves, is_ready, pod_story, print_log_tail,
                          sample_namespace, sample_resources, start_operator, stop_operator)

from kvgate.bench.chaos.load import StreamLoad, Tally

pytestmark = pytest.mark.e2e
ENGINES = "app=demo-llm"
ENVOY = "app.kubernetes.io/name=kvgate-gateway,app.kubernetes.io/instance=inference-gateway"
EPP = "app.kubernetes.io/name=kvgate-epp,app.kubernetes.io/instance=demo-pool"
CONCURRENCY = 6
MAX_TOKENS = 32
# A pod's deletion reaches the EPP's pod watch well within this; a request sent later must not go there.
DELETION_NOTICE_S = 2.0
# Our pod watch and the EPP's see a pod turn Ready at about the same moment; this much disagreement is allowed.
WATCH_SKEW_S = 0.5


@dataclass
class PodLife:
    name: str
    labels: dict
    ready_at: float | None = None      # first seen Ready (monotonic)
    unready_at: float | None = None    # first seen not Ready after that
    deleted_at: float | None = None    # first seen with a deletionTimestamp


class PodWatch:
    """Every pod of a namespace by IP, with when this process saw it turn Ready, lose readiness, get deleted."""

    def __init__(self, client, namespace: str) -> None:
        self.client, self.ns = client, namespace
        self.by_ip: dict[str, PodLife] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pod-watch", daemon=True)

    def start(self) -> None:
        listed = self.client.list(CORE["Pod"], self.ns)
        for pod in listed["items"]:
            self._see(pod)
        self._rv = listed["metadata"]["resourceVersion"]
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _see(self, pod: dict) -> None:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            return
        now = time.monotonic()
        life = self.by_ip.setdefault(ip, PodLife(pod["metadata"]["name"], pod["metadata"].get("labels") or {}))
        if pod["metadata"].get("deletionTimestamp") and life.deleted_at is None:
            life.deleted_at = now
        if is_ready(pod):
            life.ready_at = life.ready_at or now
        elif life.ready_at is not None and life.unready_at is None:
            life.unready_at = now

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                for event in self.client.watch(CORE["Pod"], self.ns, resource_version=self._rv, timeout_s=5):
                    obj = event.get("object") or {}
                    self._rv = (obj.get("metadata") or {}).get("resourceVersion", self._rv)
                    if event.get("type") in ("ADDED", "MODIFIED", "DELETED"):
                        self._see(obj)
                    if self._stop.is_set():
                        return
            except (ApiError, OSError, ValueError):
                if self._stop.wait(0.2):
                    return
                listed = self.client.list(CORE["Pod"], self.ns)  # a gone resourceVersion: start again from now
                for pod in listed["items"]:
                    self._see(pod)
                self._rv = listed["metadata"]["resourceVersion"]


def test_rollouts_under_streaming_load(k8s, tmp_path):
    client = k8s.client
    mark = Stages("rollout")
    t0 = mark.t0
    ns, class_name, docs = sample_namespace(k8s, "e2e-rollout")
    res = sample_resources(client)
    ms_res, pool_res, gw_res, gc_res = res["ModelServer"], res["InferencePool"], res["Gateway"], res["GatewayClass"]
    log_path = tmp_path / "operator.log"
    operator = None
    watch = PodWatch(client, ns)
    load = None
    load_thread = None

    def pods(selector: str, live_only: bool = False) -> list[dict]:
        items = client.list(CORE["Pod"], ns, labelSelector=selector)["items"]
        return [p for p in items if not (live_only and p["metadata"].get("deletionTimestamp"))]

    def ready_ips(selector: str) -> set[str]:
        return {p["status"]["podIP"] for p in pods(selector) if is_ready(p)}

    def rolled(deployment: str, selector: str, replicas: int) -> bool:
        """The Deployment's new pods all Ready and every old pod gone (not merely terminating)."""
        dep = client.get(DEPLOYMENT, deployment, ns)
        st = dep.get("status") or {}
        return (st.get("observedGeneration") == dep["metadata"]["generation"]
                and st.get("updatedReplicas") == st.get("replicas") == st.get("readyReplicas") == replicas
                and len(pods(selector)) == replicas and len(ready_ips(selector)) == replicas)

    def epp_roll_state(seen: dict, old_uids: set) -> str:
        """One line saying where an EPP roll stands, for a timeout's message; each EPP pod's log tail printed."""
        status = client.get(DEPLOYMENT, "demo-pool-epp", ns).get("status") or {}
        states = []
        for p in pods(EPP):
            md = p["metadata"]
            states.append(f"{'old' if md['uid'] in old_uids else 'new'} {md['name']} "
                          f"{p.get('status', {}).get('phase')} ready={is_ready(p)} "
                          f"deleting={bool(md.get('deletionTimestamp'))}")
            for log in (k8s.dir / "runner" / "pods").glob(f"{ns}_{md['name']}_{md['uid'][:8]}/*.log"):
                print_log_tail(log, chars=3000, what=f"log of {md['name']}")
        steps = ", ".join(f"{k} at {v:.1f}s" for k, v in seen.items()) or "none"
        fields = {k: status.get(k) for k in ("replicas", "updatedReplicas", "readyReplicas", "observedGeneration")}
        return (f"steps seen: {steps}; Deployment status {fields}; EPP pods: {'; '.join(states) or 'none'}; "
                f"Envoy's EPP address {envoy_epp_address() or 'none'}")

    def envoy_epp_address() -> str:
        """The EPP pod IPs the Gateway's Envoy config names (its EPP cluster's EDS file)."""
        cm = client.get(CORE["ConfigMap"], "inference-gateway-envoy", ns)
        eds = json.loads(cm["data"].get(f"eds-epp-{ns}-demo-pool.yaml") or '{"resources": []}')["resources"]
        lb = eds[0]["endpoints"][0]["lb_endpoints"] if eds else []
        return ",".join(e["endpoint"]["address"]["socket_address"]["address"] for e in lb)

    try:
        wait_default_service_account(client, ns, token=True)
        operator = start_operator(k8s.kubeconfig, log_path)
        for kind in ("GatewayClass", "InferencePool", "ModelServer", "InferenceObjective", "InferenceModelRewrite",
                     "Gateway", "HTTPRoute"):
            client.apply(docs[kind])
        wait_for(lambda: len(ready_ips(ENGINES)) == 2 and len(ready_ips(EPP)) == 1 and len(ready_ips(ENVOY)) == 1,
                 timeout_s=90, interval_s=0.5, what="2 engine pods, the EPP and Envoy Ready")
        gateway = wait_for(lambda: (g := client.get(gw_res, "inference-gateway", ns)).get("status", {})
                           .get("addresses") and g, timeout_s=30, what="the Gateway's address")
        url = f"http://{gateway['status']['addresses'][0]['value']}:8080"
        wait_for(lambda: gateway_serves(url), timeout_s=60, interval_s=0.5,
                 what="a completion served through the Gateway's address")
        mark(f"samples serving through the Gateway at {url}")

        watch.start()
        load = StreamLoad(url, "demo", concurrency=CONCURRENCY, max_tokens=MAX_TOKENS, timeout_s=60)
        load_thread = threading.Thread(target=lambda: asyncio.run(load.run()), name="stream-load", daemon=True)
        load_thread.start()
        wait_for(lambda: sum(o.ok(MAX_TOKENS) for o in load.outcomes) >= 10, timeout_s=30,
                 what="streams served before the rollouts")

        # --- 1. the ModelServer rolls ---------------------------------------------------------------------------
        old_engines = ready_ips(ENGINES)
        engine_began = time.monotonic()
        client.patch(ms_res, "demo-llm", {"spec": {"extraArgs": ["--sim-step-overhead-ms", "12"]}}, ns)
        wait_for(lambda: rolled("demo-llm", ENGINES, 2) and not (ready_ips(ENGINES) & old_engines),
                 timeout_s=90, interval_s=0.25, what="the engine Deployment to roll to 2 new pods")
        engine_ended = time.monotonic()
        mark(f"ModelServer rolled in {engine_ended - engine_began:.1f}s: {sorted(old_engines)} -> "
             f"{sorted(ready_ips(ENGINES))}")
        time.sleep(1.0)

        # --- 2. the EPP rolls ---------------------------------------------------------------------------------
        old_epp = {p["metadata"]["uid"] for p in pods(EPP)}
        old_epp_ip = next(iter(ready_ips(EPP)))
        client.create(CORE["ConfigMap"], {"apiVersion": "v1", "kind": "ConfigMap",
                                          "metadata": {"name": "tuned", "namespace": ns,
                                                       "labels": {"kvgate.dev/epp-config": "true"}},
                                          "data": {"epp.yaml": TUNED_EPP_CONFIG}}, ns)
        epp_began = time.monotonic()
        client.patch(pool_res, "demo-pool", {"metadata": {"annotations": {"kvgate.dev/epp-config": "tuned"}}}, ns)
        seen: dict[str, float] = {}

        def epp_rolled() -> bool:
            now = time.monotonic() - epp_began
            address = envoy_epp_address()
            if address and address != old_epp_ip:
                seen.setdefault("Envoy config names the new EPP pod", now)
            epp_pods = pods(EPP)
            for p in epp_pods:   # each step's time, so that a slow roll says which step was slow
                if p["metadata"]["uid"] not in old_epp:
                    seen.setdefault("new EPP pod created", now)
                    if is_ready(p):
                        seen.setdefault("new EPP pod Ready", now)
                elif p["metadata"].get("deletionTimestamp"):
                    seen.setdefault("old EPP pod deleting", now)
            if not {p["metadata"]["uid"] for p in epp_pods} & old_epp:
                seen.setdefault("old EPP pod gone", now)
            return (rolled("demo-pool-epp", EPP, 1) and "old EPP pod gone" in seen
                    and "Envoy config names the new EPP pod" in seen)
        try:
            wait_for(epp_rolled, timeout_s=90, interval_s=0.25, what="the EPP Deployment to roll, Envoy to follow")
        except TimeoutError as e:
            print(pod_story(k8s, ns, EPP))
            raise TimeoutError(f"{e}; {epp_roll_state(seen, old_epp)}") from None
        epp_ended = time.monotonic()
        mark(f"EPP rolled in {epp_ended - epp_began:.1f}s ({old_epp_ip} -> {envoy_epp_address()}; "
             + ", ".join(f"{k} at {v:.1f}s" for k, v in seen.items()) + ")")
        time.sleep(2.0)
    except BaseException:
        print_log_tail(log_path)
        raise
    finally:
        if load is not None:
            load.stop()
        if load_thread is not None:
            load_thread.join(timeout=70)
        watch.stop()
        stop_operator(operator)
        client.delete(gc_res, class_name)
        client.delete(CORE["Namespace"], ns)

    outcomes = load.outcomes
    assert not load_thread.is_alive(), "the load did not stop"

    def report(what: str, began: float, ended: float) -> list:
        window = [o for o in outcomes if began <= o.sent_at <= ended or o.running_at(began)]
        tally = Tally.of(window, MAX_TOKENS)
        failed = [(round(o.sent_at - began, 2), o.status, o.endpoint, o.tokens, o.error) for o in window
                  if not o.ok(MAX_TOKENS)]
        print(f"[rollout] {what}: {ended - began:.1f}s; requests running or sent meanwhile: sent {tally.sent}, "
              f"succeeded {tally.succeeded}, failed {tally.failed}" + (f"; failures {failed[:8]}" if failed else ""))
        return failed

    engine_failed = report("ModelServer rollout", engine_began, engine_ended)
    epp_failed = report("EPP rollout", epp_began, epp_ended)
    total = Tally.of(outcomes, MAX_TOKENS)
    print(f"[rollout] whole load: sent {total.sent}, succeeded {total.succeeded}, failed {total.failed}")

    # Which pod served each request, against when it was Ready (and when its deletion was known).
    not_ready, after_deletion, margins = [], [], []
    for o in outcomes:
        if not o.endpoint or o.headers_at is None:
            continue
        life = watch.by_ip.get(o.endpoint.rsplit(":", 1)[0])
        if life is None or life.ready_at is None or life.ready_at > o.headers_at + WATCH_SKEW_S:
            not_ready.append((o.endpoint, life, round(o.headers_at - t0, 2)))
            continue
        margins.append(o.headers_at - life.ready_at)
        if life.deleted_at is not None and o.sent_at > life.deleted_at + DELETION_NOTICE_S:
            after_deletion.append((o.endpoint, round(o.sent_at - life.deleted_at, 2)))
    engines_seen = sorted(ip for ip, life in watch.by_ip.items() if life.labels.get("app") == "demo-llm")
    served_by = sorted({o.endpoint for o in outcomes if o.endpoint})
    print(f"[rollout] served by {served_by} of the engine pods seen {engines_seen}; "
          f"{len(not_ready)} served by a pod not Ready, {len(after_deletion)} sent > {DELETION_NOTICE_S}s after "
          f"the serving pod's deletion; closest answer after a pod turned Ready: "
          f"{min(margins, default=float('nan')):.2f}s")
    assert total.sent >= 50, total
    assert not engine_failed, engine_failed[:10]
    assert not epp_failed, epp_failed[:10]
    assert total.failed == 0, total
    assert not not_ready, not_ready[:10]
    assert not after_deletion, after_deletion[:10]
    assert len(served_by) >= 3, "the load never reached the new engine pods"
