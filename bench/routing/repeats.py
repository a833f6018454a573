"""`kvgate bench routing --repeats R`: each (shape, rate, configuration) cell runs R times, each run on a fresh stack
with a request stream of its own, and the cell reports the runs together, with confidence intervals (stats.py).

Repeat 0 is `--seed`'s stream itself, so a one-repeat cell is the cell a run without --repeats gives. Repeat k ≥ 1
draws its stream (prompts, which prefix asks when, arrival times, output lengths, foreign share) from

    repeat_seed(seed, k) = numpy SeedSequence([seed, k]).generate_state(1)[0]      (a 32-bit number)

a seed no run of small `--seed` values uses, so the repeats of seed 0 are not seed 1's stream. Every configuration
of the cell gets the same R streams.

The cell's fields pool the runs: request counts and errors added up; TTFT quantiles over every succeeded request of
every run (routed p90 likewise); output tok/s, load spread, CPU per request and the EPP's time the runs' means;
the prefix-cache hit rate the runs' hits ÷ their queries. Each run's own result stays under `runs`.
"""

from __future__ import annotations

import numpy as np

from kvgate.bench.routing.stats import QUANTILES


def repeat_seed(seed: int, repeat: int) -> int:
    """The request stream's seed of repeat `repeat` of a cell run with `--seed seed` (module doc)."""
    if repeat == 0:
        return seed
    return int(np.random.SeedSequence([seed, repeat]).generate_state(1)[0])


def _pooled(values: list[float]) -> dict[str, float | None]:
    if not values:
        return dict.fromkeys(QUANTILES)
    return {k: round(float(np.percentile(values, 100 * q)), 4) for k, q in QUANTILES.items()}


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return round(float(np.mean(values)), 3) if values else None


def combine_runs(runs: list[dict]) -> dict:
    """One cell from its runs' results (runner.run_cell), each kept under `runs`; a single run is returned as is."""
    if len(runs) == 1:
        return dict(runs[0])
    errors: dict[str, int] = {}
    for r in runs:
        for kind, n in r["errors"].items():
            errors[kind] = errors.get(kind, 0) + n
    queries = sum(r["prefix_cache_queries"] for r in runs)
    cell = {
        "requests": sum(r["requests"] for r in runs), "sent": sum(r["sent"] for r in runs),
        "succeeded": sum(r["succeeded"] for r in runs), "failed": sum(r["failed"] for r in runs), "errors": errors,
        "output_tokens_per_s": round(float(np.mean([r["output_tokens_per_s"] for r in runs])), 2),
        "ttft_s": _pooled([t for r in runs for t in r["samples"]["ttft_s"]]),
        "prefix_cache_hit_rate": round(sum(r["prefix_cache_hits"] for r in runs) / queries, 4) if queries else None,
        "prefix_cache_queries": queries, "prefix_cache_hits": sum(r["prefix_cache_hits"] for r in runs),
        "load_spread": _mean([r["load_spread"] for r in runs]),
        "seconds": _mean([r["seconds"] for r in runs]),
    }
    if all("routed" in r for r in runs):
        cell["routed"] = {"requests": sum(r["routed"]["requests"] for r in runs),
                          "ttft_s": _pooled([t for r in runs for t in r["routed"].get("samples_ttft_s", [])])}
    if all("cpu" in r for r in runs):
        cell["cpu"] = {key: _mean([r["cpu"][key] for r in runs])
                       for key in ("gateway_ms_per_request", "engines_ms_per_request")}
    if all("epp_time" in r for r in runs):
        cell["epp_time"] = {}
        for part in {p for r in runs for p in r["epp_time"]}:
            got = [r["epp_time"][part] for r in runs if part in r["epp_time"]]
            n = sum(g["requests"] for g in got)
            cell["epp_time"][part] = {"requests": n,
                                      "mean_ms": round(sum(g["mean_ms"] * g["requests"] for g in got) / n, 3)}
    died = [r["died"] for r in runs if r.get("died")]
    if died:
        cell["died"] = "; ".join(died)
    cell["runs"] = runs
    return cell
