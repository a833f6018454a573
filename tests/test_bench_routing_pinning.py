"""`kvgate bench routing --gateway-cpus`: CPU lists parsed as taskset writes them, and a whole process group pinned,
every thread of every process, threads started later included (they inherit)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvgate.bench.routing import pinning

CPUS = sorted(os.sched_getaffinity(0))

# A process group: a parent with two extra threads and a child process, all sleeping until killed.
PROGRAM = """
import subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
for _ in range(2):
    threading.Thread(target=time.sleep, args=(120,), daemon=True).start()
print(child.pid, flush=True)
time.sleep(120)
"""


def test_cpu_lists_parse_like_taskset():
    assert pinning.parse_cpus(str(CPUS[0])) == {CPUS[0]}
    assert pinning.parse_cpus(",".join(map(str, CPUS))) == set(CPUS)
    if CPUS == list(range(CPUS[0], CPUS[-1] + 1)):
        assert pinning.parse_cpus(f"{CPUS[0]}-{CPUS[-1]}") == set(CPUS)
    for bad in ("", "a", "1-", "-1", "3-1", "0,,1", "0-99999"):
        with pytest.raises(ValueError):
            pinning.parse_cpus(bad)
    with pytest.raises(ValueError, match="not available"):
        pinning.parse_cpus(str(max(CPUS) + 1))


def test_split_leaves_the_others_the_rest_or_everything():
    gateway, rest = pinning.split(frozenset({CPUS[0]}))
    assert gateway == {CPUS[0]}
    assert rest == (set(CPUS) - {CPUS[0]} or set(CPUS))


@pytest.mark.processes
def test_a_process_group_is_pinned_whole():
    proc = subprocess.Popen([sys.executable, "-c", PROGRAM], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        pids = {proc.pid, child}
        deadline = time.monotonic() + 10
        while set(pinning.group_pids(proc.pid)) != pids and time.monotonic() < deadline:
            time.sleep(0.05)
        assert set(pinning.group_pids(proc.pid)) == pids
        threads = pinning.pin_group(proc.pid, {CPUS[-1]})
        assert threads >= 4  # the parent's main thread and two more, the child's main thread
        for pid in pids:
            for task in Path(f"/proc/{pid}/task").iterdir():
                assert os.sched_getaffinity(int(task.name)) == {CPUS[-1]}
        assert pinning.pin_process(2**22 + 12345, {CPUS[0]}) == 0  # no such process: nothing, no error
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def test_every_epp_replica_is_in_the_gateway_tier():
    assert all(pinning.is_gateway(n) for n in ("epp", "epp-1", "epp-3", "envoy", "router"))
    assert not any(pinning.is_gateway(n) for n in ("engine-0", "engine-12", "eppx"))


# A process group that burns CPU in a child process and in a thread of the parent: what the bench charges a
# child of its stack is every process and thread of the group.
BURNER = """
import subprocess, sys, threading, time
def burn():
    end = time.process_time() + 0.4
    while time.process_time() < end:
        pass
child = subprocess.Popen([sys.executable, "-c", "import time\\nend = time.process_time() + 0.4\\n"
                          "while time.process_time() < end: pass\\ntime.sleep(120)"])
t = threading.Thread(target=burn, daemon=True)
t.start()
t.join()
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.processes
def test_cpu_seconds_count_every_process_and_thread_of_a_group():
    from kvgate.bench.routing.runner import cpu_use

    proc = subprocess.Popen([sys.executable, "-c", BURNER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        child = int(proc.stdout.readline())
        deadline = time.monotonic() + 30  # the child burns its 0.4 s of CPU, however loaded this machine is
        while pinning.process_cpu_seconds(child) < 0.4 and time.monotonic() < deadline:
            time.sleep(0.05)
        # the parent's thread (0.4 s) and the child's loop (0.4 s), start-up on top; ticks are 10 ms
        assert pinning.group_cpu_seconds(proc.pid) >= 0.78
        assert pinning.process_cpu_seconds(proc.pid) >= 0.39  # a thread's CPU is its process's
        assert pinning.process_cpu_seconds(2**22 + 12345) == 0.0  # gone: nothing, no error
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    used = cpu_use({"epp": 1.0, "envoy": 2.0, "engine-0": 3.0},
                   {"epp": 3.0, "envoy": 2.5, "engine-0": 4.0, "engine-1": 1.0}, requests=100)
    assert used["seconds"] == {"epp": 2.0, "envoy": 0.5, "engine-0": 1.0, "engine-1": 1.0}
    assert (used["gateway_s"], used["engines_s"]) == (2.5, 2.0)
    assert (used["gateway_ms_per_request"], used["engines_ms_per_request"]) == (25.0, 20.0)
    assert cpu_use({}, {}, requests=0)["gateway_ms_per_request"] is None
    assert cpu_use({"engine-0": 9.0}, {"engine-0": 0.5}, requests=1)["seconds"] == {"engine-0": 0.5}  # restarted
