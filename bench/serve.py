"""`kvgate bench serve`: an OpenAI load generator in the manner of `vllm bench serve`.

Requests are streamed (`/v1/completions`, `ignore_eos` so every request yields exactly its output length,
`stream_options.include_usage` so token counts are the server's own). Arrivals are Poisson (gamma with
`--burstiness`; 1.0 = Poisson) at `--request-rate`, or all at once, optionally capped by
`--max-concurrency`. Datasets: `random` (random text of given lengths) and `shared-prefix` (G groups x P
prompts, each group sharing a system prompt: the workload that makes prefix-cache routing visible).
Prompt lengths are in characters; for the byte-level `demo` tokenizer that is also tokens.

`--serve-model MODEL` starts `kvgate serve` itself (serve_launch.py) and loads it; `--compare-offline` then runs the
same prompts through the offline engine with the same flags and reports served / offline output tok/s.
`--sampling realistic` sends the sampling of `kvgate bench engine --sampling realistic` (engine_sampling.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

_ALPHABET = string.ascii_lowercase + "      "  # about one space in five: word-like text


@dataclass
class BenchRequest:
    prompt: str
    output_len: int
    group: int = -1  # shared-prefix group, -1 for none
    sampling: dict = field(default_factory=lambda: {"temperature": 0.0})  # the request's sampling fields


@dataclass
class RequestResult:
    ok: bool = False
    status: int = 0
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    served_by: str = ""  # the engine's x-kvgate-endpoint response header, if any


def random_text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(_ALPHABET) for _ in range(n))


def random_dataset(num: int, input_len: int, output_len: int, range_ratio: float, seed: int) -> list[BenchRequest]:
    rng = random.Random(seed)

    def length(base: int) -> int:
        lo, hi = int(base * (1 - range_ratio)), int(base * (1 + range_ratio))
        return max(1, rng.randint(lo, hi))

    return [BenchRequest(random_text(rng, length(input_len)), length(output_len)) for _ in range(num)]


def shared_prefix_dataset(groups: int, prompts_per_group: int, system_len: int, question_len: int,
                          output_len: int, seed: int) -> list[BenchRequest]:
    """Group-major list; the runner shuffles arrivals so groups interleave."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        system = random_text(rng, system_len)
        for _ in range(prompts_per_group):
            out.append(BenchRequest(system + random_text(rng, question_len), output_len, g))
    return out


def arrival_gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> list[float]:
    if rate == float("inf"):
        return [0.0] * n
    theta = 1.0 / (rate * burstiness)
    return list(rng.gamma(shape=burstiness, scale=theta, size=n))


async def send_one(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest,
                   extra_headers: dict | None = None) -> RequestResult:
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **req.sampling}
    result = RequestResult()
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", url, json=body, headers=extra_headers) as resp:
            result.status = resp.status_code
            result.served_by = resp.headers.get("x-kvgate-endpoint", "")
            if resp.status_code != 200:
                result.error = (await resp.aread()).decode(errors="replace")[:300]
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = chunk["error"].get("message", "error")
                    return result
                now = time.perf_counter()
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    if result.ttft == 0.0:
                        result.ttft = now - start
                    else:
                        result.itls.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    result.prompt_tokens = usage["prompt_tokens"]
                    result.output_tokens = usage["completion_tokens"]
                    result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        result.latency = time.perf_counter() - start
        result.ok = result.output_tokens > 0 or req.output_len == 0
        if not result.ok:
            result.error = "no usage in the stream"
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    a = np.asarray(values) * 1000.0
    return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99))}


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = f"HTTP {r.status}" if r.status and r.status != 200 else (r.error.split(":")[0] or "error")
            errors[key] = errors.get(key, 0) + 1
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors, "duration_s": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "total_cached_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": out_tokens / duration if duration else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else 0.0,
        "ttft_ms": _percentiles([r.ttft for r in ok]),
        "itl_ms": _percentiles([x for r in ok for x in r.itls]),
        "e2el_ms": _percentiles([r.latency for r in ok]),
    }


async def run_benchmark(base_url: str, model: str | None, requests: list[BenchRequest], rate: float,
                        burstiness: float, max_concurrency: int | None, seed: int, timeout: float,
                        headers: dict | None = None) -> tuple[dict, list[RequestResult]]:
    # one connection per concurrent stream, all kept alive: 256 clients hold 256 connections
    connections = max_concurrency or len(requests)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(timeout, connect=10.0),
                                 limits=limits) as client:
        if model is None:
            models = (await client.get("/v1/models")).json()
            model = models["data"][0]["id"]
        gaps = arrival_gaps(len(requests), rate, burstiness, np.random.default_rng(seed))
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

        async def limited(req: BenchRequest) -> RequestResult:
            if semaphore is None:
                return await send_one(client, "/v1/completions", model, req, headers)
            async with semaphore:
                return await send_one(client, "/v1/completions", model, req, headers)

        start = time.perf_counter()
        tasks = []
        for gap, req in zip(gaps, requests):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(req)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
    summary = summarize(list(results), duration)
    summary["model"] = model
    return summary, list(results)


def format_summary(s: dict) -> str:
    lines = [
        "============ kvgate bench serve ============",
        f"{'model':<34}{s['model']}",
        f"{'successful requests':<34}{s['completed']}",
        f"{'failed requests':<34}{s['failed']}" + (f"  {s['errors']}" if s["errors"] else ""),
        f"{'benchmark duration (s)':<34}{s['duration_s']:.2f}",
        f"{'total input tokens':<34}{s['total_input_tokens']}",
        f"{'total generated tokens':<34}{s['total_output_tokens']}",
        f"{'prompt tokens served from cache':<34}{s['total_cached_tokens']}",
        f"{'request throughput (req/s)':<34}{s['request_throughput']:.2f}",
        f"{'output token throughput (tok/s)':<34}{s['output_throughput']:.1f}",
        f"{'total token throughput (tok/s)':<34}{s['total_token_throughput']:.1f}",
    ]
    for key, title in (("ttft_ms", "time to first token"), ("itl_ms", "inter-token latency"),
                       ("e2el_ms", "end-to-end latency")):
        p = s[key]
        lines.append(f"{title + ' (ms)':<34}mean {p['mean']:.1f}  p50 {p['p50']:.1f}  p90 {p['p90']:.1f}  "
                     f"p99 {p['p99']:.1f}")
    return "\n".join(lines)


def build_requests(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset == "random":
        reqs = random_dataset(args.num_prompts, args.random_input_len, args.random_output_len,
                              args.random_range_ratio, args.seed)
    else:
        reqs = shared_prefix_dataset(args.sp_num_groups, args.sp_prompts_per_group, args.sp_system_prompt_len,
                                     args.sp_question_len, args.sp_output_len, args.seed)
        random.Random(args.seed).shuffle(reqs)  # groups interleave in arrival order
    for req, params in zip(reqs, request_sampling(getattr(args, "sampling", "greedy"), len(reqs))):
        req.sampling = params
    return reqs


def request_sampling(mix: str, n: int) -> list[dict]:
    """Each request's sampling fields for the completions API, as `kvgate bench engine --sampling` samples."""
    from kvgate.bench.engine_sampling import LOGPROBS, LOGPROBS_EVERY, REALISTIC

    if mix == "greedy":
        return [{"temperature": 0.0} for _ in range(n)]
    return [{**REALISTIC, **({"logprobs": LOGPROBS} if i % LOGPROBS_EVERY == 0 else {})} for i in range(n)]


def add_bench_serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="load-test an OpenAI-compatible server (or a gateway in front of some)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=200, help="random dataset: number of requests")
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=64)
    p.add_argument("--random-range-ratio", type=float, default=0.0, help="lengths vary by +- this fraction")
    p.add_argument("--sp-num-groups", type=int, default=8)
    p.add_argument("--sp-prompts-per-group", type=int, default=16)
    p.add_argument("--sp-system-prompt-len", type=int, default=1024)
    p.add_argument("--sp-question-len", type=int, default=64)
    p.add_argument("--sp-output-len", type=int, default=32)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1.0 = Poisson arrivals")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--header", action="append", default=[], help="extra request header NAME=VALUE")
    p.add_argument("--result-file", default=None,
                   help="write the summary as JSON here, with the commit, versions and device (result_record.py)")
    p.add_argument("--sampling", choices=["greedy", "realistic"], default="greedy",
                   help="greedy (default) or the realistic mix of `kvgate bench engine --sampling realistic`")
    p.add_argument("--serve-model", default=None, metavar="MODEL",
                   help="start `kvgate serve MODEL` here on a free loopback port and load it (instead of "
                        "--base-url); MODEL as `kvgate bench engine --model` takes it (demo, a random model such as "
                        "qwen3-0.5b, or a folder)")
    p.add_argument("--serve-args", type=parse_serve_args, default=[], metavar="FLAGS",
                   help="with --serve-model: `kvgate serve` flags, one shell-quoted string (e.g. '--device cuda "
                        "--max-num-seqs 256'); also the offline engine's flags with --compare-offline")
    p.add_argument("--serve-start-timeout", type=_positive_seconds, default=600.0,
                   help="with --serve-model: seconds the server may take to answer /health (default 600)")
    p.add_argument("--compare-offline", action="store_true",
                   help="with --serve-model: after the server stops, the same prompts through the offline engine "
                        "(LLM.generate, same model, flags and device); prints served / offline output tok/s")
    p.set_defaults(func=run_bench_serve)


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"{text}: seconds from 0 to 3600")
    return value


def parse_serve_args(text: str) -> list[str]:
    from kvgate.bench.serve_launch import parse_serve_args as parse

    return parse(text)


def run_bench_serve(args: argparse.Namespace) -> int:
    from kvgate.bench.result_record import write_result

    if args.burstiness <= 0:
        raise SystemExit("kvgate bench serve: --burstiness must be > 0")
    if args.max_concurrency is not None and not 1 <= args.max_concurrency <= 65536:
        raise SystemExit("kvgate bench serve: --max-concurrency must be from 1 to 65536")
    if args.compare_offline and args.serve_model is None:
        raise SystemExit("kvgate bench serve: --compare-offline needs --serve-model (the bench must know the "
                         "server's model and flags to run them offline)")
    headers = dict(h.split("=", 1) for h in args.header)
    requests = build_requests(args)
    if args.serve_model is None:
        summary, results = asyncio.run(run_benchmark(args.base_url.rstrip("/"), args.model, requests,
                                                     args.request_rate, args.burstiness, args.max_concurrency,
                                                     args.seed, args.timeout, headers or None))
        device = None
    else:
        summary, results, device = _run_launched(args, requests, headers)
    print(format_summary(summary))
    if "offline" in summary:
        o = summary["offline"]
        print(f"{'offline output tok/s (same model)':<34}{o['output_throughput']:.1f}\n"
              f"{'served / offline output tok/s':<34}{summary['served_vs_offline']:.3f}")
    if args.result_file:
        summary["config"] = {k: v for k, v in vars(args).items() if k != "func"}
        summary["served_by"] = [r.served_by for r in results]
        summary["sampling"] = args.sampling
        write_result(args.result_file, summary, device)
    return 0 if summary["completed"] else 1


def _run_launched(args: argparse.Namespace, requests: list[BenchRequest], headers: dict):
    """The load against a `kvgate serve` started here; with --compare-offline, then the offline run and the
    ratio into the summary. (summary, results, the server's device)."""
    from kvgate.bench.serve_launch import launched_server, offline_run, resolve_model, server_device

    model_path, tmp = resolve_model(args.serve_model, args.serve_args)
    try:
        with launched_server(model_path, args.serve_args, args.serve_start_timeout) as url:
            warmup = random_dataset(4, 16, 4, 0.0, args.seed + 1)
            asyncio.run(run_benchmark(url, args.model, warmup, float("inf"), 1.0, 4, args.seed, args.timeout))
            summary, results = asyncio.run(run_benchmark(url, args.model, requests, args.request_rate,
                                                         args.burstiness, args.max_concurrency, args.seed,
                                                         args.timeout, headers or None))
        summary["server"] = {"model": args.serve_model, "serve_args": args.serve_args}
        device = server_device(model_path, args.serve_args)
        if args.compare_offline:
            offline = offline_run(model_path, args.serve_args, requests)
            summary["offline"] = offline
            summary["served_vs_offline"] = (summary["output_throughput"] / offline["output_throughput"]
                                            if offline["output_throughput"] else 0.0)
            device = offline["device"]
    finally:
        if tmp is not None:
            tmp.cleanup()
    return summary, results, device


def add_bench_engine_loop_parser(sub) -> None:
    p = sub.add_parser("engine-loop", help="thread vs process engine loop under the same streaming load")
    p.add_argument("--model", default="demo")
    p.add_argument("--backend", choices=["torch", "sim"], default="torch")
    p.add_argument("--num-prompts", type=int, default=192)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--random-input-len", type=int, default=256)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--result-file", default=None)
    p.set_defaults(func=run_bench_engine_loop)


def run_bench_engine_loop(args: argparse.Namespace) -> int:
    """Start `kvgate serve` once per mode on a free port and run the identical load against each."""
    import sys
    import tempfile
    from pathlib import Path

    from kvgate.common.processes import free_port, start_group, stop_group, wait_http_ok

    kvgate = str(Path(sys.executable).parent / "kvgate")
    requests = random_dataset(args.num_prompts, args.random_input_len, args.random_output_len, 0.0, args.seed)
    warmup = random_dataset(8, 32, 8, 0.0, args.seed + 1)
    summaries = {}
    logs = Path(tempfile.mkdtemp(prefix="kvgate-bench-loop-"))
    for mode in ("thread", "process"):
        port = free_port()
        proc = start_group([kvgate, "serve", args.model, "--backend", args.backend, "--engine-loop", mode,
                            "--port", str(port)], logs / f"serve-{mode}.log")
        url = f"http://127.0.0.1:{port}"
        try:
            wait_http_ok(url + "/health", 180, lambda: proc.poll() is not None and
                         f"kvgate serve ({mode}) exited; see {logs / f'serve-{mode}.log'}", f"kvgate serve ({mode})")
            asyncio.run(run_benchmark(url, None, warmup, float("inf"), 1.0, 8, args.seed, 120))
            summary, _ = asyncio.run(run_benchmark(url, None, requests, float("inf"), 1.0, args.max_concurrency,
                                                   args.seed, 600))
            summaries[mode] = summary
            print(f"--- engine loop: {mode}\n{format_summary(summary)}\n", flush=True)
        finally:
            stop_group(proc, timeout=15)
    t, p = summaries["thread"], summaries["process"]
    print(f"{'':<26}{'thread':>12}{'process':>12}{'process/thread':>16}")
    rows = [("output tok/s", t["output_throughput"], p["output_throughput"]),
            ("TTFT p50 (ms)", t["ttft_ms"]["p50"], p["ttft_ms"]["p50"]),
            ("TTFT p99 (ms)", t["ttft_ms"]["p99"], p["ttft_ms"]["p99"]),
            ("ITL p50 (ms)", t["itl_ms"]["p50"], p["itl_ms"]["p50"]),
            ("ITL p99 (ms)", t["itl_ms"]["p99"], p["itl_ms"]["p99"])]
    for name, a, b in rows:
        print(f"{name:<26}{a:>12.1f}{b:>12.1f}{(b / a if a else float('nan')):>15.2f}x")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(summaries, f, indent=2)
    return 0
