"""`kvgate up`'s children end with it, however it ends, and a taken gateway port is named, not half-started.

Every process of a stack carries a marker in its environment (children and grandchildren inherit it), so the
tests find whatever is left after the supervisor died — wherever it was reparented to.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tests.procs import KVGATE, free_port
from tests.test_up import descendants, read_until_up, start_up

pytestmark = pytest.mark.processes

MARK = "KVGATE_TEST_SUPERVISION_MARK"


def alive(pid: int) -> bool:
    """Running (not a zombie: a dead process whose new parent has not reaped it yet holds nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def marked(mark: str) -> set[int]:
    """Live processes whose environment carries `mark`."""
    out = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
            except OSError:
                continue
            if f"{MARK}={mark}".encode() in environ.split(b"\0") and alive(int(entry)):
                out.add(int(entry))
    return out


def port_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT left by closed connections is fine
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_for(condition, timeout_s: float) -> float | None:
    """Seconds until `condition()` held, or None if it did not within `timeout_s`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if condition():
            return time.monotonic() - t0
        time.sleep(0.05)
    return None


def cleanup(mark: str) -> None:
    for pid in marked(mark):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


SUPERVISOR = """
import os, sys, time
from pathlib import Path
from kvgate.common import processes
work = Path(sys.argv[1])
processes.start_group(["sh", "-c", "sleep 300 & sleep 300"], work / "a.log")
if sys.argv[2] == "forked":  # a fork (multiprocessing's, say) that outlives this process must not keep the pipe
    if os.fork() == 0:
        time.sleep(300)
        os._exit(0)
if sys.argv[2] == "reaper-killed":  # someone killed the reaper: the next child starts a new one, told of both
    processes._reaper.kill()
    processes._reaper.wait()
processes.start_group(["sh", "-c", "sleep 300 & sleep 300"], work / "b.log")
print("ready", flush=True)
time.sleep(300)
"""


@pytest.mark.parametrize("case", ["plain", "forked", "reaper-killed"])
def test_groups_started_by_a_tool_end_when_it_is_killed(tmp_path, monkeypatch, case):
    """What every kvgate tool starts through kvgate.common.processes (`kvgate up`, the chaos bench's stacks, `kvgate
    bench epp` and `serve`): a child and the child's own child end when the tool is SIGKILLed."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISOR, str(tmp_path), case], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "ready\n"

        def sleeps() -> set[int]:
            return {pid for pid in marked(mark) if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"sleep")}

        assert wait_for(lambda: len(sleeps()) == 4, 10.0) is not None, sleeps()  # two groups of two
        children = sleeps()
        proc.kill()
        proc.wait(timeout=10)
        took = wait_for(lambda: not any(alive(pid) for pid in children), 5.0)
        assert took is not None, [pid for pid in children if alive(pid)]
        print(f"{case}: children gone {took:.2f} s after the SIGKILL")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        cleanup(mark)


@pytest.mark.parametrize("how", ["SIGKILL", "SIGINT-then-SIGKILL"])
def test_children_and_grandchildren_end_with_a_killed_supervisor(tmp_path, monkeypatch, how):
    """SIGKILL `kvgate up` (as the OOM killer would), or SIGKILL it 0.5 s into its graceful stop: its engines,
    their engine-loop processes, the EPP and Envoy all end within a few seconds and free their ports."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    port = free_port()
    proc = start_up(tmp_path, port, "--backend", "sim", "--engine-arg=--engine-loop=process")
    try:
        output = read_until_up(proc, 240)
        assert "Ctrl-C stops everything" in output, output
        family = descendants(proc.pid)
        engines = [pid for pid in family if b"serve" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        ports = [port] + [int(re.search(rb"--port\x00(\d+)", Path(f"/proc/{pid}/cmdline").read_bytes()).group(1))
                          for pid in engines]
        grandchildren = family - {int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text()
                                  .split()}
        assert len(engines) == 2 and len(grandchildren) >= 2, family  # each engine's engine-loop process
        assert family <= marked(mark)
        if how == "SIGINT-then-SIGKILL":
            proc.send_signal(signal.SIGINT)
            time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        took = wait_for(lambda: not marked(mark) and all(port_free(p) for p in ports), 10.0)
        assert took is not None, (f"left running: {sorted(marked(mark))}, ports taken: "
                                  f"{[p for p in ports if not port_free(p)]}")
        print(f"{how}: every child gone and every port free {took:.2f} s after the supervisor's death")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        cleanup(mark)


def test_ctrl_c_during_start_up_stops_it(tmp_path, monkeypatch):
    """Ctrl-C while the engines are still loading stops `kvgate up` then and there — it does not bring the stack
    up first (which, with a real model, takes minutes: long enough for the user to reach for kill -9)."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    proc = start_up(tmp_path, free_port(), "--backend", "sim")
    try:
        started = wait_for(lambda: any(b"serve" in Path(f"/proc/{pid}/cmdline").read_bytes()
                                       for pid in descendants(proc.pid) if alive(pid)), 60.0)
        assert started is not None
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=60)[0]
        assert "is up" not in output and "interrupted by SIGINT" in output, output
        assert proc.returncode != 0
        assert wait_for(lambda: not marked(mark), 5.0) is not None, sorted(marked(mark))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        cleanup(mark)


def test_up_on_a_taken_port_names_it_and_starts_nothing(tmp_path, monkeypatch):
    """A gateway port another process listens on (a stack left behind): `kvgate up` exits non-zero at once with
    one line naming the port and its holder, and leaves nothing running."""
    mark = uuid.uuid4().hex
    monkeypatch.setenv(MARK, mark)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        env = dict(os.environ, KVGATE_CACHE_DIR=str(tmp_path / "cache"))
        try:
            done = subprocess.run([KVGATE, "up", "--replicas", "1", "--backend", "sim", "--port", str(port)],
                                  capture_output=True, text=True, env=env, timeout=120)
            errors = [line for line in done.stderr.splitlines() if line.startswith("kvgate up:")]
            assert done.returncode != 0, done
            assert len(errors) == 1 and re.search(rf"\b127\.0\.0\.1:{port}\b.*in use", errors[0]), done.stderr
            assert f"pid {os.getpid()}" in errors[0], errors  # who holds it: this test
            assert "is up" not in done.stdout
            assert wait_for(lambda: not marked(mark), 5.0) is not None, sorted(marked(mark))
        finally:
            cleanup(mark)
