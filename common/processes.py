"""Child processes of kvgate's own tools (`kvgate up`, benchmarks): free ports, readiness, clean stops.

Each child runs in a session of its own, so stopping it stops everything it started too. And each ends with this
process, however this process ends (SIGKILL and the OOM killer included): a reaper process (common/reaper.py,
started with the first child) watches a pipe only this process holds, and ends every child's group when the
pipe closes.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from kvgate.common import reaper


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now: another process may take it before the caller's child binds it (see reserve_port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def reserve_port(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP port held for a child that will listen on it (`port` 0: a free one; the socket's getsockname() says
    which): a socket bound with SO_REUSEADDR that never listens. While it is open Linux hands the port to no one
    else — neither a bind to port 0 nor an outgoing connection's local port — yet a child whose listener also
    sets SO_REUSEADDR (uvicorn, gRPC, Envoy, ZeroMQ and prometheus-client's server all do) binds and listens on it,
    and binds it again when restarted. free_port() leaves a window, the child's start-up, in which another
    process may take the port: a torch engine imports for seconds before it binds, and on a busy machine one lost
    that race (uvicorn exits with status 3). The socket is not inherited by children; close it when the child
    is gone for good."""
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    return s


def port_taken(host: str, port: int) -> str | None:
    """None if `host:port` can be listened on; else one line that says why not, and which process holds it where
    /proc tells (Linux, a process of this user)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Envoy: connections in TIME_WAIT do not count
        try:
            s.bind((host, port))
            return None
        except OSError as exc:
            why = f"cannot listen on {host}:{port}: {exc.strerror}"
            if exc.errno == errno.EADDRINUSE:
                holder = listener_of(port)
                why += f" (by {holder})" if holder else ""
            return why


def listener_of(port: int) -> str | None:
    """'pid N: its command line' of a process listening on TCP `port`, from /proc (None where that cannot tell)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:  # sl local_address rem_address st ... uid timeout inode
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if any(os.readlink(f"/proc/{pid}/fd/{fd}") in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                return f"pid {pid}: {' '.join(argv.split())[:100]}"
        except OSError:  # gone meanwhile, or not ours to look at
            continue
    return None


_reaper_lock = threading.Lock()
_reaper: subprocess.Popen | None = None
_reaper_pipe: int | None = None  # its write end: this process holds the only one
_ending_with_me: set[int] = set()  # what the reaper was told: told again to a new one


def end_with_me(target: int) -> None:
    """`target` (a pid, or minus a process group's id, as kill(2) takes it) ends when this process ends, however
    it ends: SIGTERM, and SIGKILL reaper.GRACE_S later."""
    global _ending_with_me
    with _reaper_lock:
        _ending_with_me.add(target)
        if len(_ending_with_me) > 256:  # restarts add groups; keep only the live ones
            _ending_with_me = {t for t in _ending_with_me if reaper.alive(t)}
        if _reaper is not None and _reaper.poll() is None:
            try:
                os.write(_reaper_pipe, f"{target}\n".encode())
                return
            except BrokenPipeError:  # it died (someone killed it): a new one is told everything
                pass
        _start_reaper()


def _start_reaper() -> None:
    global _reaper, _reaper_pipe
    if _reaper_pipe is not None:
        os.close(_reaper_pipe)
    read, _reaper_pipe = os.pipe()  # not inherited by children: only this process can hold the write end open
    try:
        # Its own session: a Ctrl-C to the terminal, or a kill of this process's group, does not reach it.
        _reaper = subprocess.Popen([sys.executable, "-I", reaper.__file__], stdin=read, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, start_new_session=True)
    finally:
        os.close(read)
    os.write(_reaper_pipe, "".join(f"{t}\n" for t in _ending_with_me if reaper.alive(t)).encode())


def _forget_reaper() -> None:
    """In a fork of this process: close its copy of the pipe (or the pipe would stay open while the fork lives)."""
    global _reaper, _reaper_pipe, _reaper_lock
    if _reaper_pipe is not None:
        os.close(_reaper_pipe)
    _reaper, _reaper_pipe, _reaper_lock = None, None, threading.Lock()
    _ending_with_me.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_reaper)


def start_group(cmd: list[str], log_path: Path, env: dict | None = None, append: bool = False) -> subprocess.Popen:
    """Start `cmd` in its own process group, stdout and stderr to `log_path` (appended to with `append`); the
    group ends with this process (end_with_me) if it has not been stopped before."""
    with open(log_path, "ab" if append else "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    try:
        end_with_me(-proc.pid)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc


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
