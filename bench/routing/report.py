"""What `kvgate bench routing` shows: ratios added to each cell, one rich table per workload, and the plot.

Ratios at the same rate: output tok/s ÷ round-robin's (higher is better) and TTFT p90 ÷ round-robin's (lower is
better); the same against the best external cache-aware router present (highest tok/s, lowest TTFT p90 of
sglang-router / vllm-router, each taken on its own). Each TTFT p90 is printed with its 95% confidence interval
(the cell's `ci`, stats.py) when it has one."""

from __future__ import annotations

import json
from pathlib import Path

from kvgate.bench.routing.configurations import EXTERNAL_ROUTERS


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def best_router(routers: list[dict]) -> tuple[float | None, float | None]:
    """The best of some router cells, each measure on its own: the lowest TTFT p90 and the highest output tok/s
    (None where there is none)."""
    p90s = [c["ttft_s"]["p90"] for c in routers if c["ttft_s"]["p90"] is not None]
    return (min(p90s) if p90s else None), max((c["output_tokens_per_s"] for c in routers), default=None)


def load_result_file(path: Path, max_bytes: int) -> object:
    """A `--result-file` read back as JSON, refused (ValueError) past max_bytes before it is read."""
    if path.stat().st_size > max_bytes:
        raise ValueError(f"{path} is over {max_bytes} bytes: not a kvgate bench routing result")
    return json.loads(path.read_text())


def add_ratios(cells: list[dict]) -> None:
    """Each cell gets `vs_round_robin` and, where a router ran at its rate, `vs_best_router`."""
    for cell in cells:
        same_rate = [c for c in cells if c["rate"] == cell["rate"]]
        rr = next((c for c in same_rate if c["configuration"] == "round-robin"), None)
        routers = [c for c in same_rate if c["configuration"] in EXTERNAL_ROUTERS]
        if rr is not None:
            cell["vs_round_robin"] = {
                "output_tokens_per_s": _ratio(cell["output_tokens_per_s"], rr["output_tokens_per_s"]),
                "ttft_p90": _ratio(cell["ttft_s"]["p90"], rr["ttft_s"]["p90"])}
        if routers:
            best_p90, best_tok = best_router(routers)
            cell["vs_best_router"] = {"output_tokens_per_s": _ratio(cell["output_tokens_per_s"], best_tok),
                                      "ttft_p90": _ratio(cell["ttft_s"]["p90"], best_p90)}


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def with_interval(value, interval, fmt: str = ".2f") -> str:
    """`0.43 [0.38, 0.51]`, or the value alone without an interval."""
    if value is None:
        return "-"
    return format(value, fmt) + (f" [{format(interval[0], fmt)}, {format(interval[1], fmt)}]" if interval else "")


def table(workload: str, what: str, cells: list[dict]):
    from rich.table import Table

    routers = any(c["configuration"] in EXTERNAL_ROUTERS for c in cells)
    t = Table(title=f"{workload}: {what}", title_justify="left")
    for name in ("rate/s", "configuration", "ok/sent", "errors", "out tok/s", "×RR", "TTFT p50", "p90", "p99",
                 "p90 ×RR", "hit rate", "spread"):
        t.add_column(name, justify="left" if name in ("configuration", "errors") else "right")
    if routers:
        t.add_column("tok/s ×router", justify="right")
        t.add_column("p90 ×router", justify="right")
    foreign = any("routed" in c for c in cells)
    if foreign:
        t.add_column("routed p90", justify="right")
    epp = any("epp_time" in c for c in cells)
    if epp:
        t.add_column("EPP ms/req", justify="right")
    cpu = any("cpu" in c for c in cells)
    if cpu:
        t.add_column("CPU ms/req gw", justify="right")
        t.add_column("engines", justify="right")
    for c in sorted(cells, key=lambda c: c["rate"]):
        vs_rr, vs_router = c.get("vs_round_robin", {}), c.get("vs_best_router", {})
        ttft = c["ttft_s"]
        row = [f"{c['rate']:g}", c["configuration"], f"{c['succeeded']}/{c['requests']}",
               ", ".join(f"{k} ×{v}" for k, v in c["errors"].items()) or "0",
               f"{c['output_tokens_per_s']:.0f}", _num(vs_rr.get("output_tokens_per_s"), ".2f"),
               _num(ttft["p50"], ".2f"), with_interval(ttft["p90"], c.get("ci", {}).get("ttft_s", {}).get("p90")),
               _num(ttft["p99"], ".2f"),
               _num(vs_rr.get("ttft_p90"), ".2f"),
               "-" if c["prefix_cache_hit_rate"] is None else f"{100 * c['prefix_cache_hit_rate']:.0f}%",
               _num(c["load_spread"], ".2f")]
        if routers:
            row += [_num(vs_router.get("output_tokens_per_s"), ".2f"), _num(vs_router.get("ttft_p90"), ".2f")]
        if foreign:
            row.append(_num(c.get("routed", {}).get("ttft_s", {}).get("p90"), ".2f"))
        if epp:
            row.append(_num(c.get("epp_time", {}).get("request_path", {}).get("mean_ms"), ".2f"))
        if cpu:
            row += [_num(c.get("cpu", {}).get("gateway_ms_per_request"), ".1f"),
                    _num(c.get("cpu", {}).get("engines_ms_per_request"), ".1f")]
        t.add_row(*row)
    return t


def print_tables(result: dict, console=None) -> None:
    from rich.console import Console

    console = console or Console(width=220)
    for name, workload in result["workloads"].items():
        console.print(table(name, workload["what"], workload["cells"]))
    repeats = result.get("repeats", 1)
    console.print("p90 \\[lo, hi]: the 95% confidence interval, " + (
        f"a hierarchical bootstrap over the cell's {repeats} runs (each its own request stream) and their requests"
        if repeats > 1 else "a bootstrap over the cell's requests within its one run: it leaves out how much a run's "
        "placement moves between runs, so it is too narrow for a claim (--repeats)"))
    console.print("out tok/s: output tokens of the succeeded requests ÷ seconds from the first arrival to the last "
                  "answer; TTFT in seconds; ×RR: against round-robin at the same rate (×router: the best of "
                  "sglang-router / vllm-router); hit rate: the engines' prefix-cache hits ÷ queries (tokens) over the "
                  "run; spread: the busiest replica's requests ÷ the mean; routed p90 (with --foreign-share): TTFT "
                  "p90 of the requests the configuration routed, the foreign gateway's left out; EPP ms/req: the "
                  "EPP's mean time on a request's path (body parse, slow plugin work, decision); CPU ms/req: CPU "
                  "time over the cell ÷ requests sent, of the gateway tier (Envoy + EPP, or the router) and of the "
                  "engines")
    for name, c in result["configurations"].items():
        if c.get("skipped"):
            console.print(f"skipped {name}: {c['skipped']}")


def plot(result: dict, path: str) -> None:
    """TTFT p90 and output tok/s against request rate, one line per configuration, one row per workload."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(result["workloads"].items())
    fig, axes = plt.subplots(len(workloads), 2, figsize=(11, 3.6 * len(workloads)), squeeze=False)
    for row, (name, workload) in enumerate(workloads):
        by_config: dict[str, list[dict]] = {}
        for c in workload["cells"]:
            by_config.setdefault(c["configuration"], []).append(c)
        for config, cells in by_config.items():
            cells.sort(key=lambda c: c["rate"])
            rates = [c["rate"] for c in cells]
            p90s = [c["ttft_s"]["p90"] for c in cells]
            intervals = [c.get("ci", {}).get("ttft_s", {}).get("p90") for c in cells]
            if all(i is not None and p is not None for i, p in zip(intervals, p90s)):
                errors = [[p - i[0] for p, i in zip(p90s, intervals)], [i[1] - p for p, i in zip(p90s, intervals)]]
                axes[row][0].errorbar(rates, p90s, yerr=[[max(e, 0) for e in side] for side in errors],
                                      marker="o", capsize=3, label=config)
            else:
                axes[row][0].plot(rates, p90s, marker="o", label=config)
            axes[row][1].plot(rates, [c["output_tokens_per_s"] for c in cells], marker="o", label=config)
        axes[row][0].set(title=f"{name}: TTFT p90 (95% interval)", xlabel="requests/s", ylabel="seconds", yscale="log")
        axes[row][1].set(title=f"{name}: output throughput", xlabel="requests/s", ylabel="tokens/s")
        axes[row][0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
