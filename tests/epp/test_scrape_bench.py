"""`kvgate bench scrape` end to end at a small scale: the served page honours name[], the numbers add up."""

from __future__ import annotations

import json
import subprocess

import pytest

from kvgate.epp.datalayer import DIALECTS, parse_metrics
from kvgate.bench.datalayer import filtered_page, metrics_page
from tests.procs import KVGATE


def test_the_served_page_narrowed_like_prometheus_client_still_parses_the_same():
    page = metrics_page()
    narrowed = filtered_page(page, set(DIALECTS["vllm"].families()))
    assert len(narrowed) < len(page) / 5
    whole, small = (parse_metrics(p.decode(), DIALECTS["vllm"]) for p in (page, narrowed))
    assert whole == small and (small.waiting_queue_size, small.kv_block_size) == (3, 16)


@pytest.mark.processes
def test_bench_scrape_runs_and_writes_json(tmp_path):
    result = tmp_path / "scrape.json"
    r = subprocess.run([KVGATE, "bench", "scrape", "--endpoint-counts", "5,10", "--seconds", "0.5",
                        "--result-file", str(result)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "filtered / whole page CPU" in r.stdout and "CPU per scrape at 10 vs 5 endpoints" in r.stdout
    runs = json.loads(result.read_text())["runs"]
    assert [run["filtered"]["endpoints"] for run in runs] == [5, 10]
    for run in runs:
        for mode in ("filtered", "whole_page"):
            r = run[mode]
            assert r["failures"] == 0 and r["fresh_endpoints"] == r["endpoints"]
            assert r["scrapes_per_s"] > 0.5 * r["target_scrapes_per_s"] and r["epp_cpu_cores"] > 0
            assert 0 <= r["loop_lag_p50_ms"] <= r["loop_lag_p99_ms"] <= r["loop_lag_max_ms"]
