"""`kvgate bench chaos --faults rogue-engine`, as a user runs it, on three of its pages: a real `kvgate epp` on
kvgate's profile over stand-in engines, one of which serves a 400-digit block count, ±Inf counters and 2 MB in
1-byte chunks in turn while client threads pick over gRPC. No pick may fail, the EPP may log no traceback, and the
endpoint is picked again once its page is sound. (The p99 bound is the full bench's verdict: on a loaded CI
machine a short window's p99 is noise.)"""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.procs import KVGATE

pytestmark = [pytest.mark.processes, pytest.mark.slow]

PAGES = ("huge-int-labels", "inf-counters", "2mb-1-byte-chunks")


def test_a_rogue_engine_costs_only_itself(tmp_path):
    result_file = tmp_path / "rogue.json"
    run = subprocess.run([KVGATE, "bench", "chaos", "--faults", "rogue-engine", "--short", "--rogue-pages",
                          ",".join(PAGES), "--result-file", str(result_file)], capture_output=True, text=True,
                         timeout=300)
    assert result_file.exists(), run.stdout + run.stderr[-3000:]
    rogue = json.loads(result_file.read_text())["rogue_engine"]
    rows = {r["page"]: r for r in rogue["rows"]}
    assert set(rows) == {"clean", *PAGES}, run.stdout
    assert rogue["epp_tracebacks"] == 0, run.stdout
    for row in rows.values():
        assert row["picks"] > 0 and row["5xx"] == 0 and row["grpc_errors"] == 0, row
    for page in PAGES:
        assert rows[page]["recover_s"] is not None, rows[page]
    assert rows["clean"]["b_share"] > 0.5  # the idler endpoint is the pick while its page is sound
