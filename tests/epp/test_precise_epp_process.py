"""`kvgate epp` with precise-prefix-cache-scorer as a real process: `--kv-events-port`/`--kv-events-replay-port`
make it subscribe to each endpoint's engine (tcp://<endpoint ip>:PORT), and it routes a prompt to the engine
that holds it. Two sim engines on one machine need two IPs for one event port: one is reached over IPv4
loopback (its PUB bound on ::ffff:127.0.0.1), the other over IPv6 loopback."""

from __future__ import annotations

import json
import time

import grpc
import httpx
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
import pytest

from tests.engine.test_kv_events import free_port_v6
from tests.epp.test_extproc_grpc import body_msgs, destination, headers_msg, run
from tests.gateway import EPP
from tests.procs import KvgateServe, free_port

pytestmark = pytest.mark.processes

CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
  parameters: {speculativeTTL: 0}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins: [{pluginRef: precise-prefix-cache-scorer, weight: 1}, {pluginRef: max-score-picker}]
"""


def engine(cache, host: str, port: int, events_host: str, pub: int, replay: int) -> KvgateServe:
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://[{events_host}]:{pub}",
              "replay_endpoint": f"tcp://[{events_host}]:{replay}", "topic": "kv-events"}
    server = KvgateServe("sim-model", "--backend", "sim", "--kv-events-config", json.dumps(config), host=host,
                         port=port, cache_dir=cache)
    server.url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    return server


def test_the_epp_routes_each_prompt_to_the_engine_whose_events_announced_it(tmp_path):
    pub, replay = free_port(), free_port()  # free on 127.0.0.1; ::1 is a different socket space
    engines = [engine(tmp_path, "127.0.0.1", free_port(), "::ffff:127.0.0.1", pub, replay),
               engine(tmp_path, "::1", free_port_v6(), "::1", pub, replay)]
    addresses = [f"127.0.0.1:{engines[0].port}", f"[::1]:{engines[1].port}"]
    epp = None
    try:
        for e in engines:
            e.wait_ready()
        epp = EPP(tmp_path, addresses, extra=["--config-text", CONFIG, "--kv-events-port", str(pub),
                                              "--kv-events-replay-port", str(replay), "--kv-events-topic",
                                              "kv-events"])
        with grpc.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as channel:
            stub = pb_grpc.ExternalProcessorStub(channel)
            for i in range(6):
                warm = i % 2
                prompt = f"tenant {i} system prompt: " + "lorem ipsum dolor " * 20
                r = httpx.post(engines[warm].url + "/v1/completions",
                               json={"model": "sim-model", "prompt": prompt, "max_tokens": 2}, timeout=30)
                assert r.status_code == 200, r.text
                body = json.dumps({"model": "sim-model", "prompt": prompt + " and a question", "max_tokens": 2})
                deadline = time.monotonic() + 10
                while True:  # the events arrive within milliseconds; allow a loaded machine some seconds
                    out = run(stub, [headers_msg({":path": "/v1/completions"}), *body_msgs(body.encode(), 1)])
                    if destination(out[0]) == addresses[warm]:
                        break
                    assert time.monotonic() < deadline, f"prompt {i} not routed to its engine:\n{epp.log()}"
                    time.sleep(0.1)
                # once the events are in, every decision goes there (by chance: 1 in 2^8)
                picks = {destination(run(stub, [headers_msg({":path": "/v1/completions"}),
                                                *body_msgs(body.encode(), 1)])[0]) for _ in range(8)}
                assert picks == {addresses[warm]}, (i, picks)
    finally:
        if epp is not None:
            epp.stop()
        for e in engines:
            e.stop()
