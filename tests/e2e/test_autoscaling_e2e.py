"""The operator's autoscaler on the rig, with sim engines: a ModelServer at minReplicas 0 serves its first request
once the EPP's held request has started a replica; a load step scales it out; after the load it scales back to
zero; no request fails.

crds/samples/autoscaling/ on the samples' Gateway: the pool's EPP runs flow control (`featureGates: [flowControl]`),
so a request for a pool with no endpoint waits in the EPP instead of failing, and the operator
(`--autoscale-interval-seconds 1`) reads that from the EPP's metrics.

KVGATE_AUTOSCALE_DEMO=1 runs the longer demonstration instead of skipping it: from zero, a light load, a load step
and the idle tail, with a timeline per 10 s (replicas, queue, TTFT p90) printed, written as JSON and drawn as a PNG
(KVGATE_AUTOSCALE_DEMO_OUT, default docs/img/autoscaling-timeline.png); docs/benchmarks.md records a run.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from autoscale_timeline import Timeline
from k8srig.kube import CORE, DEPLOYMENT, load_documents, wait_default_service_account, wait_for
from operator_run import (REPO, Stages, is_ready, print_log_tail, sample_namespace, sample_resources, start_operator,
                          stop_operator)

from kvgate.operator.autoscale_signals import parse_epp_page

pytestmark = pytest.mark.e2e

# crds/samples/autoscaling/: the flow-control EPP config, the pool naming it, the autoscaled ModelServer
AUTOSCALING_SAMPLE = {d["kind"]: d for d in load_documents((REPO / "crds" / "samples" / "autoscaling" /
                                                            "autoscaling.yaml").read_text())}
ENGINE_SELECTOR = "app=demo-llm"
EPP_SELECTOR = "app.kubernetes.io/name=kvgate-epp,app.kubernetes.io/instance=demo-pool"
ENVOY_SELECTOR = "app.kubernetes.io/name=kvgate-gateway,app.kubernetes.io/instance=inference-gateway"
ENVOY_ADMIN_PORT = 19000  # kvgate.operator.gateway.ADMIN_PORT: on the rig, the pod's own address


class Scene:
    """The samples at minReplicas 0 behind a flow-control EPP, the operator running; requests through Envoy."""

    def __init__(self, k8s, tmp_path, autoscaling: dict, max_replicas: int, tag: str) -> None:
        self.k8s, self.client = k8s, k8s.client
        self.mark = Stages(tag)
        self.ns, self.class_name, self.docs = sample_namespace(k8s, "e2e-autoscale")
        self.res = sample_resources(self.client)
        self.log_path = tmp_path / "operator.log"
        self.autoscaling, self.max_replicas = autoscaling, max_replicas
        self.operator = None
        self.envoy_url = ""
        self.epp_url = ""

    def pods(self, selector: str) -> list[dict]:
        return self.client.list(CORE["Pod"], self.ns, labelSelector=selector)["items"]

    def ready_ips(self, selector: str) -> list[str]:
        return [p["status"]["podIP"] for p in self.pods(selector) if is_ready(p)]

    def start(self) -> None:
        client, ns = self.client, self.ns
        wait_default_service_account(client, ns, token=True)
        self.operator = start_operator(self.k8s.kubeconfig, self.log_path, "--autoscale-interval-seconds", "1")
        config_map, pool, ms = (copy.deepcopy(AUTOSCALING_SAMPLE[k]) for k in ("ConfigMap", "InferencePool",
                                                                             "ModelServer"))
        for doc in (config_map, pool, ms):
            doc["metadata"]["namespace"] = ns
        ms["spec"].update(maxReplicas=self.max_replicas, autoscaling=self.autoscaling)
        for doc in (config_map, self.docs["GatewayClass"], pool, ms, self.docs["Gateway"], self.docs["HTTPRoute"]):
            client.apply(doc)
        self.mark("operator started; ModelServer at minReplicas 0 applied")

        def deployment_ready(name: str) -> bool:
            dep = client.get_or_none(DEPLOYMENT, name, ns)
            return bool(dep) and (dep.get("status") or {}).get("readyReplicas", 0) >= 1

        wait_for(lambda: deployment_ready("demo-pool-epp") and deployment_ready("inference-gateway-envoy"),
                 timeout_s=90, interval_s=0.5, what="the EPP and Envoy Deployments Ready")
        # the EPP rolled onto the flow-control config (its digest) and Envoy follows that EPP pod
        wait_for(lambda: len(self.ready_ips(EPP_SELECTOR)) == 1 and len(self.pods(EPP_SELECTOR)) == 1,
                 timeout_s=60, interval_s=0.5, what="one EPP pod, Ready")
        epp_ip = self.ready_ips(EPP_SELECTOR)[0]
        self.epp_url = f"http://{epp_ip}:9090/metrics"

        def envoy_knows_the_epp() -> str | None:
            """The one Envoy pod, once its clusters reach the EPP pod (its config follows the EPP's IP, and a
            request sent before would fail closed): its address. No request may probe it: one would be held."""
            ready = self.ready_ips(ENVOY_SELECTOR)
            if len(ready) != 1 or len(self.pods(ENVOY_SELECTOR)) != 1:
                return None
            try:
                clusters = httpx.get(f"http://{ready[0]}:{ENVOY_ADMIN_PORT}/clusters", timeout=5).text
            except httpx.HTTPError:
                return None
            return ready[0] if f"{epp_ip}:9002" in clusters else None

        envoy_ip = wait_for(envoy_knows_the_epp, timeout_s=60, interval_s=0.5, what="Envoy to reach the EPP")
        self.envoy_url = f"http://{envoy_ip}:8080"
        assert not self.pods(ENGINE_SELECTOR), "an engine pod runs at minReplicas 0"
        self.mark("EPP and Envoy Ready, no engine pod")

    def stop(self, failed: bool) -> None:
        if failed:
            print_log_tail(self.log_path)
        stop_operator(self.operator)
        self.client.delete(self.res["GatewayClass"], self.class_name)
        self.client.delete(CORE["Namespace"], self.ns)

    def replicas(self) -> tuple[int, int]:
        dep = self.client.get_or_none(DEPLOYMENT, "demo-llm", self.ns) or {}
        return int((dep.get("spec") or {}).get("replicas") or 0), int((dep.get("status") or {}).get("readyReplicas")
                                                                       or 0)

    def queue(self) -> float:
        """Requests waiting now, as the operator reads them: held by the EPP plus queued in the engines."""
        try:
            reading = parse_epp_page(httpx.get(self.epp_url, timeout=2).text)
        except (httpx.HTTPError, ValueError):
            return float("nan")
        return reading.held + reading.waiting

    def completion(self, http: httpx.Client, max_tokens: int) -> tuple[int | str, float | None]:
        """One streamed completion through Envoy: (status or error, seconds to the first token)."""
        start = time.monotonic()
        try:
            with http.stream("POST", f"{self.envoy_url}/v1/completions",
                             json={"model": "demo", "prompt": "Tell me about autoscaling", "max_tokens": max_tokens,
                                   "stream": True}) as r:
                ttft = None
                for line in r.iter_lines():
                    if ttft is None and line.startswith("data:") and line != "data: [DONE]":
                        ttft = time.monotonic() - start
                return r.status_code, ttft
        except httpx.HTTPError as exc:
            return type(exc).__name__, None

    def events(self) -> list[str]:
        return [e["reason"] for e in sorted(self.client.list(CORE["Event"], self.ns)["items"],
                                            key=lambda e: e.get("lastTimestamp") or "")
                if e["involvedObject"].get("kind") == "ModelServer"]


class Load:
    """`clients` closed-loop clients, each sending streamed completions until stopped."""

    def __init__(self, scene: Scene, timeline: Timeline, clients: int, max_tokens: int = 48) -> None:
        self.scene, self.timeline = scene, timeline
        self.stop_flag = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(max_tokens,), daemon=True) for _ in range(clients)]
        for t in self.threads:
            t.start()

    def _run(self, max_tokens: int) -> None:
        with httpx.Client(timeout=120) as http:
            while not self.stop_flag.is_set():
                start = time.monotonic()
                outcome, ttft = self.scene.completion(http, max_tokens)
                self.timeline.requests.append((start, outcome, ttft))

    def stop(self) -> None:
        self.stop_flag.set()
        for t in self.threads:
            t.join(timeout=130)


def sampler(scene: Scene, timeline: Timeline, stop: threading.Event) -> threading.Thread:
    def run() -> None:
        while not stop.wait(1.0):
            desired, ready = scene.replicas()
            timeline.samples.append((time.monotonic(), desired, ready, scene.queue()))
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def from_zero(scene: Scene, timeline: Timeline) -> float:
    """The first request, sent to a pool with no engine: held by the EPP, served once a replica is Ready."""
    with httpx.Client(timeout=120) as http:
        start = time.monotonic()
        outcome, ttft = scene.completion(http, 8)
    timeline.requests.append((start, outcome, ttft))
    assert outcome == 200 and ttft is not None, outcome
    return time.monotonic() - start


def test_autoscaling_from_zero_out_and_in(k8s, tmp_path):
    scene = Scene(k8s, tmp_path, {"targetWaitingPerReplica": 2, "scaleDownStabilizationSeconds": 4,
                                  "scaleDownDelaySeconds": 3}, max_replicas=3, tag="autoscale-e2e")
    failed = True
    stop_sampling = threading.Event()
    try:
        scene.start()
        timeline = Timeline(time.monotonic())
        sampler(scene, timeline, stop_sampling)
        first_s = from_zero(scene, timeline)
        scene.mark(f"first request served {first_s:.1f}s after it was sent to an empty pool")
        ms = scene.client.get(scene.res["ModelServer"], "demo-llm", scene.ns)
        assert ms["status"]["autoscaling"]["lastScaleUpTime"]
        assert "ScaledFromZero" in scene.events()

        load = Load(scene, timeline, clients=10)
        try:
            wait_for(lambda: scene.replicas()[1] >= 2, timeout_s=60, interval_s=0.5,
                     what="the load step to scale out to 2+ ready replicas")
            scene.mark(f"scaled out: {scene.replicas()} (desired, ready)")
        finally:
            load.stop()
        outcomes = Counter(r[1] for r in timeline.requests)
        scene.mark(f"load stopped: {dict(outcomes)}")
        wait_for(lambda: scene.replicas() == (0, 0), timeout_s=60, interval_s=0.5,
                 what="the idle pool to scale in to zero")
        scene.mark("scaled in to zero")
        stop_sampling.set()
        assert set(outcomes) == {200}, outcomes  # no request lost, the held first one included
        reasons = scene.events()
        assert {"ScaledFromZero", "ScaledUp", "ScaledToZero"} <= set(reasons), reasons
        ms = scene.client.get(scene.res["ModelServer"], "demo-llm", scene.ns)
        scaled = next(c for c in ms["status"]["conditions"] if c["type"] == "Scaled")
        assert scaled["reason"] in ("ScaledDown", "ScaledToZero"), scaled
        print(timeline.table())
        failed = False
    finally:
        stop_sampling.set()
        scene.stop(failed)


@pytest.mark.skipif(os.environ.get("KVGATE_AUTOSCALE_DEMO") != "1",
                    reason="the long autoscaling demonstration: set KVGATE_AUTOSCALE_DEMO=1")
def test_autoscaling_demonstration(k8s, tmp_path):
    scene = Scene(k8s, tmp_path, {"targetWaitingPerReplica": 2, "scaleDownStabilizationSeconds": 30,
                                  "scaleDownDelaySeconds": 20}, max_replicas=4, tag="autoscale-demo")
    out = Path(os.environ.get("KVGATE_AUTOSCALE_DEMO_OUT", REPO / "docs" / "img" / "autoscaling-timeline.png"))
    failed = True
    stop_sampling = threading.Event()
    try:
        scene.start()
        timeline = Timeline(time.monotonic())
        sampler(scene, timeline, stop_sampling)
        timeline.mark(time.monotonic(), "first request")
        first_s = from_zero(scene, timeline)
        scene.mark(f"first request served after {first_s:.1f}s")
        timeline.mark(time.monotonic(), "2 clients")
        light = Load(scene, timeline, clients=2)
        time.sleep(30)
        timeline.mark(time.monotonic(), "step: 14 clients")
        step = Load(scene, timeline, clients=12)
        time.sleep(90)
        step.stop()
        light.stop()
        timeline.mark(time.monotonic(), "load ends")
        scene.mark("load ended")
        wait_for(lambda: scene.replicas() == (0, 0), timeout_s=180, interval_s=1, what="scale-in to zero")
        time.sleep(5)
        stop_sampling.set()
        outcomes = Counter(r[1] for r in timeline.requests)
        table = timeline.table()
        print(table)
        print(f"outcomes: {dict(outcomes)}; events: {Counter(scene.events())}")
        out.parent.mkdir(parents=True, exist_ok=True)
        timeline.plot(out, "kvgate operator autoscaling, sim engines on the e2e rig (maxNumSeqs 2, target 2 "
                           "waiting/replica)")
        out.with_suffix(".json").write_text(json.dumps({"rows": timeline.rows(), "outcomes": {str(k): v for k, v in
                                                                                              outcomes.items()},
                                                        "first_request_s": first_s, "marks": timeline.marks},
                                                       indent=1))
        assert set(outcomes) == {200}, outcomes
        failed = False
    finally:
        stop_sampling.set()
        scene.stop(failed)
