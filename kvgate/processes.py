"""Child processes of kvgate's own tools (`kvgate up`, benchmarks): free ports, readiness, clean stops.

Each child runs in a session of its own, so stopping it stops everything it started too.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def start_group(cmd: list[str], log_path: Path, env: dict | None = None, append: bool = False) -> subprocess.Popen:
    """Start `cmd` in its own process group, stdout and stderr to `log_path` (appended to with `append`)."""
    with open(log_path, "ab" if append else "wb") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})


def stop_group(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL what is left after `timeout`."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout)
        except ProcessLookupError:
            pass


def wait_http_ok(url: str, timeout: float, problem: Callable[[], str | None] | None = None,
                 what: str = "service") -> None:
    """Poll `url` until it answers 200; `problem()` names a dead child to fail fast on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if problem is not None:
            why = problem()
            if why:
                raise RuntimeError(why)
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{what} not ready at {url} after {timeout:g} s")
