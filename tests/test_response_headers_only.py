"""A pool's routes send its EPP only what its config reads of a response: nothing (the default configs), the headers
(the served-endpoint verifier), or the streamed body (a plugin that learns from bodies). Through the real Envoy and
`kvgate epp` (`kvgate up`'s stack on sim engines) a streamed completion arrives whole, the EPP holds the request
until the response has ended and then releases it, and it sees the body (counts its usage) only in the last mode."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest

from kvgate.common.envoy_config import (REQUEST_ONLY, RESPONSE_HEADERS_ONLY, SHARED_EXT_PROC, PoolBackend,
                                        ext_proc_route_config)
from kvgate.epp.scheduling.config import DEFAULT_CONFIG_YAML, KVGATE_PROFILE_YAML, parse_config
from kvgate.common.processes import free_port
from kvgate.stack.local_stack import StackSpec, launch_local_stack
from kvgate.stack.supervisor import Stack

LEARNING_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: predicted-latency-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: predicted-latency-scorer
  - pluginRef: max-score-picker
"""


SERVED_VERIFIER_CONFIG = DEFAULT_CONFIG_YAML.replace("plugins:\n", "plugins:\n- type: destination-endpoint-served-verifier\n", 1)


def test_what_each_config_reads_of_a_response():
    assert parse_config(DEFAULT_CONFIG_YAML).response_needs == "none"
    assert parse_config(KVGATE_PROFILE_YAML).response_needs == "none"
    assert parse_config(SERVED_VERIFIER_CONFIG).response_needs == "headers"  # it reports from the response headers
    assert parse_config(LEARNING_CONFIG).response_needs == "body"  # it learns from first-token times and usage
    overrides = lambda pool: ext_proc_route_config(pool)[SHARED_EXT_PROC]["config"]["overrides"]  # noqa: E731
    assert "processing_mode" not in overrides(PoolBackend("p", "127.0.0.1", 9002))  # upstream's: bodies stream
    assert overrides(PoolBackend("p", "127.0.0.1", 9002, response="headers"))["processing_mode"] == \
        RESPONSE_HEADERS_ONLY
    assert overrides(PoolBackend("p", "127.0.0.1", 9002, response="none"))["processing_mode"] == REQUEST_ONLY
    with pytest.raises(ValueError, match="not one of"):
        ext_proc_route_config(PoolBackend("p", "127.0.0.1", 9002, response="trailers"))


def _epp_lines(metrics_port: int, prefix: str) -> list[str]:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    return [line for line in text.splitlines() if line.startswith(prefix)]


def _in_flight(metrics_port: int) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in _epp_lines(metrics_port, "kvgate_epp_endpoint_in_flight"))


def _stream(url: str, max_tokens: int) -> tuple[int, int, dict | None]:
    """One streamed completion with usage: (status, token events, usage)."""
    body = {"model": "sim-model", "prompt": "hello", "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    events, usage = 0, None
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                events += bool(chunk.get("choices"))
                usage = chunk.get("usage") or usage
    return r.status_code, events, usage


def _check(tmp_path, config: str | None, body_through_epp: bool, headers_through_epp: bool) -> None:
    stack = Stack(tmp_path)
    try:
        up = launch_local_stack(stack, StackSpec(
            replicas=1, model="sim-model", backend="sim", host="127.0.0.1", port=free_port(),
            epp_config_text=config, startup_timeout=120,
            engine_args=["--sim-decode-ms-per-seq", "15"]))  # ~1.5 s of 100 tokens
        rendered = json.dumps(json.loads((stack.workdir / "envoy.json").read_text()))
        assert ('"response_body_mode": "NONE"' in rendered) is not body_through_epp
        assert ('"response_header_mode": "SKIP"' in rendered) is not headers_through_epp
        seen: list[float] = []
        done = threading.Event()

        def watch() -> None:  # the EPP's in-flight count while the response streams
            while not done.is_set():
                seen.append(_in_flight(up.metrics_port))
                done.wait(0.1)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            status, events, usage = _stream(up.url, 100)
        finally:
            done.set()
            watcher.join(10)
        assert status == 200 and events == 100 and usage["completion_tokens"] == 100, (status, events, usage)
        assert max(seen) == 1.0, seen  # held while the body streamed past the EPP or around it
        deadline = time.monotonic() + 5
        while _in_flight(up.metrics_port) != 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _in_flight(up.metrics_port) == 0  # released once the response ended
        counted = [line for line in _epp_lines(up.metrics_port, "kvgate_epp_tokens_total")
                   if re.search(r'kind="completion"\} 100\.0$', line)]
        assert bool(counted) is body_through_epp, counted  # usage is read from a body the EPP saw
    finally:
        stack.stop()


@pytest.mark.processes
def test_nothing_of_the_response_when_the_config_reads_none(tmp_path):
    _check(tmp_path, None, body_through_epp=False, headers_through_epp=False)  # StackSpec's default: upstream's profile


@pytest.mark.processes
def test_bodies_stream_through_the_epp_when_a_plugin_learns_from_them(tmp_path):
    _check(tmp_path, LEARNING_CONFIG, body_through_epp=True, headers_through_epp=True)


def test_the_epp_says_once_when_a_plugin_wants_bodies_that_bypass_it(caplog, monkeypatch):
    """A route that sends the EPP headers only, in front of a config that learns from bodies (a gateway kvgate did not
    render): the EPP logs it once, and a response whose body did pass through says nothing."""
    from types import SimpleNamespace

    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from kvgate.epp import extproc
    from kvgate.epp.types import LLMRequest

    monkeypatch.setattr(extproc, "_body_bypass_warned", False)
    released = []
    director = SimpleNamespace(scheduler=SimpleNamespace(reads_response_body=True),
                               release=lambda *args: released.append(args))

    def respond(body: bool) -> None:
        stream = extproc._RequestStream(director, None)
        stream.request = LLMRequest(request_id="r", model="m", target_model="m", prompt="p")
        stream.picked = "10.0.0.1:8000"
        stream.handle(pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=False)))
        if body:
            stream.handle(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: {}\n\n", end_of_stream=True)))
        stream.release()  # the ext-proc stream ended

    respond(body=True)
    assert not [r for r in caplog.records if "no response bodies" in r.getMessage()]
    respond(body=False)
    respond(body=False)
    warned = [r for r in caplog.records if "no response bodies" in r.getMessage()]
    assert len(warned) == 1 and warned[0].levelname == "WARNING"
    assert len(released) == 3  # every request released all the same
    monkeypatch.setattr(extproc, "_body_bypass_warned", False)
    director.scheduler.reads_response_body = False  # nothing wants the body: nothing to say
    respond(body=False)
    assert len([r for r in caplog.records if "no response bodies" in r.getMessage()]) == 1
