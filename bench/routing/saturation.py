"""`kvgate bench routing --find-saturation`: each workload shape's saturation rate, where the routing comparison
is to be made: the rate at which round-robin's TTFT p90 reaches `factor` times its light-load value.

A rate that saturates one shape is idle or hopeless for another: one rate can leave a shape with shared prefixes
queueing a little while a shape that shares nothing is far past capacity, where every router queues the same and
the comparison says nothing. So the sweep's rate is found per shape, with round-robin (the baseline every
configuration is judged against):

    light       round-robin's TTFT p90 at `light_rate` (default 1 req/s: no queue)
    target      factor × light (default 10)
    ramp        rates start_rate × growth^k until one reaches the target (or max_rate / max_probes)
    bisect      `bisect_steps` geometric midpoints between the last rate below the target and the first above
    saturation  the lowest probed rate whose p90 reached the target (None: none did within the bounds)

TTFT p90 is noisy and only roughly monotone in the rate, so the answer is a probed rate, with every probe reported,
not an interpolation. A cell whose only losses are requests still queued when its drain ended is past the target
(`cell_p90`: inf). `measure(rate)` runs one cell and returns its TTFT p90 in seconds (None: the cell failed).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.bench.routing.report import load_result_file

DEFAULT_FACTOR = 10.0
DEFAULT_LIGHT_RATE = 1.0
DEFAULT_START_RATE = 4.0
DEFAULT_GROWTH = 1.5
DEFAULT_MAX_RATE = 200.0
DEFAULT_MAX_PROBES = 10
DEFAULT_BISECT_STEPS = 2


# Each shape's saturation rate on the bench's 4 sim replicas: what `--rates saturation` runs each shape at. Found
# by `kvgate bench routing --find-saturation --shapes tuning,held-out,held-out-2,held-out-3 --duration 20 --drain 20
# --saturation-start 6 --seed 0` and, for the mixed-hardware set, `kvgate bench routing --find-saturation --shapes
# mixed-hardware --duration 15 --drain 30`, and for held-out-4 the first command's flags with `--workloads NAME`, one
# shape at a time (every probe in docs/benchmarks.md). Kept fixed like the held-out sets: rates are not re-found to
# suit a profile.
SATURATION_RATES: dict[str, float] = {
    "multi-tenant": 16.53, "multi-turn": 14.94, "no-reuse": 18.30, "many-tenants": 22.41, "bursty-tenants": 16.53,
    "hot-tenant": 22.41, "long-output": 8.13, "small-kv": 9.00, "deep-chat": 9.96, "mixed-lengths": 16.53,
    "small-kv-turns": 11.02, "mixed-speed": 9.00, "mixed-speed-no-reuse": 12.20,
    "mixed-generations": 8.13, "mixed-kv": 11.02, "skewed-tenants": 20.25,
    "agent-sessions": 6.64, "shifting-tenants": 27.45, "user-documents": 20.25,
}
MAX_RESULT_BYTES = 1 << 20


def rates_from_result(path: Path) -> dict[str, float]:
    """Shape -> saturation rate from a `--find-saturation --result-file` (shapes it did not saturate left out)."""
    data = load_result_file(path, MAX_RESULT_BYTES)
    workloads = data.get("workloads") if isinstance(data, dict) and "find_saturation" in data else None
    if not isinstance(workloads, dict):
        raise ValueError(f"{path} is not a --find-saturation result (no find_saturation / workloads)")
    rates = {}
    for name, found in workloads.items():
        rate = found.get("saturation_rate") if isinstance(found, dict) else None
        if isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 < rate <= 1000:
            rates[str(name)] = float(rate)
    return rates


@dataclass
class Saturation:
    light_rate: float
    light_p90_s: float | None
    target_p90_s: float | None
    rate: float | None  # the lowest probed rate at or past the target; None when no probe reached it
    probes: list[tuple[float, float | None]] = field(default_factory=list)  # (rate, TTFT p90 s) in probing order

    def as_dict(self) -> dict:
        return {"light_rate": self.light_rate, "light_p90_s": self.light_p90_s, "target_p90_s": self.target_p90_s,
                "saturation_rate": self.rate, "probes": [_probe(r, p) for r, p in self.probes]}


def _probe(rate: float, p90: float | None) -> dict:
    if p90 is not None and math.isinf(p90):  # JSON has no infinity: requests were left unfinished
        return {"rate": round(rate, 3), "ttft_p90_s": None, "unfinished": True}
    return {"rate": round(rate, 3), "ttft_p90_s": p90}


def find_saturation(measure: Callable[[float], float | None], *, factor: float = DEFAULT_FACTOR,
                    light_rate: float = DEFAULT_LIGHT_RATE, start_rate: float = DEFAULT_START_RATE,
                    growth: float = DEFAULT_GROWTH, max_rate: float = DEFAULT_MAX_RATE,
                    max_probes: int = DEFAULT_MAX_PROBES, bisect_steps: int = DEFAULT_BISECT_STEPS) -> Saturation:
    if not (factor > 1 and 0 < light_rate < start_rate <= max_rate and growth > 1 and max_probes >= 2
            and bisect_steps >= 0):
        raise ValueError("saturation search needs factor > 1, 0 < light rate < start rate <= max rate, growth > 1, "
                         "at least 2 probes and bisect steps >= 0")
    light = measure(light_rate)
    found = Saturation(light_rate, light, None, None, [(light_rate, light)])
    if light is None or light <= 0:
        return found  # the light cell failed: nothing to scale a target from
    found.target_p90_s = target = factor * light
    below, above, rate = light_rate, None, start_rate
    while len(found.probes) < max_probes and rate <= max_rate:
        p90 = measure(rate)
        found.probes.append((rate, p90))
        if p90 is not None and p90 >= target:
            above = rate
            break
        below, rate = rate, rate * growth
    for _ in range(bisect_steps):
        if above is None or len(found.probes) >= max_probes:
            break
        mid = (below * above) ** 0.5
        p90 = measure(mid)
        found.probes.append((mid, p90))
        if p90 is not None and p90 >= target:
            above = mid
        else:
            below = mid
    found.rate = above
    return found


def cell_p90(cell: dict) -> float | None:
    """A round-robin cell's TTFT p90 for the search: past capacity, requests still queued when the drain ends
    (`unfinished ...` in the cell's errors) have no first token — a cell that lost only those is past the target
    (inf), not a failed cell; any other failure is (None)."""
    if cell["requests"] <= 0 or cell["sent"] != cell["requests"]:
        return None
    if cell["succeeded"] == cell["requests"]:
        return cell["ttft_s"]["p90"]
    if all(kind.startswith("unfinished") for kind in cell["errors"]):
        return float("inf")
    return None


def run_find_saturation(args, shapes, workdir) -> dict:
    """`--find-saturation`: find_saturation per shape with round-robin cells of `--duration` seconds (`--seed`'s
    requests at each probed rate); a table per shape and the result dict (`--result-file`)."""
    import sys

    from tqdm import tqdm

    from kvgate.bench.routing.configurations import BY_NAME
    from kvgate.bench.routing.runner import run_cell
    from kvgate.bench.routing.workloads import arrivals

    round_robin = BY_NAME["round-robin"]
    result = {"find_saturation": {"factor": args.saturation_factor, "start_rate": args.saturation_start,
                                  "duration_s": args.duration, "drain_s": args.drain,
                                  "seed": args.seed, "replicas": args.replicas}, "workloads": {}}
    for shape in shapes:
        with tqdm(total=DEFAULT_MAX_PROBES, unit="probe", file=sys.stderr, leave=False) as bar:
            def measure(rate: float) -> float | None:
                bar.set_description(f"{shape.name} round-robin {rate:.2f}/s")
                requests = arrivals(shape, rate, args.duration, args.seed)
                cell = run_cell(workdir, round_robin, shape, requests, replicas=args.replicas, drain_s=args.drain)
                bar.update(1)
                p90 = cell_p90(cell)
                if p90 is None:  # what failed, for the record: the search goes on past it
                    print(f"{shape.name} {rate:.2f}/s failed: {cell['sent']}/{cell['requests']} sent, errors "
                          f"{cell['errors']}, logs {cell['logs']}", file=sys.stderr, flush=True)
                return p90

            found = find_saturation(measure, factor=args.saturation_factor, start_rate=args.saturation_start)
        result["workloads"][shape.name] = {"what": shape.what, "knobs": shape.knobs(), **found.as_dict()}
        if args.result_file:  # after every shape: a search of many shapes takes most of an hour
            Path(args.result_file).write_text(json.dumps(result, indent=2))
        probes = ", ".join(f"{r:.2f}/s " + ("failed" if p is None else "unfinished" if math.isinf(p) else f"{p:.2f} s")
                           for r, p in found.probes)
        rate = f"{found.rate:.2f} req/s" if found.rate is not None else "not reached"
        light = f"{found.light_p90_s:.2f} s" if found.light_p90_s is not None else "failed"
        print(f"{shape.name}: saturation {rate} (round-robin TTFT p90 {light} at {found.light_rate:g}/s, target "
              f"{args.saturation_factor:g}x); probes: {probes}", flush=True)
    return result
