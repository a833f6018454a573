"""The children of a local stack (engines, EPPs, Envoy, routers), each in its own process group, supervised.

A child that dies during start-up fails the start-up (its log says why): the waits here raise. Once the stack is
up, a child that dies is restarted with the same command and ports by supervise(), after a backoff that doubles
from RESTART_BASE_S up to RESTART_CAP_S (and resets once it has stayed up for STABLE_S). Each port is held for its
child from the moment it is chosen until the stack stops (kvgate.common.processes.reserve_port), so no other
process takes it during a start-up or a restart. stop() ends every child.

However the parent ends (SIGKILL, the OOM killer, a crash, or killed in the middle of stop()), its children and
theirs end with it, within kvgate.common.reaper.GRACE_S and their exit: kvgate.common.processes hands every
child's process group to a reaper process that watches a pipe only the parent holds.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.common.processes import reserve_port, start_group, stop_group, wait_http_ok


@dataclass
class Child:
    name: str
    cmd: list[str]
    env: dict | None
    proc: subprocess.Popen
    started_at: float = field(default_factory=time.monotonic)
    restarts: int = 0  # in a row: reset once the child has stayed up for STABLE_S
    restart_at: float | None = None  # when a dead child is started again


class Stack:
    RESTART_BASE_S = 1.0
    RESTART_CAP_S = 30.0
    STABLE_S = 60.0

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.children: list[Child] = []
        self.stopping = False  # set by stop(): nothing is restarted any more
        self.interrupted: str | None = None  # a signal's name, set by `kvgate up`'s handler: start-up gives up
        self._lock = threading.Lock()  # supervise() and stop() may run on different threads (benchmarks)
        self._reserved: list[socket.socket] = []  # the children's ports, held until stop(): reserve_port()

    def reserve_port(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """A port (`port` 0: a free one) that only this stack's children may listen on, until stop(): a child's
        start-up, and its restarts, cannot lose it to another process (kvgate.common.processes.reserve_port)."""
        held = reserve_port(host, port)
        self._reserved.append(held)
        return held.getsockname()[1]

    def start(self, name: str, cmd: list[str], env: dict | None = None) -> subprocess.Popen:
        proc = start_group(cmd, self.workdir / f"{name}.log", env)
        self.children.append(Child(name, cmd, env, proc))
        return proc

    def _exit(self, c: Child) -> str:
        return f"{c.name} exited with code {c.proc.returncode} (log: {self.workdir / (c.name + '.log')})"

    def dead(self) -> str | None:
        if self.interrupted:
            return f"interrupted by {self.interrupted}"
        for c in self.children:
            if c.proc.poll() is not None:
                return self._exit(c)
        return None

    def supervise(self, now: float | None = None) -> list[str]:
        """Restart dead children after their backoff; what happened, as log lines."""
        with self._lock:
            return [] if self.stopping else self._supervise(time.monotonic() if now is None else now)

    def _supervise(self, now: float) -> list[str]:
        said = []
        for c in self.children:
            if c.restart_at is not None:
                if now >= c.restart_at:
                    c.proc = start_group(c.cmd, self.workdir / f"{c.name}.log", c.env, append=True)
                    c.started_at, c.restart_at = now, None
                    said.append(f"{c.name} restarted (restart {c.restarts})")
            elif c.proc.poll() is not None:
                if now - c.started_at >= self.STABLE_S:
                    c.restarts = 0
                delay = min(self.RESTART_CAP_S, self.RESTART_BASE_S * 2 ** c.restarts)
                c.restarts += 1
                c.restart_at = now + delay
                said.append(f"{self._exit(c)}; restarting in {delay:g} s")
        return said

    def stop(self) -> None:
        with self._lock:
            self.stopping = True
        for c in reversed(self.children):
            stop_group(c.proc)
        for held in self._reserved:
            held.close()
        self._reserved.clear()

    def wait_http(self, url: str, deadline: float, what: str) -> None:
        wait_http_ok(url, max(deadline - time.monotonic(), 0.1), self.dead, what)

    def wait_until(self, ready, deadline: float, what: str) -> None:
        """Poll `ready()` until true; RuntimeError if a child dies, TimeoutError past `deadline`."""
        while not ready():
            problem = self.dead()
            if problem:
                raise RuntimeError(f"{problem} while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.1)
