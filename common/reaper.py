"""The reaper of a kvgate supervisor (`kvgate up`, the benchmarks): ends its children when it dies, however.

kvgate.common.processes starts one per supervisor process, in a session of its own, with the read end of a pipe as its
stdin, and writes to it what must end with the supervisor, one number a line, as kill(2) takes it: a pid, or
minus a process group's id. The supervisor holds the only write end, so the pipe reaches its end when the
supervisor does — by SIGKILL, the OOM killer, a crash or a normal exit alike — and the reaper then SIGTERMs what
is still there, SIGKILLs what is left GRACE_S later, and exits. Nobody waits for a graceful drain any more
(an engine's would take --shutdown-timeout), hence the short grace.

A child of kvgate's runs in a process group of its own, which holds what the child started too (an engine's
engine-loop process, multiprocessing's helpers, what a wrapper script runs) unless one of those makes a session
of its own. What has ended is forgotten every PRUNE_S, so a number the system hands out again later is not hit.

Standard library only, run by path (`python -I reaper.py`): it starts in milliseconds and imports nothing else
of kvgate's. No /proc, no prctl: it works wherever POSIX signals and pipes do.
"""

from __future__ import annotations

import os
import select
import signal
import time

GRACE_S = 0.5
PRUNE_S = 1.0


def alive(target: int) -> bool:
    """Whether a process (pid) or a process group (minus its id) still exists and may be signalled by us."""
    try:
        os.kill(target, 0)
    except (ProcessLookupError, PermissionError):  # gone, or the number is someone else's now
        return False
    return True


def signal_all(targets: set[int], sig: int) -> None:
    for target in targets:
        try:
            os.kill(target, sig)
        except (ProcessLookupError, PermissionError):
            pass


def end(targets: set[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM, then SIGKILL whatever is left after `grace_s`."""
    targets = {t for t in targets if alive(t)}
    signal_all(targets, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while targets and time.monotonic() < deadline:
        time.sleep(0.02)
        targets = {t for t in targets if alive(t)}
    signal_all(targets, signal.SIGKILL)


def watch(fd: int) -> set[int]:
    """Read targets from `fd` until its end (the supervisor is gone); what is still alive then."""
    targets: set[int] = set()
    pending = b""
    while True:
        if select.select([fd], [], [], PRUNE_S)[0]:
            data = os.read(fd, 65536)
            if not data:
                return {t for t in targets if alive(t)}
            *lines, pending = (pending + data).split(b"\n")
            targets.update(t for t in map(int, filter(None, lines)) if abs(t) > 1)  # never kill(-1) or kill(0)
        targets = {t for t in targets if alive(t)}


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the supervisor's to handle, not ours
    end(watch(0))


if __name__ == "__main__":
    main()
