"""CPU pinning for `kvgate bench routing --gateway-cpus`: the gateway tier (Envoy + the EPP, or an external router)
on its own CPUs, everything else of the cell (the sim engines and the bench's load generator) on the others — a
slower machine's share for the routing decision, the same for every configuration, so that a configuration whose
gateway tier costs more CPU per request pays for it in its latency.

Linux only (sched_setaffinity). A process is pinned with every thread it has and every process of its group
(`start_group` gives each child a process group of its own): threads and processes started later inherit the
affinity of the one that starts them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

# Which of a local stack's children (kvgate.stack.supervisor.Stack names) make the gateway tier.
GATEWAY_CHILDREN = ("epp", "envoy", "router")


def is_gateway(child_name: str) -> bool:
    """The gateway tier: Envoy, a router, and every EPP replica (epp, epp-1, ...)."""
    return child_name in GATEWAY_CHILDREN or child_name.startswith("epp-")


def parse_cpus(text: str) -> frozenset[int]:
    """'0', '0,2', '1-3' (the taskset / cpuset list form) -> a set of CPUs this process may use; ValueError names
    what is wrong."""
    allowed = os.sched_getaffinity(0)
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"not a CPU list: {text!r} (write e.g. 0 or 0,2 or 1-3)")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first or last - first > 4096:
            raise ValueError(f"not a CPU range: {part!r}")
        cpus.update(range(first, last + 1))
    missing = sorted(cpus - allowed)
    if missing:
        raise ValueError(f"CPUs {missing} are not available here (available: {sorted(allowed)})")
    return frozenset(cpus)


def cpus_flag(value: str | None, flag: str, command: str) -> frozenset[int] | None:
    """A command's CPU-list flag: None when not given, else parse_cpus' set; SystemExit naming the flag."""
    if value is None:
        return None
    try:
        return parse_cpus(value)
    except ValueError as exc:
        raise SystemExit(f"{command}: {flag}: {exc}") from None


def group_pids(pgid: int) -> list[int]:
    """Every process in process group pgid."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile
                continue
    return pids


def pin_process(pid: int, cpus: Iterable[int]) -> int:
    """Pin every thread of pid; the number of threads pinned (0 when the process is gone)."""
    cpus = set(cpus)
    pinned = 0
    try:
        tids = [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            pinned += 1
        except OSError:  # the thread ended meanwhile
            continue
    return pinned


def pin_group(pgid: int, cpus: Iterable[int]) -> int:
    """Pin every thread of every process of group pgid; the number of threads pinned."""
    cpus = set(cpus)
    return sum(pin_process(pid, cpus) for pid in group_pids(pgid))


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of pid, every thread of it (0 when it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) ": the comm may hold spaces
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS  # utime, stime (fields 14 and 15 of proc(5))


def group_cpu_seconds(pgid: int) -> float:
    """CPU seconds of every live process of group pgid."""
    return sum(process_cpu_seconds(pid) for pid in group_pids(pgid))


def split(gateway: frozenset[int]) -> tuple[frozenset[int], frozenset[int]]:
    """(gateway CPUs, the others' CPUs): the others get what this process may use less the gateway's, or all of it
    when nothing would be left (a one-CPU machine: pinning can only say where the gateway runs)."""
    allowed = frozenset(os.sched_getaffinity(0))
    rest = allowed - gateway
    return gateway, rest or allowed
