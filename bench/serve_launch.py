"""`kvgate bench serve --serve-model MODEL`: start `kvgate serve` here, load it with streaming clients, and with
--compare-offline run the same prompts through the offline engine (LLM.generate) on the same model, flags and
device, for the ratio of served to offline output tok/s.

The server is started on a free loopback port in its own process group, its log in a temporary folder, and stopped
(SIGTERM, then SIGKILL) before the offline run, so the two never share the device. The offline engine is built from
the very flags the server was given (parsed by `kvgate serve`'s own parser), so both batch, cache and compile alike.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
import time
from pathlib import Path


def serve_namespace(model_path: str, serve_args: list[str]) -> argparse.Namespace:
    """`kvgate serve MODEL serve_args...` parsed as the server parses it; a bad flag exits 2 here, at start."""
    from kvgate.engine.server.cli import add_serve_parser

    parser = argparse.ArgumentParser(prog="kvgate bench serve --serve-args")
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", model_path, *serve_args])


def parse_serve_args(text: str) -> list[str]:
    """--serve-args: `kvgate serve` flags as one shell-quoted string; --port and --host are the bench's own."""
    words = shlex.split(text)
    for word in words:
        if word.split("=", 1)[0] in ("--port", "--host"):
            raise argparse.ArgumentTypeError(f"{word}: the bench picks the server's host and port itself")
    return words


def resolve_model(name: str, serve_args: list[str]) -> tuple[str, tempfile.TemporaryDirectory | None]:
    """The model folder of --serve-model (a random model of bench engine's is built here, in the server's
    --device and --dtype), with the temporary folder to clean up."""
    from kvgate.bench.engine import _model_path

    ns = serve_namespace("demo", serve_args)
    built = _model_path(argparse.Namespace(model=name, device=ns.device, dtype=ns.dtype))
    _release_device_memory()  # a random model is built on the GPU: leave its memory to the server
    return built


def _release_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def launched_server(model_path: str, serve_args: list[str], start_timeout: float):
    """`kvgate serve` on a free loopback port; yields its base URL; stopped on exit."""
    from kvgate.common.processes import free_port, start_group, stop_group, wait_http_ok

    logs = Path(tempfile.mkdtemp(prefix="kvgate-bench-serve-"))
    log = logs / "serve.log"
    port = free_port()
    proc = start_group([sys.executable, "-m", "kvgate", "serve", model_path, "--host", "127.0.0.1",
                        "--port", str(port), *serve_args], log)
    url = f"http://127.0.0.1:{port}"
    try:
        print(f"kvgate serve {model_path} {' '.join(serve_args)} on {url} (log {log}) ...", flush=True)
        wait_http_ok(url + "/health", start_timeout,
                     lambda: proc.poll() is not None and f"kvgate serve exited; see {log}", "kvgate serve")
        yield url
    finally:
        stop_group(proc, timeout=30)


def offline_run(model_path: str, serve_args: list[str], requests: list) -> dict:
    """The same prompts, output lengths and sampling (each request's completions fields share SamplingParams'
    names) through LLM.generate with the server's engine flags, after a short warm-up: output tokens, seconds,
    output tok/s, and the engine's device."""
    from kvgate.engine import LLM, SamplingParams
    from kvgate.engine.cli_args import engine_config_from_args

    llm = LLM.from_config(engine_config_from_args(model_path, serve_namespace(model_path, serve_args)))
    device = llm.engine.device
    params = [SamplingParams(**r.sampling, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    llm.generate([requests[0].prompt[:16]], SamplingParams(max_tokens=4))  # warm-up
    llm.engine.reset_prefix_cache()
    _sync(device)
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in requests], params)
    _sync(device)
    elapsed = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm
    return {"output_tokens": tokens, "seconds": elapsed, "output_throughput": tokens / elapsed,
            "device": str(device)}


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def server_device(model_path: str, serve_args: list[str]) -> str:
    """The device the launched server runs on, as its --device resolves here (same host, same rules)."""
    from kvgate.engine.config import EngineConfig

    ns = serve_namespace(model_path, serve_args)
    return str(EngineConfig(model=model_path, device=ns.device).resolve_device())
