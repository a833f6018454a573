"""A ModelServer of `engine.type: vllm` on the rig: a real vLLM (the CPU build, in the rig's own venv:
tests/e2e/k8s/build-vllm) beside a kvgate ModelServer in one InferencePool, both loading the demo model (a small
random Llama built locally) from a hostPath volume, behind the Gateway's Envoy and the pool's EPP with precise
prefix routing on the engines' own KV events.

Each engine is warmed directly (not through the Gateway) with the long prefixes of some prompt groups: the EPP never
picked those requests, so only the engine's KV events can tell it where the prefixes are. Then every group's
requests go through the Gateway; each must land on the engine that holds its prefix. Printed: the hit rate (requests
landing on the holder), requests per pod, vLLM's own prefix-cache hit rate, and the start-up times.

vLLM on CPU takes about a minute to start (its model compiled), so the test is opt-in: KVGATE_E2E_VLLM=1.
"""
from __future__ import annotations

import json
import os
import random
import re
import string
import time
from collections import Counter

import httpx
import pytest
from k8srig import vllm_venv
from k8srig.kube import CORE, delete_namespace, wait_default_service_account, wait_for
from operator_run import (Stages, is_ready, pod_story, print_log_tail, sample_namespace, sample_resources,
                          start_operator, stop_operator)

pytestmark = [pytest.mark.e2e, pytest.mark.skipif(os.environ.get("KVGATE_E2E_VLLM") != "1",
                                                  reason="vLLM on CPU takes a minute to start: set KVGATE_E2E_VLLM=1")]

VLLM_IMAGE = "vllm/vllm-openai:v0.32.0"
BLOCK = 32  # vLLM's CPU attention takes block sizes that are multiples of 32; the kvgate engine any
GROUPS_PER_ENGINE = 3
REQUESTS_PER_GROUP = 4
PREFIX_CHARS = 640  # the demo tokenizer is byte-level: 640 tokens, 20 blocks
# Precise prefix routing with the queue as a tie-breaker: the profile that shows what the KV events say (the pool's
# default, kvgate's profile, scores them too, beside load-aware filters).
PRECISE_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: precise-prefix-cache-scorer
    weight: 3
  - pluginRef: queue-scorer
    weight: 1
  - pluginRef: max-score-picker
"""


def _modelservers(base: dict, model_dir: str) -> tuple[dict, dict]:
    model = {"path": "/models/demo", "servedModelName": "demo", "hostPath": {"path": model_dir}}
    common = {"blockSize": BLOCK, "maxModelLen": 2048, "enablePrefixCaching": True, "kvCacheMemory": "256Mi"}
    kvgate = json.loads(json.dumps(base))
    kvgate["metadata"]["name"] = "demo-kvgate"
    kvgate["spec"].update(replicas=1, model=model, engine={**common, "device": "cpu",
                                                           "kvEvents": {"port": 5557, "replayPort": 5558}})
    vllm = json.loads(json.dumps(base))
    vllm["metadata"]["name"] = "demo-vllm"
    # The rig's pods share the host's interfaces and both engines bind their KV-event sockets on every interface
    # (tcp://*): different ports per ModelServer (the EPP reads each pod's from its annotations).
    vllm["spec"].update(replicas=1, model=model, engine={**common, "type": "vllm",
                                                         "kvEvents": {"port": 5567, "replayPort": 5568}})
    return kvgate, vllm


def _prefix(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase + " ") for _ in range(PREFIX_CHARS))


def _metric(text: str, name: str) -> float:
    """The sum of a metric's series in a Prometheus page (0 when absent)."""
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_vllm_modelserver_serves_through_the_gateway_with_precise_prefix_routing(k8s, tmp_path):
    from kvgate.common.demo import ensure_demo_model

    try:
        vllm_python, installed_s = vllm_venv.ensure_python()
    except vllm_venv.VllmUnavailable as exc:
        pytest.skip(f"vLLM cannot be installed for the rig here: {exc}")
    mark = Stages("vllm-e2e")
    mark(f"vLLM venv {vllm_python}" + (f" installed in {installed_s:.0f}s" if installed_s else " (cached)"))
    client = k8s.client
    ns, class_name, docs = sample_namespace(k8s, "e2e-vllm")
    res = sample_resources(client)
    model_dir = str(ensure_demo_model())
    kvgate_ms, vllm_ms = _modelservers(docs["ModelServer"], model_dir)
    pool = docs["InferencePool"]
    pool["metadata"].setdefault("annotations", {})["kvgate.dev/epp-config"] = "precise-config/config.yaml"
    log_path = tmp_path / "operator.log"
    operator = None
    try:
        wait_default_service_account(client, ns, token=True)
        operator = start_operator(k8s.kubeconfig, log_path, "--allow-host-path", "--vllm-image", VLLM_IMAGE)
        client.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "precise-config", "namespace": ns},
                      "data": {"config.yaml": PRECISE_CONFIG}})
        for doc in (docs["GatewayClass"], pool, kvgate_ms, vllm_ms, docs["Gateway"], docs["HTTPRoute"]):
            client.apply(doc)
        mark("operator started; pool, ModelServers demo-kvgate and demo-vllm, Gateway and route applied")

        def ready_ips(selector: str) -> list[str]:
            return [p["status"]["podIP"] for p in client.list(CORE["Pod"], ns, labelSelector=selector)["items"]
                    if is_ready(p)]

        engines = {"kvgate": "app.kubernetes.io/instance=demo-kvgate", "vllm": "app.kubernetes.io/instance=demo-vllm"}
        try:
            wait_for(lambda: ready_ips(engines["kvgate"]), timeout_s=300, interval_s=1, what="the kvgate engine Ready")
            mark("kvgate engine Ready")
            wait_for(lambda: ready_ips(engines["vllm"]), timeout_s=600, interval_s=1, what="the vLLM engine Ready")
            mark("vLLM engine Ready")
        except TimeoutError:
            print(pod_story(k8s, ns, "app=demo-llm"))
            raise
        ip = {kind: ready_ips(selector)[0] for kind, selector in engines.items()}
        vllm_pod = client.list(CORE["Pod"], ns, labelSelector=engines["vllm"])["items"][0]
        assert vllm_pod["metadata"]["labels"]["inference.networking.k8s.io/engine-type"] == "vllm"
        assert vllm_pod["metadata"]["labels"]["kvgate.dev/pool"] == "demo-pool"
        assert "vllm:num_requests_running" in httpx.get(f"http://{ip['vllm']}:8000/metrics", timeout=10).text

        epp_selector = "app.kubernetes.io/name=kvgate-epp,app.kubernetes.io/instance=demo-pool"
        wait_for(lambda: ready_ips(epp_selector), timeout_s=120, interval_s=1, what="the EPP Ready")
        epp_ip = ready_ips(epp_selector)[0]

        def epp_metrics() -> str:
            return httpx.get(f"http://{epp_ip}:9090/metrics", timeout=5).text

        wait_for(lambda: _metric(epp_metrics(), "kvgate_epp_kv_events_subscribed_endpoints") == 2, timeout_s=60,
                 interval_s=1, what="the EPP subscribed to both engines' KV events")
        envoy_selector = "app.kubernetes.io/name=kvgate-gateway,app.kubernetes.io/instance=inference-gateway"
        wait_for(lambda: ready_ips(envoy_selector), timeout_s=120, interval_s=1, what="the Envoy Ready")
        envoy = f"http://{ready_ips(envoy_selector)[0]}:8080"
        mark("EPP subscribed to both engines' KV events; Envoy Ready")

        http = httpx.Client(timeout=120)

        def complete(base: str, prompt: str) -> httpx.Response:
            return http.post(f"{base}/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": 4})

        def gateway_serves() -> bool:
            try:
                return complete(envoy, "Hello").status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(gateway_serves, timeout_s=120, interval_s=1, what="a completion through the Gateway")

        # Warm each engine directly with its groups' prefixes (the EPP sees none of these requests).
        rng = random.Random(54)
        holder = {}
        for kind in ("vllm", "kvgate"):
            for _ in range(GROUPS_PER_ENGINE):
                prefix = _prefix(rng)
                r = complete(f"http://{ip[kind]}:8000", prefix + " warm")
                assert r.status_code == 200, r.text[:300]
                holder[prefix] = kind
        blocks_needed = len(holder) * (PREFIX_CHARS // BLOCK)
        wait_for(lambda: _metric(epp_metrics(), "kvgate_epp_precise_index_blocks") >= blocks_needed, timeout_s=60,
                 interval_s=0.5, what=f"the EPP's index to hold the warmed prefixes ({blocks_needed} blocks)")
        mark(f"warmed {len(holder)} prefixes directly on the engines; the EPP indexed them from their KV events")

        def served(kind: str) -> float:  # requests the engine finished (vLLM's counter; the kvgate engine's too)
            return _metric(httpx.get(f"http://{ip[kind]}:8000/metrics", timeout=10).text,
                           "vllm:request_success_total")

        # Where each request was served: the engine whose finished-requests counter moved (requests go one at a
        # time); the kvgate engine also names itself in its x-kvgate-endpoint header, vLLM has no such header.
        landed: list[tuple[str, str]] = []  # (holder, where the Gateway's request was served)
        for round_ in range(REQUESTS_PER_GROUP):
            for prefix, kind in holder.items():
                before = {k: served(k) for k in ip}
                r = complete(envoy, prefix + f" question {round_}")
                assert r.status_code == 200, r.text[:300]
                moved = wait_for(lambda: [k for k in ip if served(k) > before[k]], timeout_s=10, interval_s=0.1,
                                 what="an engine's finished-requests counter to move")
                assert len(moved) == 1, moved
                if "x-kvgate-endpoint" in r.headers:
                    assert moved == ["kvgate"] and r.headers["x-kvgate-endpoint"].startswith(ip["kvgate"] + ":")
                landed.append((kind, moved[0]))
        hits = sum(1 for want, got in landed if want == got)
        per_pod = Counter(got for _, got in landed)
        vllm_metrics = httpx.get(f"http://{ip['vllm']}:8000/metrics", timeout=10).text
        vllm_hit = _metric(vllm_metrics, "vllm:prefix_cache_hits_total") / max(
            1.0, _metric(vllm_metrics, "vllm:prefix_cache_queries_total"))
        mark(f"through the Gateway: {len(landed)} requests, {hits} on the engine holding their prefix "
             f"(hit rate {hits / len(landed):.2f}); requests per pod {dict(per_pod)}; vLLM's own prefix-cache "
             f"hit rate {vllm_hit:.2f} (tokens, warm-up included)")
        assert hits == len(landed), landed
        assert per_pod["vllm"] == per_pod["kvgate"] == GROUPS_PER_ENGINE * REQUESTS_PER_GROUP
        assert vllm_hit > 0.4  # the Gateway's requests reused the warmed prefix in vLLM itself
    except Exception:
        print_log_tail(log_path)
        raise
    finally:
        stop_operator(operator)
        delete_namespace(client, ns, wait_gone=False)  # waits for the engine pods' processes to end
        client.delete(res["GatewayClass"], class_name)
