"""`kvgate bench scrape`: what scraping N endpoints every 50 ms costs the EPP process.

A child process serves a realistic vLLM-shaped /metrics page (the shape `kvgate serve` answers under load:
gauges, counters, four latency histograms; the LoRA info gauge's value is a fresh timestamp on every answer,
as vLLM's and ours are, so no two bodies are identical) from N loopback keep-alive servers. Like
prometheus_client's exposition, it honours `?name[]=`. This process runs the Datalayer over them for a fixed
time and reports scrapes/s, the achieved interval against the target, this process's CPU
(time.process_time / wall: the child's serving is not counted), and the loop's lag: how late a 2 ms timer on the
same event loop fires, the wait a request's message would see behind the scraping. Each endpoint count also runs a baseline in
the same command — by default the same Datalayer reading the whole page (no name[] filter) — and prints the
ratio. `--datalayer-class module:Class` runs another implementation with the same API (start, stop,
set_endpoints, stats, states; e.g. an older copy) for before/after numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import multiprocessing
import random
import resource
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvgate.epp.types import Endpoint


def add_bench_scrape_parser(sub) -> None:
    p = sub.add_parser("scrape", help="EPP scrape cost: N endpoints' /metrics every 50 ms, this process's CPU")
    p.add_argument("--endpoint-counts", default="100,500,1000")
    p.add_argument("--seconds", type=float, default=4.0, help="measured time per run (after 1 s of warm-up)")
    p.add_argument("--interval", type=float, default=0.05)
    p.add_argument("--baseline", choices=("whole-page", "none"), default="whole-page",
                   help="also run each count reading the whole page (no name[] filter) and print the ratio")
    p.add_argument("--static-page", action="store_true",
                   help="serve byte-identical bodies (as an idle engine without a timestamped gauge would)")
    p.add_argument("--datalayer-class", default="kvgate.epp.datalayer:Datalayer",
                   help="module:Class of the implementation to measure (for before/after comparisons)")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                   help="event loop of the scraping process (uvloop: optional, if installed)")
    p.add_argument("--result-file", default=None)
    p.set_defaults(func=run_bench_scrape)


# ------------------------------------------------------------------------------------- the served page

def metrics_page() -> bytes:
    """The page `kvgate serve` answers after some traffic (vLLM's names and shape), as prometheus_client writes it."""
    return vllm_metrics_payload()


def vllm_metrics_payload(model: str = "demo") -> bytes:
    """A /metrics page shaped like `kvgate serve`'s (and vLLM's): gauges, counters and four histograms."""
    r = CollectorRegistry()
    labels = ["model_name"]
    for name, value in (("vllm:num_requests_running", 12), ("vllm:num_requests_waiting", 3),
                        ("vllm:kv_cache_usage_perc", 0.42)):
        Gauge(name, name, labels, registry=r).labels(model).set(value)
    for name, value in (("vllm:prefix_cache_queries", 912345), ("vllm:prefix_cache_hits", 512345),
                        ("vllm:num_preemptions", 3), ("vllm:prompt_tokens", 912345),
                        ("vllm:generation_tokens", 123456)):
        Counter(name, name, labels, registry=r).labels(model).inc(value)
    Gauge("vllm:cache_config_info", "KV cache configuration", ["block_size", "num_gpu_blocks", "model_name"],
          registry=r).labels("16", "28672", model).set(1)
    Gauge("vllm:lora_requests_info", "LoRA", ["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
          registry=r).labels("0", "", "").set(time.time())
    success = Counter("vllm:request_success", "finished", labels + ["finished_reason"], registry=r)
    success.labels(model, "length").inc(1000)
    success.labels(model, "stop").inc(200)
    rng = random.Random(1)
    for name, buckets in (
        ("vllm:time_to_first_token_seconds", (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                              1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)),
        ("vllm:inter_token_latency_seconds", (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075,
                                              0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)),
        ("vllm:e2e_request_latency_seconds", (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                                              15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)),
        ("vllm:request_queue_time_seconds", (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0,
                                             15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)),
    ):
        h = Histogram(name, name, labels, buckets=buckets, registry=r).labels(model)
        for _ in range(200):
            h.observe(rng.expovariate(5.0))
    return generate_latest(r)


_LORA = b"vllm:lora_requests_info{"
_VALUE_WIDTH = 17  # b"%17.6f" % time.time()


def _split_timestamp(page: bytes) -> tuple[bytes, bytes]:
    """(head, tail) around the LoRA info gauge's value, which the server rewrites on each answer."""
    start = page.find(_LORA)
    if start < 0:
        return page, b""
    value_start = page.find(b"} ", start) + 2
    value_end = page.find(b"\n", value_start)
    return page[:value_start], page[value_end:]


def filtered_page(page: bytes, names: set[str]) -> bytes:
    """The page narrowed to samples named in `names` (with their HELP/TYPE lines), as prometheus_client does."""
    out = []
    for line in page.splitlines(keepends=True):
        if line.startswith(b"#"):
            parts = line.split(b" ", 3)
            if len(parts) > 2 and parts[2].decode() in names:
                out.append(line)
        elif line.split(b"{")[0].split(b" ")[0].decode() in names:
            out.append(line)
    return b"".join(out)


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def serve_pages(num_servers: int, page: bytes, static: bool, conn) -> None:
    """Child process: `num_servers` keep-alive HTTP/1.1 servers on loopback answering GET /metrics[?name[]=]."""
    _raise_fd_limit()
    answers: dict[bytes, tuple[bytes, bytes]] = {}  # request path -> (head incl. headers, tail) of the answer

    def answer_for(path: bytes) -> bytes:
        parts = answers.get(path)
        if parts is None:
            names = set(parse_qs(urlsplit(path.decode()).query).get("name[]", []))
            body = filtered_page(page, names) if names else page
            head, tail = _split_timestamp(body)
            length = len(head) + _VALUE_WIDTH + len(tail) if tail else len(body)
            headers = (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n"
                       b"Content-Length: %d\r\n\r\n" % length)
            parts = answers[path] = (headers + head, tail)
        head, tail = parts
        if not tail:
            return head
        return head + (b"%17.6f" % (1.7e9 if static else time.time())) + tail

    class MetricsServer(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport, self.buffer = transport, b""

        def data_received(self, data):
            self.buffer += data
            while b"\r\n\r\n" in self.buffer:
                request, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
                path = request.split(b" ", 2)[1] if request.count(b" ") >= 2 else b"/metrics"
                self.transport.write(answer_for(path))

    async def main():
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(MetricsServer, "127.0.0.1", 0, backlog=512) for _ in range(num_servers)]
        conn.send([s.sockets[0].getsockname()[1] for s in servers])
        await loop.run_in_executor(None, conn.recv)  # the parent says when to stop
        for s in servers:
            s.close()

    asyncio.run(main())


# -------------------------------------------------------------------------------------------- one run

def _load_class(spec: str):
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


LAG_PERIOD_S = 0.002  # the loop-lag probe's timer


async def _probe_loop_lag(lags: list[float]) -> None:
    """How late a 2 ms timer fires, again and again: what a request's message on the same event loop waits for
    the scraping's callbacks (a read of the socket and a timer wait for the same turn of the loop)."""
    loop = asyncio.get_running_loop()
    while True:
        t0 = loop.time()
        await asyncio.sleep(LAG_PERIOD_S)
        lags.append(loop.time() - t0 - LAG_PERIOD_S)


def _lag_summary(lags: list[float]) -> dict:
    if not lags:
        return {"loop_lag_p50_ms": None, "loop_lag_p99_ms": None, "loop_lag_max_ms": None}
    lags = sorted(lags)
    return {"loop_lag_p50_ms": round(1000 * lags[len(lags) // 2], 3),
            "loop_lag_p99_ms": round(1000 * lags[min(len(lags) - 1, int(0.99 * len(lags)))], 3),
            "loop_lag_max_ms": round(1000 * lags[-1], 3)}


async def _measure(cls, ports: list[int], interval: float, seconds: float, whole_page: bool, tick) -> dict:
    kwargs = {"interval": interval}
    filters = "filter_families" in inspect.signature(cls).parameters  # an older implementation may not
    if whole_page:
        kwargs["filter_families"] = False
    layer = cls(**kwargs)
    layer.set_endpoints([Endpoint(f"127.0.0.1:{p}") for p in ports])
    await layer.start()
    try:
        await asyncio.sleep(1.0)  # connect and warm up before measuring
        lags: list[float] = []
        probe = asyncio.get_running_loop().create_task(_probe_loop_lag(lags))
        before, cpu0, wall0 = layer.stats(), time.process_time(), time.perf_counter()
        steps = max(1, int(seconds / 0.25))
        for _ in range(steps):
            await asyncio.sleep(seconds / steps)
            tick(seconds / steps)
        after, cpu1, wall1 = layer.stats(), time.process_time(), time.perf_counter()
        probe.cancel()
        fresh = sum(not s.stale for s in layer.states())
    finally:
        await layer.stop()
    n = len(ports)
    wall, cpu = wall1 - wall0, cpu1 - cpu0
    scrapes = after["scrapes"] - before["scrapes"]
    per_endpoint = scrapes / wall / n
    return {
        "endpoints": n,
        "mode": "filtered" if filters and not whole_page else "whole page",
        "seconds": round(wall, 3),
        "scrapes_per_s": round(scrapes / wall, 1),
        "target_scrapes_per_s": round(n / interval, 1),
        "achieved_interval_ms": round(1000.0 / per_endpoint, 2) if per_endpoint else None,
        "target_interval_ms": interval * 1000.0,
        "epp_cpu_cores": round(cpu / wall, 3),
        "cpu_us_per_scrape": round(1e6 * cpu / scrapes, 1) if scrapes else None,
        "failures": after["failures"] - before["failures"],
        "fresh_endpoints": fresh,
        **_lag_summary(lags),
    }


def measure(count: int, args, cls, page: bytes, whole_page: bool, tick) -> dict:
    ctx = multiprocessing.get_context("spawn")
    parent_conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=serve_pages, args=(count, page, args.static_page, child_conn), daemon=True)
    child.start()
    try:
        if not parent_conn.poll(60):
            raise TimeoutError("the metrics servers did not start within 60 s")
        ports = parent_conn.recv()
        coro = _measure(cls, ports, args.interval, args.seconds, whole_page, tick)
        if args.loop == "uvloop":
            import uvloop  # optional: pip install uvloop

            return uvloop.run(coro)
        return asyncio.run(coro)
    finally:
        parent_conn.send("stop")
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join(5)


def run_bench_scrape(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    _raise_fd_limit()
    cls = _load_class(args.datalayer_class)
    page = metrics_page()
    counts = [int(x) for x in args.endpoint_counts.split(",")]
    modes = [False] + ([True] if args.baseline == "whole-page" else [])
    print(f"page: {len(page)} bytes (whole), implementation {args.datalayer_class}, {args.loop} loop, interval "
          f"{args.interval * 1000:g} ms, {args.seconds:g} s per run", flush=True)
    results = []
    with tqdm(total=len(counts) * len(modes) * args.seconds, unit="s", leave=False,
              bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s") as bar:
        for count in counts:
            row = {}
            for whole in modes:
                row["whole_page" if whole else "filtered"] = measure(count, args, cls, page, whole, bar.update)
            if "whole_page" in row and row["whole_page"]["epp_cpu_cores"]:
                row["cpu_ratio_filtered_vs_whole_page"] = round(
                    row["filtered"]["epp_cpu_cores"] / row["whole_page"]["epp_cpu_cores"], 3)
            results.append(row)
    header = f"{'endpoints':>9} {'mode':>10} {'scrapes/s':>10} {'target':>8} {'interval ms':>11} " \
             f"{'EPP cores':>9} {'us/scrape':>9} {'fails':>6} {'fresh':>6} {'loop lag p50/p99/max ms':>24}"
    print(header)
    for row in results:
        for key in ("filtered", "whole_page"):
            r = row.get(key)
            if r is None:
                continue
            print(f"{r['endpoints']:>9} {r['mode']:>10} {r['scrapes_per_s']:>10.0f} {r['target_scrapes_per_s']:>8.0f} "
                  f"{r['achieved_interval_ms'] or 0:>11.1f} {r['epp_cpu_cores']:>9.3f} {r['cpu_us_per_scrape'] or 0:>9.1f} "
                  f"{r['failures']:>6} {r['fresh_endpoints']:>6} "
                  f"{r['loop_lag_p50_ms']:>8.2f}/{r['loop_lag_p99_ms']:.2f}/{r['loop_lag_max_ms']:.2f}")
        if "cpu_ratio_filtered_vs_whole_page" in row:
            print(f"{'':>9} filtered / whole page CPU: {row['cpu_ratio_filtered_vs_whole_page']:.2f}x")
    if len(results) > 1:
        base = results[0]["filtered"]
        for row in results[1:]:
            r = row["filtered"]
            if base["cpu_us_per_scrape"] and r["cpu_us_per_scrape"]:
                print(f"CPU per scrape at {r['endpoints']} vs {base['endpoints']} endpoints: "
                      f"{r['cpu_us_per_scrape'] / base['cpu_us_per_scrape']:.2f}x")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps({"implementation": args.datalayer_class, "loop": args.loop,
                                                      "interval_s": args.interval, "page_bytes": len(page),
                                                      "runs": results}, indent=2))
    return 0
