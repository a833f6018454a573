"""Min-max normalization shared by the load scorers."""

from __future__ import annotations

from collections.abc import Sequence


def lower_is_better(addresses: Sequence[str], values: Sequence[float]) -> dict[str, float]:
    """score = (max - v) / (max - min): the least loaded gets 1, the most loaded 0; all equal → all 1."""
    if not values:
        return {}
    lo, hi = min(values), max(values)
    if hi == lo:
        return dict.fromkeys(addresses, 1.0)
    span = hi - lo
    return {a: (hi - v) / span for a, v in zip(addresses, values)}
