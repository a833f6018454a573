"""`kvgate bench epp --parts latency`: the EPP's added latency over header-routed Envoy in alternating rounds, with
the EPP on a CPU of its own (--epp-cpus) where the machine has two, and the EPP's own share from its histogram."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

KVGATE = str(Path(sys.executable).parent / "kvgate")


def test_latency_part_in_rounds_with_the_epp_pinned(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    pin = ["--epp-cpus", str(cpus[0])] if len(cpus) >= 2 else []
    out = tmp_path / "epp.json"
    run = subprocess.run([KVGATE, "bench", "epp", "--parts", "latency", "--latency-requests", "40",
                          "--request-rate", "20", "--result-file", str(out), *pin],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    lat = json.loads(out.read_text())["latency"]
    assert lat["envoy_epp"]["ok"] == lat["envoy_direct"]["ok"] == 40  # 5 rounds of 8 on each path
    assert len(lat["added_p50_ms_per_round"]) == 5 and lat["added_p50_ms_median_of_rounds"] is not None
    # the EPP's histogram counted exactly the measured requests (the warm-up's were before), each inside the EPP
    # for less than the whole added path
    inside = lat["inside_epp"]["request_path"]
    assert inside["requests"] == 40 and 0 < inside["mean_ms"] < lat["envoy_epp"]["p50_ms"], lat
    if pin:
        assert lat["cpus"]["epp"] == [cpus[0]] and cpus[0] not in lat["cpus"]["others"], lat["cpus"]
        assert lat["cpus"]["threads_pinned"] > 4
    else:
        assert lat["cpus"] is None
    assert "inside the EPP" in run.stdout and "per round" in run.stdout
