"""Rank 0's side of tensor parallelism: it starts ranks 1..N-1 as worker processes, drives them over a control
channel, and notices when one dies.

Each worker is `python -m kvgate.engine.distributed.worker FD` (a plain subprocess: the engine itself may run in a
daemonic multiprocessing process, which may not have children of its own), with one end of a socket pair as its
control channel. Over it the worker gets its start arguments, then commands: a step's header (the tensors follow
as one broadcast over the process group, model_runner.py), the KV-cache sizing and allocation, stop. The worker
reads commands until the channel ends, so it ends with this process (and kvgate.common.processes' reaper ends it
even where that is not enough: SIGKILL of this process while the worker waits in a collective).

A watchdog thread waits on the workers' process sentinels: a worker that ends unasked makes `failure` say which
rank died and how, at once, whatever rank 0 is doing (the engine loop polls check() while idle: the server's
/health turns 503 within its poll interval); a collective that was waiting on the dead rank raises (gloo: its
socket closes; NCCL: the watchdog aborts the group), and `explain` turns that into the same clear error.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass

from kvgate.common.errors import EngineDeadError

log = logging.getLogger(__name__)

# How long a worker may take to answer a command that loads or sizes something (model load, KV-cache profile,
# CUDA graph capture) before rank 0 gives up on it; a dead worker is noticed at once regardless.
REPLY_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 5.0


class TensorParallelError(EngineDeadError):
    """A tensor-parallel rank died or a collective failed: the engine cannot run another step."""


@dataclass(frozen=True)
class WorkerStart:
    """What a worker needs to build its rank's model runner (sent pickled over the control channel)."""
    rank: int
    world_size: int
    store_port: int
    config: object  # the EngineConfig, its step budget resolved (as rank 0's ModelRunner gets it)
    hf_config: object
    device: str
    dtype: object
    max_model_len: int
    cpu_threads: int


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class TensorParallelWorkers:
    """Ranks 1..N-1 of one engine: started by start(), commanded by send()/call(), ended by close()."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.procs: list[subprocess.Popen] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self.failure: str | None = None  # set by the watchdog: which rank died, how
        self._ending = [False]  # set when the workers are asked to end (close(), or the finalizer at exit)
        self._group = None  # rank 0's TensorParallelGroup, aborted when a rank dies (NCCL)
        self._on_failure: list = []
        self._stop_r, self._stop_w = os.pipe()  # closing the write end stops the watchdog
        self._watchdog: threading.Thread | None = None
        self._finalizer = weakref.finalize(self, _end_workers, self.procs, self.conns, self._ending)

    def start(self, starts: list[WorkerStart]) -> None:
        from kvgate.common.processes import end_with_me

        for start in starts:
            ours, theirs = socket.socketpair()
            proc = subprocess.Popen([sys.executable, "-m", "kvgate.engine.distributed.worker", str(theirs.fileno())],
                                    pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
            theirs.close()
            end_with_me(proc.pid)
            conn = multiprocessing.connection.Connection(ours.detach())
            conn.send(start)
            self.procs.append(proc)
            self.conns.append(conn)
        self._watchdog = threading.Thread(target=self._watch, name="kvgate-tp-watchdog", daemon=True)
        self._watchdog.start()

    def watch_group(self, group) -> None:
        self._group = group

    # -- the watchdog -----------------------------------------------------------------------------

    def _watch(self) -> None:
        sentinels = {}
        for rank, proc in enumerate(self.procs, start=1):
            sentinels[_pidfd_or_poll(proc)] = (rank, proc)
        waits = [s for s in sentinels if s is not None]
        try:
            while True:
                ready = multiprocessing.connection.wait(waits + [self._stop_r],
                                                        timeout=0.2 if None in sentinels else None)
                if self._stop_r in ready or self._ending[0]:
                    return
                for rank, proc in sentinels.values():
                    if proc.poll() is not None:
                        self._died(rank, proc)
                        return
        finally:
            for fd in waits + [self._stop_r]:
                os.close(fd)

    def _died(self, rank: int, proc: subprocess.Popen) -> None:
        if self._ending[0] or self.failure is not None:
            return
        why = _describe_exit(proc.returncode)
        conn = self.conns[rank - 1]
        try:  # a worker that failed says why before it exits
            while conn.poll(0):
                kind, value = conn.recv()
                if kind == "error":
                    why += f": {value}"
        except (EOFError, OSError, ValueError):
            pass
        self.failure = f"tensor-parallel rank {rank} (pid {proc.pid}) died ({why}): the engine cannot continue"
        log.error("%s", self.failure)
        group = self._group
        if group is not None and group.pg is not None and type(group.pg).__name__ == "ProcessGroupNCCL":
            group.abort()  # a collective waiting on the dead rank raises instead of waiting out its timeout

    def check(self) -> None:
        """Raise TensorParallelError if a worker has died."""
        if self.failure is None:
            for rank, proc in enumerate(self.procs, start=1):
                if proc.poll() is not None:
                    self._died(rank, proc)
                    break
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def explain(self, exc: BaseException, wait_s: float = 2.0) -> TensorParallelError:
        """The error to raise for a failed collective: which rank died (waiting up to wait_s for its end to show),
        or the collective's own error."""
        deadline = time.monotonic() + wait_s
        while self.failure is None and time.monotonic() < deadline:
            try:
                self.check()
            except TensorParallelError:
                break
            time.sleep(0.02)
        if self.failure is None:  # no rank died, but the group is broken all the same: later steps fail too
            self.failure = f"a tensor-parallel collective failed: {str(exc)[:300]}"
        return TensorParallelError(self.failure)

    # -- commands ---------------------------------------------------------------------------------

    def send(self, message: tuple) -> None:
        """A command to every worker, no answer awaited (a step's header)."""
        try:
            for conn in self.conns:
                conn.send(message)
        except OSError as exc:
            raise self.explain(exc) from exc

    def call(self, message: tuple, timeout_s: float = REPLY_TIMEOUT_S) -> list:
        """A command to every worker and each one's answer (rank order); a worker's error is raised here."""
        self.send(message)
        return [self.receive(rank, timeout_s) for rank in range(1, self.world_size)]

    def receive(self, rank: int, timeout_s: float = REPLY_TIMEOUT_S):
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        deadline = time.monotonic() + timeout_s
        while True:
            self.check()
            if conn.poll(0.1):
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError) as exc:
                    proc.wait(1.0) if proc.poll() is None else None
                    raise self.explain(exc) from exc
                if kind == "error":
                    raise TensorParallelError(f"tensor-parallel rank {rank}: {value}")
                return value
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel rank {rank} (pid {proc.pid}) did not answer "
                                          f"{timeout_s:g} s")

    def close(self) -> None:
        """Stop the workers (asked, then SIGKILLed after STOP_TIMEOUT_S); idempotent."""
        if self._ending[0]:
            return
        self._ending[0] = True
        os.close(self._stop_w)
        if self._watchdog is None:
            os.close(self._stop_r)
        for conn in self.conns:
            try:
                conn.send(("stop",))
            except OSError:
                pass
        self._finalizer()


def _pidfd_or_poll(proc: subprocess.Popen):
    """A file descriptor readable when proc ends (Linux pidfd), or None: the watchdog then polls."""
    if hasattr(os, "pidfd_open"):
        try:
            return os.pidfd_open(proc.pid)
        except OSError:
            return None
    return None


def _end_workers(procs: list[subprocess.Popen], conns: list, ending: list[bool]) -> None:
    """Close the channels, wait STOP_TIMEOUT_S for the workers to end, SIGKILL those left."""
    ending[0] = True  # their end is no failure
    for conn in conns:  # a worker reads its channel's end as "stop"
        conn.close()
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def start_ranks(config, hf_config, device, dtype, max_model_len: int):
    """Rank 0's tensor-parallel group and its started workers, for config.tensor_parallel_size ranks: a store on a
    free loopback port, ranks 1..N-1 started on it (each on its own GPU, cuda:(rank 0's index + rank), or the CPU),
    the process group joined. torch's CPU threads are shared out: each rank gets 1/N of rank 0's."""
    import torch

    from kvgate.common.errors import ConfigError
    from kvgate.engine.distributed.group import create_store

    size = config.tensor_parallel_size
    if device.type == "cuda":
        base = device.index or 0
        if torch.cuda.device_count() < base + size:
            raise ConfigError(f"tensor_parallel_size {size} needs GPUs cuda:{base}..cuda:{base + size - 1}, but torch "
                              f"sees {torch.cuda.device_count()}")
        devices = [f"cuda:{base + rank}" for rank in range(size)]
        torch.cuda.set_device(devices[0])
    else:
        devices = ["cpu"] * size
    threads = max(1, torch.get_num_threads() // size)
    torch.set_num_threads(threads)
    store = create_store(size)
    workers = TensorParallelWorkers(size)
    try:
        workers.start([WorkerStart(rank, size, store.port, config, hf_config, devices[rank], dtype, max_model_len,
                                   threads) for rank in range(1, size)])
        group = _join(workers, store, size, torch.device(devices[0]))
    except BaseException:
        workers.close()
        raise
    group.store = store  # the workers' rendezvous lives as long as the group
    workers.watch_group(group)
    return group, workers


def _join(workers: TensorParallelWorkers, store, size: int, device):
    """Rank 0's process group, made in a thread while this one watches the workers: one that dies before it
    joins fails the start at once instead of after the store's timeout."""
    from kvgate.engine.distributed.group import create_group

    made: dict = {}

    def join() -> None:
        try:
            made["group"] = create_group(store, 0, size, device)
        except BaseException as exc:  # noqa: BLE001 - raised on the caller's thread
            made["error"] = exc

    thread = threading.Thread(target=join, name="kvgate-tp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        workers.check()
    if "error" in made:
        raise made["error"]
    return made["group"]
