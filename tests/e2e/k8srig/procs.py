"""Process groups for the rig: start, stop by id, and find anything the rig started that is still alive.

Every process the rig starts (control plane, pod runner, pod containers and their children) carries the
environment variable K8SRIG_ID=<rig id>. Environment is inherited, so /proc/<pid>/environ finds even a
grandchild that left its process group; teardown uses this to assert that nothing is left behind.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

MARKER = "K8SRIG_ID"


def start_group(argv: list[str], *, env: dict[str, str], log_path: Path, cwd: str | None = None
                ) -> subprocess.Popen:
    """Start argv as the leader of a new session/process group, output appended to log_path."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        return subprocess.Popen(argv, env=env, cwd=cwd, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(pgid: int, sig: int) -> bool:
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def stop_group(proc: subprocess.Popen, grace_s: float) -> int | None:
    """SIGTERM the process group, wait up to grace_s for the leader, then SIGKILL the group."""
    kill_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=max(0.1, grace_s))
    except subprocess.TimeoutExpired:
        pass
    kill_group(proc.pid, signal.SIGKILL)      # members that outlived their leader go too
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass
    return proc.returncode


def marked_processes(rig_id: str) -> list[int]:
    """PIDs of live processes whose environment carries K8SRIG_ID=rig_id (zombies excluded)."""
    needle = f"{MARKER}={rig_id}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            env = (entry / "environ").read_bytes()
            if needle not in env.split(b"\0"):
                continue
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            found.append(int(entry.name))
    return found


def kill_marked(rig_id: str, timeout_s: float = 10.0) -> list[int]:
    """SIGKILL every live process carrying the marker; return those that were found (before killing)."""
    found = marked_processes(rig_id)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while marked_processes(rig_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found
