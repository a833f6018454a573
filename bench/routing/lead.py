"""`kvgate bench routing --lead FILE,FILE,...`: whether a configuration leads the external cache-aware routers on
every seed, read off result files of the same sweep run with different seeds (typically `--rates saturation
--configs kvgate,sglang-router,vllm-router --seed S`).

Per shape and seed: the subject's (`--lead-subject`, default kvgate) TTFT p90 and output tok/s against the best
external router's in that file at the same rate — the lowest p90 and the highest tok/s, each taken on its own, as
report.add_ratios does —, as ratios where above 1 means the subject is ahead:

    p90 lead  = best router's TTFT p90 / subject's TTFT p90           (bar P90_BAR = 1.5)
    tok lead  = subject's output tok/s / best router's output tok/s   (bar TOK_BAR = 1.0)

A shape leads when every seed clears both bars. A subject cell with failed requests counts as not leading (its p90
is over the requests that made it). A router cell with failed requests still counts, at its measured p90: over the
requests that made it, that is a lower bound of its p90 with the lost ones counted as slowest, so it can only
understate the subject's lead (leaving the router out could overstate it, and with every router losing requests
there would be nothing to judge against). The table, the verdict per shape, and with `--plot` one panel per ratio, each seed a
point per shape with its interval, the bars drawn in.

Each lead also gets a 95% interval, bootstrapped from the two sides' cells: every cell's replicates drawn on its own
(stats.replicates: hierarchical over its runs, or within its one run), the lead computed per replicate — the lowest
of the routers' p90 draws over the subject's, the subject's tok/s draw over the highest of the routers' — and the
interval read off those ratios. A shape **leads with 95% confidence** when on every seed

    p90 lead's interval lies at or above P90_BAR                       (its lower bound ≥ 1.5)
    tok lead ≥ TOK_BAR, and its interval's lower bound ≥ TOK_BAR − TOK_MARGIN

Output tok/s gets a tolerance, not a lower bound at the bar: where both sides serve every request, the true ratio
is 1.0 (the same tokens over nearly the same span), so an interval around it always reaches below 1.0 and a lower
bound ≥ 1.0 could never be met by a router that loses nothing. The claim there is "not behind": the lower bound
within TOK_MARGIN of parity. A cell without samples (a result file from before intervals) leaves the verdict
unknown; intervals from one run per cell are within-run only and marked so. The exit status stays the point
verdict's.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvgate.bench.routing.configurations import EXTERNAL_ROUTERS
from kvgate.bench.routing.report import best_router, load_result_file, with_interval
from kvgate.bench.routing.stats import DEFAULT_DRAWS, cell_samples, interval, replicates

P90_BAR, TOK_BAR = 1.5, 1.0
TOK_MARGIN = 0.02  # output tok/s: how far below parity the interval's lower bound may reach (module doc)
BOOTSTRAP_SEED = 0
MAX_RESULT_BYTES = 64 << 20


def load_results(paths: list[Path]) -> list[dict]:
    results = []
    for path in paths:
        data = load_result_file(path, MAX_RESULT_BYTES)
        if not isinstance(data, dict) or not isinstance(data.get("workloads"), dict) or "seed" not in data:
            raise ValueError(f"{path} is not a `kvgate bench routing --result-file` of a sweep")
        results.append(data)
    return results


def _intervals(mine: dict, routers: list[dict], rng: np.random.Generator) -> dict:
    """The leads' 95% intervals from the cells' bootstrap replicates (module doc); None where a cell has no
    samples."""
    sides = [cell_samples(c) for c in [mine, *routers]]
    if any(not s for s in sides):
        return {"p90_lead_ci": None, "tok_lead_ci": None, "ci_method": None}
    subject, *others = [replicates(s, DEFAULT_DRAWS, rng) for s in sides]
    best_p90 = np.min([o["p90"] for o in others], axis=0)
    best_tok = np.max([o["output_tokens_per_s"] for o in others], axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        p90_lead = np.where(subject["p90"] > 0, best_p90 / subject["p90"], np.nan)
        tok_lead = np.where(best_tok > 0, subject["output_tokens_per_s"] / best_tok, np.nan)
    return {"p90_lead_ci": interval(p90_lead), "tok_lead_ci": interval(tok_lead),
            "ci_method": "hierarchical" if all(len(s) > 1 for s in sides) else "within-run",
            "runs": min(len(s) for s in sides)}


def _lead_of(cells: list[dict], subject: str, rng: np.random.Generator) -> dict | None:
    """The subject's lead over the best router in one shape's cells of one file (None: a side is missing)."""
    mine = next((c for c in cells if c.get("configuration") == subject), None)
    if mine is None:
        return None
    routers = [c for c in cells if c.get("configuration") in EXTERNAL_ROUTERS and c.get("rate") == mine["rate"]]
    if not routers:
        return None
    best_p90, best_tok = best_router(routers)  # a router that lost requests: its p90 as a lower bound (above)
    p90 = mine["ttft_s"]["p90"]
    ok = not mine["failed"]
    lead = {"rate": mine["rate"], "p90_s": p90, "best_router_p90_s": best_p90,
            "tok_s": mine["output_tokens_per_s"], "best_router_tok_s": best_tok, "failed": mine["failed"],
            "p90_lead": round(best_p90 / p90, 3) if ok and p90 and best_p90 else None,
            "tok_lead": round(mine["output_tokens_per_s"] / best_tok, 3) if ok and best_tok else None}
    lead.update(_intervals(mine, routers, rng) if ok else {"p90_lead_ci": None, "tok_lead_ci": None,
                                                             "ci_method": None})
    return lead


def _confident(s: dict) -> bool:
    """One seed clears both bars with 95% confidence (module doc)."""
    return (s["p90_lead_ci"][0] >= P90_BAR and s["tok_lead"] is not None and s["tok_lead"] >= TOK_BAR
            and s["tok_lead_ci"][0] >= TOK_BAR - TOK_MARGIN)


def leads(results: list[dict], subject: str = "kvgate") -> dict[str, dict]:
    """shape -> {"seeds": {seed: lead}, "leads": bool}, shapes in the order the files first name them."""
    out: dict[str, dict] = {}
    rng = np.random.default_rng(BOOTSTRAP_SEED)  # one stream, drawn on in file order: the same files, the same answer
    for result in results:
        for shape, workload in result["workloads"].items():
            lead = _lead_of(workload.get("cells", []), subject, rng)
            if lead is not None:
                out.setdefault(shape, {"seeds": {}})["seeds"][str(result["seed"])] = lead
    for entry in out.values():
        seeds = entry["seeds"].values()
        entry["leads"] = all(s["p90_lead"] is not None and s["p90_lead"] >= P90_BAR and s["tok_lead"] is not None
                             and s["tok_lead"] >= TOK_BAR for s in seeds)
        # with 95% confidence: False as soon as a seed is judged behind, None (unknown) where a seed has no interval
        judged = [_confident(s) if s["p90_lead_ci"] and s["tok_lead_ci"] else None if s["p90_lead"] is not None
                  else False for s in seeds]
        entry["leads_95"] = False if False in judged else None if None in judged else True
        methods = {s["ci_method"] for s in seeds if s["ci_method"]}
        entry["ci_method"] = "within-run" if "within-run" in methods else "hierarchical" if methods else None
    return out


def print_leads(found: dict[str, dict], subject: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{subject} against the best of {' / '.join(EXTERNAL_ROUTERS)}, per seed (p90 lead: router p90 "
                    f"÷ {subject}'s, bar {P90_BAR}; tok lead: {subject}'s tok/s ÷ router's, bar {TOK_BAR})",
              title_justify="left")
    for name in ("shape", "rate/s", "seeds", f"{subject} p90 s", "router p90 s", "p90 lead [95%]",
                 "tok lead [95%]", "leads", "leads, 95%"):
        t.add_column(name, justify="left" if name == "shape" else "right")

    def joined(seeds, key, fmt):
        return " / ".join("-" if s[key] is None else format(s[key], fmt) for s in seeds)

    def with_ci(seeds, key, fmt):
        return " / ".join(with_interval(s[key], s.get(f"{key}_ci"), fmt) for s in seeds)
    within = False
    for shape, entry in found.items():
        seeds = list(entry["seeds"].values())
        confident = {True: "yes", False: "no", None: "-"}[entry.get("leads_95")]
        if entry.get("ci_method") == "within-run" and entry.get("leads_95") is not None:
            confident, within = confident + "*", True
        t.add_row(shape, " / ".join(f"{s['rate']:g}" for s in seeds), " / ".join(entry["seeds"]),
                  joined(seeds, "p90_s", ".2f"), joined(seeds, "best_router_p90_s", ".2f"),
                  with_ci(seeds, "p90_lead", ".2f"), with_ci(seeds, "tok_lead", ".3f"),
                  "yes" if entry["leads"] else "no", confident)
    console = Console(width=240)
    console.print(t)
    console.print(f"leads, 95%: on every seed the p90 lead's interval at or above {P90_BAR}, tok lead ≥ {TOK_BAR} "
                  f"and its interval's lower bound ≥ {TOK_BAR - TOK_MARGIN:g}; -: a cell without samples (an older "
                  "result file)" + ("; *: some cell ran once, so its interval is within-run only and too narrow "
                                    "(--repeats)" if within else ""))


def plot_leads(found: dict[str, dict], path: str, subject: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    shapes = list(found)
    fig, axes = plt.subplots(1, 2, figsize=(max(8.0, 1.1 * len(shapes) + 3), 4.2))
    for ax, key, bar, title, scale in (
            (axes[0], "p90_lead", P90_BAR, f"TTFT p90: best router's ÷ {subject}'s", "log"),
            (axes[1], "tok_lead", TOK_BAR, f"output tok/s: {subject}'s ÷ best router's", "linear")):
        for x, shape in enumerate(shapes):
            color = "tab:green" if found[shape]["leads"] else "tab:red"
            for s in found[shape]["seeds"].values():
                if s[key] is None:
                    continue
                ci = s.get(f"{key}_ci")
                yerr = [[max(s[key] - ci[0], 0)], [max(ci[1] - s[key], 0)]] if ci else None
                ax.errorbar([x], [s[key]], yerr=yerr, fmt="o", color=color, capsize=3, zorder=3)
        ax.axhline(bar, color="black", linestyle="--", linewidth=1, label=f"bar {bar:g}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xticks(range(len(shapes)), shapes, rotation=40, ha="right")
        ax.set(title=title, yscale=scale)
        if scale == "log":
            ax.yaxis.set_major_locator(matplotlib.ticker.FixedLocator([0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 20]))
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.3g"))
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
