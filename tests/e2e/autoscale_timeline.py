"""The autoscaling demonstration's record: samples of replicas and queue, requests with their TTFT, reduced to
one row per 10 s window (replicas, queue, TTFT p90) and drawn with matplotlib (test_autoscaling_e2e.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Timeline:
    t0: float
    samples: list[tuple[float, int, int, float]] = field(default_factory=list)  # (t, replicas, ready, queue)
    requests: list[tuple[float, int | str, float | None]] = field(default_factory=list)  # (start, outcome, ttft)
    marks: list[tuple[float, str]] = field(default_factory=list)

    def mark(self, t: float, what: str) -> None:
        self.marks.append((t - self.t0, what))

    def rows(self, window_s: float = 10.0) -> list[dict]:
        end = max([s[0] for s in self.samples] + [r[0] for r in self.requests] + [self.t0]) - self.t0
        out = []
        for i in range(int(end // window_s) + 1):
            lo, hi = i * window_s, (i + 1) * window_s
            samples = [s for s in self.samples if lo <= s[0] - self.t0 < hi]
            ttfts = sorted(r[2] for r in self.requests if lo <= r[0] - self.t0 < hi and r[2] is not None)
            failed = sum(1 for r in self.requests if lo <= r[0] - self.t0 < hi and r[1] != 200)
            out.append({"t": lo, "replicas": samples[-1][1] if samples else None,  # at the window's end
                        "ready": samples[-1][2] if samples else None,
                        "queue_max": max((s[3] for s in samples), default=None),
                        "requests": sum(1 for r in self.requests if lo <= r[0] - self.t0 < hi), "failed": failed,
                        "ttft_p90_s": ttfts[min(len(ttfts) - 1, math.ceil(0.9 * len(ttfts)) - 1)] if ttfts else None})
        return out

    def table(self, window_s: float = 10.0) -> str:
        lines = ["|   t (s) | replicas (end) | ready (end) | waiting (max) | requests | failed | TTFT p90 (s) |",
                 "|--------:|---------------:|------------:|--------------:|---------:|-------:|-------------:|"]
        for r in self.rows(window_s):
            def show(v, fmt="{}"):
                return "-" if v is None else fmt.format(v)
            lines.append(f"| {r['t']:7.0f} | {show(r['replicas']):>14} | {show(r['ready']):>11} | "
                         f"{show(r['queue_max'], '{:.0f}'):>13} | {r['requests']:>8} | {r['failed']:>6} | "
                         f"{show(r['ttft_p90_s'], '{:.2f}'):>12} |")
        return "\n".join(lines)

    def plot(self, path, title: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t = [s[0] - self.t0 for s in self.samples]
        fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
        ax1.step(t, [s[1] for s in self.samples], where="post", label="replicas (desired)")
        ax1.step(t, [s[2] for s in self.samples], where="post", label="replicas ready")
        ax1.set_ylabel("replicas")
        ax1b = ax1.twinx()
        ax1b.plot(t, [s[3] for s in self.samples], color="tab:red", alpha=0.6, label="waiting (EPP + engines)")
        ax1b.set_ylabel("waiting requests")
        ax1.legend(loc="upper left")
        ax1b.legend(loc="upper right")
        rows = self.rows()
        ax2.bar([r["t"] + 5 for r in rows], [r["ttft_p90_s"] or 0 for r in rows], width=8, label="TTFT p90 per 10 s")
        ax2.set_ylabel("TTFT p90 (s)")
        ax2.set_xlabel("seconds")
        for when, what in self.marks:
            for ax in (ax1, ax2):
                ax.axvline(when, color="gray", linestyle=":")
            ax2.annotate(what, (when, 0), rotation=90, fontsize=7, va="bottom")
        ax1.set_title(title)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
