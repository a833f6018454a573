"""`kvgate bench epp --parts scale`: the EPP scraping N real endpoints (one sim engine on N loopback ports) and
routing through Envoy, its added latency per endpoint count against header-routed Envoy, and its own histograms."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.processes

KVGATE = str(Path(sys.executable).parent / "kvgate")


def test_scale_part_at_two_endpoint_counts(tmp_path):
    out = tmp_path / "epp.json"
    run = subprocess.run([KVGATE, "bench", "epp", "--parts", "scale", "--endpoint-counts", "5,50",
                          "--latency-requests", "20", "--request-rate", "40", "--decisions", "100",
                          "--scale-idle-seconds", "0.5", "--result-file", str(out)],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    scale = json.loads(out.read_text())["scale"]
    assert list(scale["counts"]) == ["5", "50"]
    for count, r in scale["counts"].items():
        assert r["endpoints"] == int(count)
        assert r["requests_ok"] == r["requests_sent"] == 2 * 20 + 2 * 20, r  # warm-up and rounds, every one 200
        assert r["envoy_epp"]["ok"] == r["envoy_direct"]["ok"] == 20
        assert len(r["added_p50_ms_per_round"]) == 5
        # the EPP's histograms counted exactly the measured requests routed through it
        assert r["inside_epp"]["request_path"]["requests"] == 20 and r["inside_epp"]["decision"]["requests"] == 20
        assert 0 < r["inside_epp"]["decision"]["mean_ms"] <= r["inside_epp"]["request_path"]["mean_ms"]
        # every endpoint was scraped before the measurement, and kept being scraped while idle
        assert r["first_scrape_of_all_s"] >= 0 and r["idle"]["achieved_interval_ms"] > 0
        assert r["idle"]["epp_cpu_cores"] > 0
        assert r["in_process_decision"]["p50_us"] > 0
    assert scale["fd_limit"] >= 50 * 3
    table = run.stdout[run.stdout.index("scale:"):]
    assert "added p50" in table and "1.00x" in table and "80/80" in table
