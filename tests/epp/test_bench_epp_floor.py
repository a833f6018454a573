"""`kvgate bench epp --parts floor`: the do-nothing ext-proc servers answer exactly what kvgate's EPP answers (the same
messages, in every processing mode), and the floor part runs every installed server behind one Envoy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kvgate.bench.epp_floor import EPP, NO_EXT_PROC, FloorPath, render_floor_envoy, summarize
from kvgate.bench.extproc_noop import IMPLEMENTATIONS
from kvgate.bench.extproc_noop.replies import NoopStream, routing

KVGATE = str(Path(sys.executable).parent / "kvgate")
DESTINATION = "127.0.0.1:8000"
MODE = processing_mode_pb2.ProcessingMode
BODY = json.dumps({"model": "m", "prompt": "hello there", "max_tokens": 1}).encode()


def _stream_messages(request_mode: int, response_mode: int, trailers: bool = False,
                     response_headers: bool = True) -> list[pb.ProcessingRequest]:
    """What Envoy sends for one request whose body comes in two chunks and whose answer streams two chunks."""
    headers = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                                          base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")])
    half = len(BODY) // 2
    messages = [pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers),
                                     protocol_config=pb.ProtocolConfiguration(request_body_mode=request_mode,
                                                                              response_body_mode=response_mode))]
    if request_mode == MODE.FULL_DUPLEX_STREAMED:
        messages.append(pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY[:half])))
        messages.append(pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY[half:], end_of_stream=not trailers)))
    else:
        messages.append(pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=not trailers)))
    if trailers:
        messages.append(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    if response_headers:
        messages.append(pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=headers)))
    if response_mode != MODE.NONE:
        messages.append(pb.ProcessingRequest(response_body=pb.HttpBody(body=b'{"choices": [{"text": "x"}]')))
        messages.append(pb.ProcessingRequest(response_body=pb.HttpBody(
            body=b', "usage": {"prompt_tokens": 3, "completion_tokens": 1}}', end_of_stream=True)))
    messages.append(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
    return messages


CASES = {  # name: (request body mode, response body mode, trailers[, response headers sent])
    "full": (MODE.FULL_DUPLEX_STREAMED, MODE.FULL_DUPLEX_STREAMED, False),
    "headers-only-response": (MODE.FULL_DUPLEX_STREAMED, MODE.NONE, False),
    "request-only": (MODE.FULL_DUPLEX_STREAMED, MODE.NONE, False, False),
    "body-ending-in-trailers": (MODE.FULL_DUPLEX_STREAMED, MODE.FULL_DUPLEX_STREAMED, True),
    "buffered": (MODE.BUFFERED, MODE.BUFFERED, False),
}


def _noop_answers(messages: list[pb.ProcessingRequest]) -> list[list[pb.ProcessingResponse]]:
    stream = NoopStream(routing(DESTINATION))
    return [stream.handle(m) for m in messages]


@pytest.mark.parametrize("case", list(CASES))
def test_the_do_nothing_answers_are_the_epps_message_for_message(case):
    """kvgate's own EPP stream (a real Director, one endpoint) and the do-nothing one, fed the same messages, send
    equal messages at each step: the floor differs from the EPP only in the work, not in the protocol."""
    from kvgate.epp.admission import Admission
    from kvgate.epp.datalayer import Datalayer
    from kvgate.epp.datastore import Datastore
    from kvgate.epp.director import Director
    from kvgate.epp.extproc import _RequestStream
    from kvgate.epp.scheduling.config import default_config
    from kvgate.epp.scheduling.framework import Scheduler
    from kvgate.epp.types import Endpoint

    layer = Datalayer(interval=60)
    layer.set_endpoints([Endpoint(DESTINATION)])
    director = Director(Datastore(), layer, Scheduler(default_config().scheduler), Admission(),
                        trust_pool_readiness=True)
    messages = _stream_messages(*CASES[case])
    epp = _RequestStream(director, None)
    epp_answers = [epp.handle(m) for m in messages]
    assert epp.picked == DESTINATION
    assert _noop_answers(messages) == epp_answers
    assert sum(map(len, epp_answers)) >= len(messages) - 2  # (full duplex: the first body chunk is answered later)


def test_one_envoy_routes_each_path_by_header_through_the_gateways_pool_routes():
    from kvgate.common.envoy_config import PoolBackend, RESPONSE_HEADERS_ONLY, SHARED_EXT_PROC

    paths = [FloorPath(NO_EXT_PROC)]
    for mode in ("full", "headers-only-response"):
        paths.append(FloorPath(f"grpc-aio/{mode}", "grpc-aio", mode,
                               PoolBackend(f"grpc-aio-{mode}", "127.0.0.1", 9000, [DESTINATION])))
    config = render_floor_envoy(paths, 8080, 8081)
    routes = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"][
        "route_config"]["virtual_hosts"][0]["routes"]
    by_path = {}
    for route in routes:
        (header,) = route["match"]["headers"]
        by_path.setdefault(header["string_match"]["exact"], []).append(route)
    assert set(by_path) == {p.name for p in paths}
    (direct,) = by_path[NO_EXT_PROC]
    assert direct["route"]["cluster"] == "direct" and "typed_per_filter_config" not in direct
    for mode, expected in (("full", None), ("headers-only-response", RESPONSE_HEADERS_ONLY)):
        picked, failopen = by_path[f"grpc-aio/{mode}"]  # the gateway's two routes: the EPP's pick, then FailOpen
        for route in (picked, failopen):
            overrides = route["typed_per_filter_config"][SHARED_EXT_PROC]["config"]["overrides"]
            assert overrides["grpc_service"]["envoy_grpc"]["cluster_name"] == f"epp-grpc-aio-{mode}"
            assert overrides.get("processing_mode") == expected
    clusters = {c["name"] for c in config["static_resources"]["clusters"]}
    assert {"direct", "epp-grpc-aio-full", "pool-grpc-aio-full", "epp-grpc-aio-headers-only-response"} <= clusters


def test_summary_adds_over_the_no_ext_proc_path_with_an_interval_and_rounds():
    rng = np.random.default_rng(1)
    paths = [FloorPath(NO_EXT_PROC), FloorPath("a/full", "a", "full"), FloorPath(f"{EPP}/full", EPP, "full")]
    offsets = [0.010, 0.011, 0.013]
    results = [(k, 200, offsets[k] + rng.normal(0, 0.0002)) for k in rng.permutation(np.resize(np.arange(3), 600))]
    results[5] = (1, 503, 0.001)
    out = summarize(paths, results, seed=0, rounds=5)
    a, epp = out["paths"]["a/full"], out["paths"][f"{EPP}/full"]
    assert a["errors"] == {"503": 1} and a["ok"] == a["sent"] - 1
    assert a["added_p50_ms"] == pytest.approx(1.0, abs=0.1) and epp["added_p50_ms"] == pytest.approx(3.0, abs=0.1)
    lo, hi = a["added_p50_ci95_ms"]
    assert lo < a["added_p50_ms"] < hi and hi - lo < 0.2
    assert len(a["added_p50_ms_per_round"]) == 5 and a["added_p50_ms_median_of_rounds"] == pytest.approx(1.0, abs=0.1)
    assert out["modes"]["full"]["best_floor"] == "a"
    assert out["modes"]["full"]["epp_over_best_floor_p50_ms"] == pytest.approx(2.0, abs=0.1)


def test_unknown_floor_modes_or_servers_are_refused_before_any_part_runs():
    from kvgate.cli import build_parser

    for flags, word in ((["--floor-modes", "full,lean-nonexistent"], "lean-nonexistent"),
                        (["--floor-servers", "grpc-aio,rust-tonic"], "rust-tonic")):
        args = build_parser().parse_args(["bench", "epp", "--parts", "scheduling,floor", *flags])
        with pytest.raises(SystemExit, match=word):
            args.func(args)


# --- processes ---------------------------------------------------------------------------------------------------

def _installed() -> list[str]:
    return [name for name, impl in IMPLEMENTATIONS.items() if impl.missing() is None]


@pytest.mark.processes
@pytest.mark.parametrize("name", list(IMPLEMENTATIONS))
def test_each_server_answers_over_grpc_as_the_shared_answer(name, tmp_path):
    """Every do-nothing server, Python, Node or Go, sends over a real gRPC stream the messages replies.py sends."""
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    from kvgate.bench.extproc_noop.descriptors import write_ext_proc_descriptor_set
    from kvgate.common.processes import free_port, start_group, stop_group

    impl = IMPLEMENTATIONS[name]
    why = impl.missing()
    if why:
        pytest.skip(why)
    if impl.build is not None:
        impl.build()
    port = free_port()
    proc = start_group(impl.command(port, DESTINATION, write_ext_proc_descriptor_set(tmp_path / "d.pb")),
                       tmp_path / "server.log")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = pb_grpc.ExternalProcessorStub(channel)
            for case, modes in CASES.items():
                messages = _stream_messages(*modes)
                expected = [r for answers in _noop_answers(messages) for r in answers]
                assert list(stub.Process(iter(messages), timeout=20)) == expected, (case, name)
    finally:
        stop_group(proc)


@pytest.mark.processes
def test_the_floor_part_answers_every_request_on_every_installed_path(tmp_path):
    """60 requests at 60/s over every path, both modes, the ext-proc servers on a CPU of their own where the machine
    has two."""
    out = tmp_path / "floor.json"
    cpus = sorted(os.sched_getaffinity(0))
    pin = ["--epp-cpus", str(cpus[0])] if len(cpus) >= 2 else []
    started = time.monotonic()
    run = subprocess.run([KVGATE, "bench", "epp", "--parts", "floor", "--latency-requests", "60", "--request-rate",
                          "60", "--result-file", str(out), *pin], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    floor = json.loads(out.read_text())["floor"]
    servers = [*_installed(), EPP]
    expected = [NO_EXT_PROC, *(f"{s}/{m}" for s in servers for m in ("full", "request-only"))]
    assert list(floor["paths"]) == expected
    assert set(floor["skipped"]) == set(IMPLEMENTATIONS) - set(_installed())
    assert sum(row["sent"] for row in floor["paths"].values()) == 60
    for name, row in floor["paths"].items():
        assert row["sent"] >= 60 // len(expected) and row["ok"] == row["sent"] and not row["errors"], (name, row)
        assert row["p50_ms"] > 0 and row["p99_ms"] >= row["p50_ms"]
        if name != NO_EXT_PROC:
            assert row["added_p50_ci95_ms"][0] <= row["added_p50_ci95_ms"][1]
            assert row["server_cpu_ms_per_request"] is not None and row["server_cpu_ms_per_request_net"] is not None
    for mode in ("full", "request-only"):
        assert floor["modes"][mode]["best_floor"] in _installed()
        assert floor["modes"][mode]["epp_over_best_floor_p50_ms"] is not None
    # the EPPs' own histograms counted their measured requests (the warm-up's were before)
    for mode in ("full", "request-only"):
        row = floor["paths"][f"{EPP}/{mode}"]
        assert row["inside_epp"]["request_path"]["requests"] == row["ok"]
    if pin:
        assert floor["cpus"]["servers"] == [cpus[0]] and cpus[0] not in floor["cpus"]["others"], floor["cpus"]
    assert "request-path floor" in run.stdout and "best do-nothing server" in run.stdout
    print(f"floor part: {time.monotonic() - started:.1f} s")
