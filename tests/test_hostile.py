"""`kvgate bench hostile --short`, as a user runs it: every attack of bench/chaos/attacks.py against one local stack
(sim engines with KV events, the EPP on kvgate's profile, kvgate's Envoy) while good streams flow. Each row must
hold: no good request lost, each attack answered as it should be (a clear 4xx where it is refused), no process
died or would have failed a kubelet's liveness probe, memory bounded, the EPP still reading engine events. The
same command, full length, is the hostile bench itself."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvgate.bench.chaos.attacks import ATTACKS
from tests.procs import KVGATE

pytestmark = [pytest.mark.processes, pytest.mark.slow]


def test_every_attack_is_absorbed_while_good_traffic_flows(tmp_path):
    result_file = tmp_path / "hostile.json"
    run = subprocess.run([KVGATE, "bench", "hostile", "--short", "--result-file", str(result_file)],
                         capture_output=True, text=True, timeout=600)
    assert result_file.exists(), run.stdout + run.stderr[-3000:]
    result = json.loads(result_file.read_text())
    rows = {r["window"]: r for r in result["windows"]}
    assert set(rows) == {"baseline", "after", *(a.name for a in ATTACKS)}, run.stdout
    assert all(ok for ok in result["checks"].values()) and run.returncode == 0, run.stdout
    for attack in ATTACKS:
        row = rows[attack.name]
        assert row["expectation_met"] and row["failed"] == 0, row
    # refusals name what was wrong
    assert "regex" in rows["regex-bomb"]["detail"] or rows["regex-bomb"]["answers"] == [200], rows["regex-bomb"]
    assert all(a == 400 for a in rows["huge-token-id"]["answers"]), rows["huge-token-id"]
    # the good traffic was served all along: some of it inside every attack that lasted long enough to see it
    assert rows["baseline"]["sent"] > 0 and rows["after"]["sent"] > 0
    assert result["epp_kv_events"].get("batches", 0) > 0
