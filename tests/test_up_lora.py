"""Adapters behind `kvgate up`, as a user runs it: two sim engines serving LoRA adapters a and b (one slot each,
`--max-loras 1`), the EPP on the lora-affinity-scorer, and an InferenceModelRewrite (`--manifests`) that splits
the public name "support" 70/30 across the adapters. A request for the adapter an engine is running goes to that
engine while it has room; the other adapter goes to the other engine; the split holds within ±10 points over 200
requests."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.procs import free_port, stop_group
from tests.test_up import read_until_up, start_up

pytestmark = pytest.mark.processes

SERVED_BY = "x-kvgate-endpoint"
LORA_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: lora-affinity-scorer
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: lora-affinity-scorer
    weight: 2
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""
REWRITE = """\
apiVersion: inference.networking.x-k8s.io/v1alpha2
kind: InferenceModelRewrite
metadata:
  name: support
spec:
  poolRef:
    name: local
  rules:
  - matches:
    - model:
        value: support
    targets:
    - modelRewrite: a
      weight: 70
    - modelRewrite: b
      weight: 30
"""


def _adapter(folder) -> str:
    folder.mkdir()  # the sim reads an adapter's config (its rank) and has no weights to apply
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                            "target_modules": ["q_proj", "v_proj"]}))
    return str(folder)


def test_lora_affinity_and_a_rewritten_name_split_across_adapters(tmp_path):
    (tmp_path / "epp.yaml").write_text(LORA_CONFIG)
    (tmp_path / "rewrites.yaml").write_text(REWRITE)
    a, b = _adapter(tmp_path / "a"), _adapter(tmp_path / "b")
    port = free_port()
    engine = ["--enable-lora", "--max-loras", "1", "--lora-modules", f"a={a}", f"b={b}", "--sim-slowdown", "5"]
    proc = start_up(tmp_path, port, "--backend", "sim", "--config-file", str(tmp_path / "epp.yaml"),
                    "--manifests", str(tmp_path / "rewrites.yaml"), *(f"--engine-arg={arg}" for arg in engine))
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        assert "Ctrl-C stops everything" in read_until_up(proc, 120)
        streams, served = {}, {}

        def long_stream(model: str, started: threading.Event) -> None:
            with httpx.stream("POST", url, timeout=120, json={
                    "model": model, "prompt": f"a long {model} answer", "max_tokens": 300, "ignore_eos": True,
                    "stream": True}) as r:
                served[model] = r.headers.get(SERVED_BY)
                started.set()
                streams[model] = (r.status_code, "".join(r.iter_text()))

        threads = []
        for model in ("a", "b"):  # one long request per adapter: each engine's one slot is taken
            started = threading.Event()
            threads.append(threading.Thread(target=long_stream, args=(model, started)))
            threads[-1].start()
            assert started.wait(30), model
            time.sleep(0.5)  # several of the EPP's 50 ms scrapes: it sees the adapter running there
        assert served["a"] != served["b"], served  # b could not run where a holds the only slot

        counts = {model: Counter() for model in ("a", "b")}
        for i in range(12):
            for model in ("a", "b"):
                r = httpx.post(url, json={"model": model, "prompt": f"short {i}", "max_tokens": 2}, timeout=60)
                assert r.status_code == 200 and r.json()["model"] == model, r.text
                counts[model][r.headers[SERVED_BY]] += 1
        assert counts["a"][served["a"]] >= 11 and counts["b"][served["b"]] >= 11, counts  # the engine running it

        def support(i: int) -> str:
            r = httpx.post(url, json={"model": "support", "prompt": f"help {i}", "max_tokens": 1}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["model"]

        with ThreadPoolExecutor(8) as pool:
            split = Counter(pool.map(support, range(200)))
        assert set(split) == {"a", "b"} and 120 <= split["a"] <= 160, split  # 70% ± 10 points of 200
        for t in threads:
            t.join(60)
        assert all(code == 200 and "[DONE]" in body for code, body in streams.values())
    finally:
        stop_group(proc, timeout=60)  # kvgate up stops everything on SIGTERM as on Ctrl-C

