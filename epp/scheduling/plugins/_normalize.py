"""Min-max normalization and metric columns shared by the load scorers.

Scores are numpy arrays aligned with the endpoint list. A column is read with a C-level attrgetter walk and, for
metrics, cached in the cycle's Snapshot so that every decision of a scrape round reuses it instead of walking the
endpoints again (`kvgate bench epp --parts scheduling` prints a decision over a kept snapshot against new states).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import attrgetter

import numpy as np

from kvgate.epp.scheduling.framework import CycleState
from kvgate.epp.types import EndpointState


def attribute_values(endpoints: Sequence[EndpointState], attribute: str) -> np.ndarray:
    """The float array of `attribute` (dotted, e.g. "metrics.kv_cache_usage") over `endpoints`."""
    return np.fromiter(map(attrgetter(attribute), endpoints), dtype=float, count=len(endpoints))


def lower_is_better(values: np.ndarray) -> np.ndarray:
    """score = (max - v) / (max - min): the least loaded gets 1, the most loaded 0; all equal → all 1."""
    if values.size == 0:
        return values
    lo, hi = values.min(), values.max()
    if hi == lo:
        return np.ones_like(values)
    return (hi - values) / (hi - lo)


def per_snapshot(key: object, cycle: CycleState | None, endpoints: list[EndpointState],
                 compute: Callable[[list[EndpointState]], np.ndarray]) -> np.ndarray:
    """compute(endpoints), cached in the cycle's Snapshot when `endpoints` is the snapshot's list."""
    snap = cycle.snapshot if cycle is not None else None
    if snap is not None and snap.endpoints is endpoints:
        return snap.cached(key, compute)
    return compute(endpoints)
