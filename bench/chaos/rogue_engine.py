"""`kvgate bench chaos --faults rogue-engine`: one endpoint of the pool serves hostile /metrics pages while a
client picks, and what the picks felt.

Two stand-in engines, A and B, answer the EPP's scrapes from a child process:
pages as a kvgate engine publishes them, counters moving as a busy engine's do; A is the busier, so B is the pick
while its page is sound. `kvgate epp` runs kvgate's profile over them (the profile `kvgate up` and the operator's
default pools use), and client threads ask it for picks over gRPC, as Envoy does (request headers, then the body;
each prompt new, so no prefix pins a pick).

Timeline: `phase_s` with both pages sound (the clean window: the baseline), then each bad page of PAGES on B in
turn for `phase_s`, each followed by B's sound page until B is picked again (at most `recover_s`). Per window:
picks, 5xx answers, gRPC errors, latency p50/p99 and the p99 against the clean window's, B's share of the picks,
the seconds until B was picked again once its page was sound, and the share of the EPP's event loop that reading
and parsing B's answers took (its kvgate_epp_endpoint_scrape_cpu_seconds_total over the window).

Verdict: no 5xx and no gRPC error in any window, every window's p99 within P99_RATIO of the clean window's, and B
picked again after every bad page.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvgate.common.processes import free_port, start_group, stop_group, wait_http_ok

P99_RATIO = 3.0
PICK_TIMEOUT_S = 10.0


def sound_page(busy: bool, now: float) -> bytes:
    """A kvgate engine's page at time `now` (s since the stand-ins started): counters move as a prefilling
    engine's do; `busy` adds a queue."""
    waiting, running, usage, pending = (6, 8, 0.6, 4000) if busy else (0, 1, 0.1, 200)
    queries, computed, seconds = 1000 + 2000 * now, 500 + 1500 * now, 0.5 * now
    return (f'vllm:num_requests_waiting{{model_name="m"}} {waiting}\n'
            f'vllm:num_requests_running{{model_name="m"}} {running}\n'
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {usage}\n'
            'vllm:cache_config_info{block_size="16",model_name="m",num_gpu_blocks="8192"} 1.0\n'
            'vllm:lora_requests_info{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""} 1.7e9\n'
            f'vllm:prefix_cache_queries_total{{model_name="m"}} {queries}\n'
            f'vllm:prefix_cache_hits_total{{model_name="m"}} {queries / 4}\n'
            f'kvgate:num_prefill_tokens_pending{{model_name="m"}} {pending}\n'
            f'kvgate:num_prefill_tokens_awaiting_step{{model_name="m"}} {pending // 2}\n'
            'kvgate:engine_step_age_seconds{model_name="m"} 0.01\n'
            f'kvgate:prefill_tokens_computed_total{{model_name="m"}} {computed}\n'
            f'kvgate:prefill_step_seconds_total{{model_name="m"}} {seconds}\n').encode()


def _replace(page: bytes, family: str, value: str) -> bytes:
    lines = page.decode().splitlines()
    return "\n".join(f'{line.rsplit(" ", 1)[0]} {value}' if line.startswith(family + "{") else line
                     for line in lines).encode() + b"\n"


def _with_length(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def _pages() -> dict[str, object]:
    """name -> how B answers a scrape: a function of the sound page giving the answer's bytes, or a coroutine
    function writing them itself (for answers that trickle)."""
    digits = "1" * 400

    def huge_labels(page: bytes) -> bytes:
        return _with_length(page.replace(b'num_gpu_blocks="8192"', f'num_gpu_blocks="{digits}"'.encode())
                            .replace(b'block_size="16"', f'block_size="{digits}"'.encode()))

    def inf_counters(page: bytes) -> bytes:
        for family, value in (("vllm:prefix_cache_queries_total", "+Inf"), ("vllm:prefix_cache_hits_total", "+Inf"),
                              ("kvgate:prefill_tokens_computed_total", "+Inf"),
                              ("kvgate:prefill_step_seconds_total", "-Inf"), ("kvgate:engine_step_age_seconds", "+Inf"),
                              ("kvgate:num_prefill_tokens_pending", "-Inf")):
            page = _replace(page, family, value)
        return _with_length(page)

    def nan_gauges(page: bytes) -> bytes:
        for family in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                       "kvgate:engine_step_age_seconds", "kvgate:num_prefill_tokens_pending"):
            page = _replace(page, family, "NaN")
        return _with_length(page)

    def big_page(page: bytes) -> bytes:  # 12 MB: a page with a histogram per imaginable label set
        filler = b"".join(b'vllm:e2e_request_latency_seconds_bucket{le="%d",model_name="m"} 3.0\n' % i
                          for i in range(200_000))
        return _with_length(page + filler)

    def one_byte_chunks(page: bytes) -> bytes:  # 2 MB in 1-byte chunks: 12 MB on the wire
        body = page + b"#" * (2_000_000 - len(page))
        return (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"".join(b"1\r\n%c\r\n" % c for c in body) + b"0\r\n\r\n")

    async def never_ending(writer, page: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        while True:
            writer.write(b"%x\r\n%s\r\n" % (len(page), page))
            await writer.drain()
            await asyncio.sleep(0.01)

    def garbage(page: bytes) -> bytes:
        return bytes(np.random.default_rng(0).integers(0, 256, 65536, dtype=np.uint8))

    def label_sets(page: bytes) -> bytes:  # 50 000 label sets of one family, in one group
        return _with_length(b"".join(b'vllm:num_requests_waiting{model_name="m",x="%d"} 0\n' % i
                                     for i in range(50_000)) + page.split(b"\n", 1)[1])

    return {"huge-int-labels": huge_labels, "inf-counters": inf_counters, "nan-gauges": nan_gauges,
            "12mb-page": big_page, "2mb-1-byte-chunks": one_byte_chunks, "never-ending-body": never_ending,
            "garbage-bytes": garbage, "50k-label-sets": label_sets}


PAGES = tuple(_pages())


class StandIns:
    """A and B's /metrics on two loopback ports, served by a child process (so that building a 12 MB answer does not
    take this process's GIL from the client threads); `bad` names B's page (None: sound)."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._mode = ctx.Value("i", -1)  # index into PAGES; -1: sound
        self._scrapes = ctx.Array("l", 2)
        self._ports, child = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_serve_stand_ins, args=(child, self._mode, self._scrapes),
                                 name="stand-in engines", daemon=True)
        self.ports: list[int] = []

    def __enter__(self) -> "StandIns":
        self._proc.start()
        if not self._ports.poll(30):
            self._proc.kill()
            raise RuntimeError("the stand-in engines did not start")
        self.ports = self._ports.recv()
        return self

    def __exit__(self, *exc) -> None:
        self._proc.kill()
        self._proc.join(10)

    @property
    def bad(self) -> str | None:
        return None if self._mode.value < 0 else PAGES[self._mode.value]

    @bad.setter
    def bad(self, name: str | None) -> None:
        self._mode.value = -1 if name is None else PAGES.index(name)

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    @property
    def scrapes(self) -> dict[str, int]:
        return {"A": self._scrapes[0], "B": self._scrapes[1]}


def _serve_stand_ins(ports, mode, scrapes) -> None:
    """The child process: A's and B's servers until killed. A bad answer is built once (its counters need not
    move), so that answering it costs the child little."""
    pages = _pages()
    answers: dict[str, bytes] = {}
    started = time.monotonic()

    async def serve(index: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await reader.readuntil(b"\r\n\r\n")
                scrapes[index] += 1
                page = sound_page(index == 0, time.monotonic() - started)
                bad = PAGES[mode.value] if index == 1 and mode.value >= 0 else None
                answer = pages[bad] if bad else None
                if answer is None:
                    writer.write(_with_length(page))
                elif asyncio.iscoroutinefunction(answer):
                    await answer(writer, page)
                else:
                    if bad not in answers:
                        answers[bad] = answer(page)
                    writer.write(answers[bad])
                await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            writer.close()

    async def main() -> None:
        servers = [await asyncio.start_server(lambda r, w, i=i: serve(i, r, w), "127.0.0.1", 0) for i in (0, 1)]
        ports.send([s.sockets[0].getsockname()[1] for s in servers])
        await asyncio.Event().wait()

    asyncio.run(main())


@dataclass
class Window:
    name: str
    picks: list[tuple[float, float, str]] = field(default_factory=list)  # (at, seconds, endpoint or "5xx"/"error")
    recover_s: float | None = None  # B's sound page again → B picked
    # the EPP's kvgate_epp_endpoint_scrape_cpu_seconds_total for B at the window's start and end, and when read
    cpu: list[tuple[float, float]] = field(default_factory=list)

    def row(self, b: str, clean_p99: float | None) -> dict:
        lat = np.array([s for _, s, _ in self.picks]) if self.picks else np.zeros(1)
        p99 = float(np.percentile(lat, 99))
        fivexx = sum(1 for *_, d in self.picks if d == "5xx")
        errors = sum(1 for *_, d in self.picks if d == "error")
        ratio = p99 / clean_p99 if clean_p99 else 1.0
        recovered = self.name == "clean" or self.recover_s is not None
        share = None
        if len(self.cpu) == 2 and self.cpu[1][0] > self.cpu[0][0]:
            share = (self.cpu[1][1] - self.cpu[0][1]) / (self.cpu[1][0] - self.cpu[0][0])
        return {"page": self.name, "picks": len(self.picks), "5xx": fivexx, "grpc_errors": errors,
                "p50_ms": round(float(np.percentile(lat, 50)) * 1e3, 2), "p99_ms": round(p99 * 1e3, 2),
                "p99_vs_clean": round(ratio, 2),
                "b_share": round(sum(1 for *_, d in self.picks if d == b) / max(1, len(self.picks)), 3),
                "recover_s": None if self.recover_s is None else round(self.recover_s, 2),
                "b_scrape_loop_share": None if share is None else round(share, 4),
                "passed": fivexx == 0 and errors == 0 and ratio <= P99_RATIO and recovered}


class Picker:
    """`threads` client threads asking the EPP for picks back to back; each pick lands in the current window."""

    def __init__(self, grpc_port: int, threads: int) -> None:
        import grpc
        from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

        self.channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)
        self.window = Window("warmup")
        self.last_b_at = 0.0
        self.b = ""
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(threads)]

    def __enter__(self) -> "Picker":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(PICK_TIMEOUT_S + 5)
        self.channel.close()

    def _loop(self, worker: int) -> None:
        from envoy.config.core.v3 import base_pb2
        from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
        from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

        mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
        headers = pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
                base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")])),
            protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode))
        n = 0
        while not self._stop.is_set():
            n += 1
            body = json.dumps({"model": "m", "prompt": f"worker {worker} request {n} " + "x" * 200,
                               "max_tokens": 8}).encode()
            msgs = [headers, pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True))]
            window = self.window
            t0 = time.monotonic()
            try:
                out = list(self.stub.Process(iter(msgs), timeout=PICK_TIMEOUT_S))
                result = _destination(out)
            except Exception:  # noqa: BLE001 - a gRPC error is what this measures
                result = "error"
            t1 = time.monotonic()
            window.picks.append((t0, t1 - t0, result))
            if result == self.b:
                self.last_b_at = t1


def _destination(out) -> str:
    for resp in out:
        if resp.HasField("immediate_response"):
            code = resp.immediate_response.status.code
            return "5xx" if code >= 500 else f"{code}"
        common = resp.request_headers.response if resp.HasField("request_headers") else (
            resp.request_body.response if resp.HasField("request_body") else None)
        if common is None:
            continue
        for h in common.header_mutation.set_headers:
            if h.header.key == "x-gateway-destination-endpoint":
                return (h.header.raw_value or h.header.value.encode()).decode().split(",")[0]
    return "error"


def run_rogue_engine(workdir: Path | None = None, pages: tuple[str, ...] = PAGES, phase_s: float = 4.0,
                     recover_s: float = 10.0, threads: int = 4, tick=lambda: None) -> dict:
    """The bench; returns its rows and verdict (see the module's docstring)."""
    from kvgate.epp.scheduling.config import KVGATE_PROFILE_YAML

    workdir = Path(workdir or tempfile.mkdtemp(prefix="kvgate-rogue-"))
    workdir.mkdir(parents=True, exist_ok=True)
    kvgate = str(Path(sys.executable).parent / "kvgate")
    grpc_port, health_port, metrics_port = free_port(), free_port(), free_port()
    windows: list[Window] = []
    with StandIns() as engines:
        a, b = engines.addresses
        epp = start_group([kvgate, "epp", "--endpoints", f"{a},{b}", "--config-text", KVGATE_PROFILE_YAML,
                           "--grpc-port", str(grpc_port), "--grpc-health-port", str(health_port),
                           "--metrics-port", str(metrics_port)], workdir / "epp.log")
        try:
            wait_http_ok(f"http://127.0.0.1:{metrics_port}/metrics", 30,
                         lambda: "the EPP exited" if epp.poll() is not None else None, "the EPP")
            time.sleep(1.0)  # a few scrape rounds: both endpoints measured
            with Picker(grpc_port, threads) as picker:
                picker.b = b
                time.sleep(0.5)
                for name in ("clean", *pages):
                    window = picker.window = Window(name)
                    windows.append(window)
                    engines.bad = None if name == "clean" else name
                    window.cpu.append((time.monotonic(), _scrape_cpu(metrics_port, b)))
                    _wait(phase_s, tick)
                    window.cpu.append((time.monotonic(), _scrape_cpu(metrics_port, b)))
                    if name == "clean":
                        continue
                    engines.bad = None
                    sound_at = time.monotonic()
                    deadline = sound_at + recover_s
                    while time.monotonic() < deadline:
                        if picker.last_b_at > sound_at:
                            window.recover_s = picker.last_b_at - sound_at
                            break
                        time.sleep(0.02)
                        tick()
                picker.window = Window("done")
        finally:
            stop_group(epp)
            epp_log = (workdir / "epp.log").read_text(errors="replace")
    at_bounds = answer_cost_at_bounds()
    clean = windows[0]
    clean_p99 = float(np.percentile([s for _, s, _ in clean.picks], 99)) if clean.picks else None
    rows = [w.row(b, clean_p99) for w in windows]
    tracebacks = epp_log.count("Traceback")
    return {"rows": rows, "at_bounds": at_bounds, "phase_s": phase_s, "threads": threads, "epp_tracebacks": tracebacks,
            "scrapes": dict(engines.scrapes), "logs": str(workdir),
            "passed": all(r["passed"] for r in rows) and tracebacks == 0}


def _scrape_cpu(metrics_port: int, address: str) -> float:
    """The EPP's kvgate_epp_endpoint_scrape_cpu_seconds_total for `address` (0 before its first answer)."""
    import httpx

    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    key = f'kvgate_epp_endpoint_scrape_cpu_seconds_total{{endpoint="{address}"}} '
    for line in text.splitlines():
        if line.startswith(key):
            return float(line[len(key):])
    return 0.0


def answer_cost_at_bounds(repeats: int = 5) -> dict:
    """The event loop's time for the costliest answers the datalayer's bounds let through, in this process (best of
    `repeats`): a page with every family the vLLM dialect reads at its label-set bound (the LoRA gauge at its own),
    cut at 4 MiB, parsed; and MAX_CHUNKS 1-byte chunks read in 256 KiB reads (asyncio's largest), as one answer and
    as its longest read — against a sound page's parse."""
    from kvgate.epp.datalayer import value_bounds as bounds
    from kvgate.epp.datalayer.dialects import DIALECTS
    from kvgate.epp.datalayer.exposition import parse_metrics
    from kvgate.epp.datalayer.http_client import DEFAULT_MAX_BYTES, MAX_CHUNKS, MetricsConnection

    dialect = DIALECTS["vllm"]
    lines = []
    for family in dialect.families():
        n = bounds.MAX_INFO_SERIES if family == dialect.lora_info else bounds.MAX_SERIES
        lines += [f'{family}{{model_name="m",engine="{i}",running_lora_adapters="a{i}",feature="f{i}"}} {i}.5'
                  for i in range(n)]
    heavy = ("\n".join(lines) + "\n")[:DEFAULT_MAX_BYTES]
    sound = sound_page(False, 1.0).decode()

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    class _Sink:  # a transport that takes the request and drops it
        def write(self, data) -> None:
            pass

        def is_closing(self) -> bool:
            return False

        def close(self) -> None:
            pass

    wire = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + b"1\r\nx\r\n" * MAX_CHUNKS
            + b"0\r\n\r\n")
    reads = [wire[i:i + (256 << 10)] for i in range(0, len(wire), 256 << 10)]
    whole, longest = [], []
    for _ in range(repeats):
        connection = MetricsConnection("127.0.0.1:1", max_bytes=DEFAULT_MAX_BYTES)
        connection.transport = _Sink()
        connection.send(lambda status, body, exc: None)
        slowest = 0.0
        for chunk in reads:
            t0 = time.perf_counter()
            connection.data_received(chunk)
            slowest = max(slowest, time.perf_counter() - t0)
        whole.append(connection.cost_s)
        longest.append(slowest)
    return {"sound_page_parse_ms": round(best(lambda: parse_metrics(sound, dialect)) * 1e3, 3),
            "page_at_bounds_bytes": len(heavy),
            "page_at_bounds_parse_ms": round(best(lambda: parse_metrics(heavy, dialect, 0.0,
                                                                        bounds.Rejections())) * 1e3, 2),
            "max_chunks_answer_ms": round(min(whole) * 1e3, 2),
            "max_chunks_longest_read_ms": round(min(longest) * 1e3, 2)}


def _wait(seconds: float, tick) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(min(0.2, max(0.0, end - time.monotonic())))
        tick()


def print_rogue_engine(result: dict) -> None:
    head = ("page on B", "picks", "5xx", "gRPC errors", "p50 ms", "p99 ms", "p99 / clean", "B's share",
            "B again after s", "EPP loop on B's scrapes", "held")
    lines = [head]
    for r in result["rows"]:
        lines.append((r["page"], str(r["picks"]), str(r["5xx"]), str(r["grpc_errors"]), f"{r['p50_ms']:.2f}",
                      f"{r['p99_ms']:.2f}", f"{r['p99_vs_clean']:.2f}", f"{r['b_share']:.2f}",
                      "-" if r["recover_s"] is None else f"{r['recover_s']:.2f}",
                      "-" if r["b_scrape_loop_share"] is None else f"{100 * r['b_scrape_loop_share']:.1f}%",
                      "yes" if r["passed"] else "NO"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    print("rogue-engine: kvgate's profile over stand-in engines A and B; B serves each bad page in turn "
          f"({result['phase_s']:g} s each, {result['threads']} client threads picking over gRPC)")
    print("\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in lines))
    print(f"  EPP tracebacks in its log: {result['epp_tracebacks']}; scrapes answered: {result['scrapes']}")
    b = result["at_bounds"]
    print(f"  the costliest answers the bounds let through, on this process's loop: a "
          f"{b['page_at_bounds_bytes']:,}-byte page at the label-set bounds parses in "
          f"{b['page_at_bounds_parse_ms']} ms (a sound page: {b['sound_page_parse_ms']} ms); 65536 1-byte chunks "
          f"read in {b['max_chunks_answer_ms']} ms, the longest "
          f"256 KiB read {b['max_chunks_longest_read_ms']} ms; each holds its endpoint's next scrape back 10x as long")
