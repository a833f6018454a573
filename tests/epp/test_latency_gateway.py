"""predicted-latency-scorer through a real gateway (Envoy + `kvgate epp` + sim engines): streamed responses teach
the EPP its latency model (first tokens timed on the response path, TPOT from the usage chunk), objectives are
counted, and the EPP exports how well it predicted."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from openai import OpenAI

from tests.epp.test_stock_envoy import stock_envoy
from tests.gateway import Gateway

pytestmark = pytest.mark.processes

CONFIG = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
- type: predicted-latency-scorer
- type: max-score-picker
"""
SIM = ["--backend", "sim", "--sim-step-overhead-ms", "4", "--sim-decode-ms-per-seq", "0.5",
       "--sim-prefill-ms-per-token", "0.05"]


def counter(text: str, name: str, label: str) -> float:
    match = re.search(rf'^{name}_total\{{[a-z]+="{label}"\}} ([0-9.e+-]+)$', text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("envoy", ["kvgate", "stock"])
def test_streamed_responses_train_the_latency_model(tmp_path, envoy):
    """Behind kvgate's Envoy config and behind upstream's stock one (ext_proc streaming the response body)."""
    (tmp_path / "logs").mkdir()
    # One replica three times slower than the other: the learned model sees it in its TTFTs.
    with Gateway(tmp_path / "logs", tmp_path / "cache", [SIM, [*SIM, "--sim-slowdown", "3"]],
                 epp_args=["--config-text", CONFIG], envoy_config=stock_envoy if envoy == "stock" else None) as gw:
        client = OpenAI(base_url=f"{gw.url}/v1", api_key="none", timeout=60, max_retries=0)
        streamed = 0
        for i in range(24):
            headers = {"x-slo-ttft-ms": "5000"} if i % 2 else {}
            if i == 5:
                headers = {"x-slo-ttft-ms": "soon"}  # not a number: ignored, counted as bad
            stream = client.completions.create(model="sim-model", prompt=f"tell me story {i} " * 20, max_tokens=8,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_headers=headers)
            chunks = list(stream)
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
            streamed += 1
        # A non-streamed answer arrives whole: it cannot time a first token, so it teaches nothing.
        assert client.completions.create(model="sim-model", prompt="once", max_tokens=4).choices[0].text
        deadline = time.monotonic() + 10
        while True:  # the last response's release reaches the scorer just after the client has read it
            text = gw.epp.metrics()
            if counter(text, "kvgate_epp_latency_observations", "ttft") >= streamed or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert counter(text, "kvgate_epp_latency_observations", "ttft") == streamed
        assert counter(text, "kvgate_epp_latency_observations", "tpot") == streamed
        measured = counter(text, "kvgate_epp_latency_measured_seconds", "ttft")
        assert 0 < measured / streamed < 2.0  # seconds a first token took, on average: a real duration
        error = counter(text, "kvgate_epp_latency_prediction_abs_error_seconds", "ttft")
        assert error < measured  # the predictions are on the scale of what was measured
        assert counter(text, "kvgate_epp_latency_objectives", "stated") == 11
        assert counter(text, "kvgate_epp_latency_objectives", "bad") == 1
        assert counter(text, "kvgate_epp_latency_objectives", "met") == 11  # 5 s is generous
        r = httpx.post(f"{gw.url}/v1/completions", json={"model": "sim-model", "prompt": "x", "max_tokens": 2},
                       timeout=30)
        assert r.status_code == 200
