"""`make check`'s unit lane (tests/conftest.py, Makefile): under --unit-lane a test that starts a process fails with
the marker it lacks, short helper probes of libraries excepted, and the lane leaves out the registered markers."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.conftest import StartsProcesses, _refuse

ROOT = Path(__file__).resolve().parents[1]


def test_a_refused_start_names_the_marker_to_add():
    refuse = _refuse("subprocess.Popen", lambda *a, **k: "started")
    with pytest.raises(StartsProcesses, match=r"@pytest\.mark\.processes"):
        refuse(["true"])


def test_a_library_probe_runs():
    """ctypes.util.find_library asks ldconfig: the call goes through from a frame of ctypes/util.py."""
    probe: dict = {}
    exec(compile("def ask(start):\n    return start(['ldconfig', '-p'])\n", "/usr/lib/python3/ctypes/util.py", "exec"),
         probe)
    assert probe["ask"](_refuse("subprocess.Popen", lambda *a, **k: "started")) == "started"


def test_the_lane_refuses_processes_while_it_runs(request):
    if not request.config.getoption("unit_lane"):
        pytest.skip("runs under --unit-lane (`make check`)")
    with pytest.raises(StartsProcesses):
        subprocess.run(["true"])


def test_make_check_leaves_out_registered_markers(pytestconfig):
    markers = {m.split(":")[0] for m in pytestconfig.getini("markers")}
    expression = re.search(r"^CHECK_MARKERS := (.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert set(re.findall(r"not (\w+)", expression)) == {"processes", "slow"} <= markers
    check = re.search(r"^check: venv\n\t(.+)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    assert "--unit-lane" in check and '-m "$(CHECK_MARKERS)"' in check and "--ignore=tests/e2e" in check
