"""Do-nothing ext-proc servers for `kvgate bench epp --parts floor`: the cost of an ext-proc stream itself, per server
implementation, with no parsing and no scheduling.

Each server is a separate process answering the Endpoint Picker Protocol's message sequence exactly as kvgate's EPP
does (epp/extproc.py) — the same number of messages, of the same shapes, in whichever processing mode the route sends
— but with one constant answer: every request goes to the one `--destination`. The Python servers share that answer
(replies.py) and differ only in their gRPC stack; the Node server (node/server.js) reimplements it on @grpc/grpc-js.
`IMPLEMENTATIONS` says how to start each one and, where it is not installed, why it is skipped.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

NODE_DIR = Path(__file__).parent / "node"


@dataclass(frozen=True)
class Implementation:
    name: str
    summary: str
    missing: Callable[[], str | None]  # why it cannot run here (None: it can)
    command: Callable[[int, str, Path], list[str]]  # (port, destination, descriptor set file) -> argv


def _python_module(module: str) -> Callable[[int, str, Path], list[str]]:
    return lambda port, destination, _descriptors: [sys.executable, "-m", f"kvgate.bench.extproc_noop.{module}",
                                                    "--port", str(port), "--destination", destination]


def _needs_module(name: str, install: str) -> Callable[[], str | None]:
    return lambda: None if importlib.util.find_spec(name) else f"{name} is not installed ({install})"


def _node_missing() -> str | None:
    if shutil.which("node") is None:
        return "node is not on PATH"
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir():
        return f"@grpc/grpc-js is not installed (npm ci --prefix {NODE_DIR})"
    return None


IMPLEMENTATIONS = {impl.name: impl for impl in (
    Implementation("grpc-aio", "Python grpcio, asyncio (grpc.aio: context.read()/write(), as the EPP)",
                   lambda: None, _python_module("grpc_aio")),
    Implementation("grpc-sync", "Python grpcio, synchronous, a thread per stream from a pool",
                   lambda: None, _python_module("grpc_sync")),
    Implementation("grpclib", "Python grpclib: pure-Python HTTP/2 (h2) on asyncio",
                   _needs_module("grpclib", "pip install grpclib, or kvgate[bench]"), _python_module("grpclib_asyncio")),
    Implementation("node-grpc-js", "Node.js @grpc/grpc-js, messages from the Python protos' descriptors",
                   _node_missing,
                   lambda port, destination, descriptors: [
                       shutil.which("node") or "node", str(NODE_DIR / "server.js"), "--port", str(port),
                       "--destination", destination, "--descriptors", str(descriptors)]),
)}
