"""Do-nothing ext-proc servers for `kvgate bench epp --parts floor`: the cost of an ext-proc stream itself, per server
implementation, with no parsing and no scheduling.

Each server is a separate process answering the Endpoint Picker Protocol's message sequence exactly as kvgate's EPP
does (epp/extproc.py) — the same number of messages, of the same shapes, in whichever processing mode the route sends
— but with one constant answer: every request goes to the one `--destination`. The Python servers share that answer
(replies.py) and differ only in their gRPC stack; the Node server (node/server.js) reimplements it on @grpc/grpc-js,
the Go one (go/main.go) on grpc-go with Debian's packaged sources (GOPATH mode, built once into the user's cache).
`IMPLEMENTATIONS` says how to start each one and, where it is not installed, why it is skipped.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

NODE_DIR = Path(__file__).parent / "node"
GO_SOURCE = Path(__file__).parent / "go" / "main.go"
GO_PATH = Path("/usr/share/gocode")  # where Debian's golang-*-dev packages put their sources
GO_PACKAGES = ("google.golang.org/grpc", "google.golang.org/protobuf/encoding/protowire")


@dataclass(frozen=True)
class Implementation:
    name: str
    summary: str
    missing: Callable[[], str | None]  # why it cannot run here (None: it can)
    command: Callable[[int, str, Path], list[str]]  # (port, destination, descriptor set file) -> argv
    build: Callable[[], None] | None = None  # once before starting; RuntimeError says why it cannot run


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


def _go_missing() -> str | None:
    if shutil.which("go") is None:
        return "go is not on PATH"
    absent = [p for p in GO_PACKAGES if not (GO_PATH / "src" / p).is_dir()]
    if absent:
        return (f"{', '.join(absent)} not under {GO_PATH} (apt-get install golang-google-grpc-dev "
                f"golang-google-protobuf-dev)")
    return None


def go_binary() -> Path:
    """The Go server's binary, one per version of its source, in the user's cache."""
    digest = hashlib.sha256(GO_SOURCE.read_bytes()).hexdigest()[:12]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvgate" / f"extproc-noop-go-{digest}"


def _go_build() -> None:
    binary = go_binary()
    if binary.exists():
        return
    binary.parent.mkdir(parents=True, exist_ok=True)
    partial = binary.with_suffix(".partial")
    run = subprocess.run(["go", "build", "-o", str(partial), str(GO_SOURCE)], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "GO111MODULE": "off", "GOPATH": str(GO_PATH), "GOFLAGS": ""})
    if run.returncode != 0:
        raise RuntimeError(f"go build failed: {run.stderr.strip()[-500:]}")
    partial.rename(binary)


IMPLEMENTATIONS = {impl.name: impl for impl in (
    Implementation("grpc-aio", "Python grpcio, asyncio (grpc.aio: context.read()/write(), as the EPP)",
                   lambda: None, _python_module("grpc_aio")),
    Implementation("grpc-sync", "Python grpcio, synchronous, a thread per stream from a pool",
                   lambda: None, _python_module("grpc_sync")),
    Implementation("grpclib", "Python grpclib: pure-Python HTTP/2 (h2) on asyncio",
                   _needs_module("grpclib", "pip install grpclib, or kvgate[bench]"),
                   _python_module("grpclib_asyncio")),
    Implementation("node-grpc-js", "Node.js @grpc/grpc-js, messages from the Python protos' descriptors",
                   _node_missing,
                   lambda port, destination, descriptors: [
                       shutil.which("node") or "node", str(NODE_DIR / "server.js"), "--port", str(port),
                       "--destination", destination, "--descriptors", str(descriptors)]),
    Implementation("go-grpc", "Go grpc-go, a pass-through codec and protowire (no generated stubs)",
                   _go_missing, lambda port, destination, _descriptors: [
                       str(go_binary()), "-port", str(port), "-destination", destination], _go_build),
)}
