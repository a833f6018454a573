"""`kvgate bench routing --lead` (bench/routing/lead.py): the verdict whether the subject leads on
every seed's result file, on files whose answer is known."""

from __future__ import annotations

import importlib.util
import json

import pytest

from kvgate.cli import main


def cell(config: str, p90: float | None, tok: float, rate: float = 12.0, failed: int = 0) -> dict:
    return {"configuration": config, "rate": rate, "ttft_s": {"p50": None, "p90": p90, "p99": None},
            "output_tokens_per_s": tok, "failed": failed}


def result(seed: int, shapes: dict[str, list[dict]]) -> dict:
    return {"seed": seed, "workloads": {name: {"what": "", "cells": cells} for name, cells in shapes.items()}}


def test_lead_needs_every_seed_over_both_bars(tmp_path, capsys):
    files = []
    for seed, (a_kvgate, b_kvgate_tok) in enumerate([(0.2, 500), (0.3, 505)]):
        f = tmp_path / f"s{seed}.json"
        f.write_text(json.dumps(result(seed, {
            # leads: routers' best p90 0.5 (≥1.5× the subject's on both seeds), tok/s 500 at most
            "a": [cell("kvgate", a_kvgate, 520), cell("sglang-router", 0.5, 500), cell("vllm-router", 0.9, 480)],
            # p90 ahead on both seeds but tok/s behind on seed 1
            "b": [cell("kvgate", 0.2, b_kvgate_tok), cell("sglang-router", 1.0, 501)],
            # behind on p90
            "c": [cell("kvgate", 1.0, 600), cell("vllm-router", 1.2, 500), cell("round-robin", 5.0, 300)],
            # no router cell: not judged
            "d": [cell("kvgate", 1.0, 600)],
        })))
        files.append(f)
    out, plot = tmp_path / "lead.json", tmp_path / "lead.png"
    # the plot only where the bench extra (matplotlib) is installed: `make test` installs the test extra alone
    plotting = importlib.util.find_spec("matplotlib") is not None
    rc = main(["bench", "routing", "--lead", ",".join(map(str, files)), "--result-file", str(out)]
              + (["--plot", str(plot)] if plotting else []))
    assert rc == 1  # not every shape leads
    found = json.loads(out.read_text())["shapes"]
    assert set(found) == {"a", "b", "c"}
    assert found["a"]["leads"] and found["a"]["seeds"]["0"]["p90_lead"] == 2.5
    assert found["a"]["seeds"]["1"]["tok_lead"] == pytest.approx(520 / 500)
    assert not found["b"]["leads"] and found["b"]["seeds"]["0"]["tok_lead"] == pytest.approx(500 / 501, abs=1e-3)
    assert not found["c"]["leads"] and found["c"]["seeds"]["1"]["p90_lead"] == 1.2
    assert plot.stat().st_size > 10_000 if plotting else not plot.exists()
    text = capsys.readouterr().out
    assert "2.50 / 1.67" in text and "yes" in text


def test_a_failed_subject_cell_does_not_lead_and_bad_files_are_refused(tmp_path):
    f = tmp_path / "s0.json"
    f.write_text(json.dumps(result(0, {"a": [cell("kvgate", 0.1, 900, failed=3), cell("sglang-router", 2.0, 500)],
                                       # routers that lost requests count at their measured p90, a lower bound
                                       "b": [cell("kvgate", 1.0, 600), cell("sglang-router", 4.0, 400, failed=2),
                                             cell("vllm-router", 3.0, 410, failed=1)]})))
    out = tmp_path / "lead.json"
    assert main(["bench", "routing", "--lead", str(f), "--result-file", str(out)]) == 1
    found = json.loads(out.read_text())["shapes"]
    assert found["a"]["seeds"]["0"]["p90_lead"] is None
    assert found["b"]["seeds"]["0"]["p90_lead"] == 3.0 and found["b"]["leads"]
    for text in ("[]", '{"workloads": {}}', "{"):
        f.write_text(text)
        with pytest.raises(SystemExit, match="--lead"):
            main(["bench", "routing", "--lead", str(f)])
    with pytest.raises(SystemExit, match="--lead"):
        main(["bench", "routing", "--lead", str(tmp_path / "missing.json")])
