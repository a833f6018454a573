"""Each endpoint's prefill speed relative to the pool's fastest (load signals in seconds instead of tokens), and its
KV capacity relative to the pool's largest (cache footprints as shares of what each endpoint holds).

A pool may mix hardware (two GPU generations behind one InferencePool, or a replica sharing its node): a token of
prefill backlog on a replica half as fast holds a new request's first token back twice as long. The datalayer
estimates every engine's prefill rate online from its own counters (datalayer/prefill_rate.py), so a load
measured in tokens converts to seconds of the fastest replica:

    R(e)    = e's prefill rate (tokens/s) as the engine's own step timing gives it; unmeasured (not yet prefilled
              long enough, or an engine that does not time itself, e.g. vLLM): the median of the measured ones;
              none measured: every endpoint alike
    s(e)    = R(e) / max R                                      1 for the fastest, 0.5 for one half as fast
    s(e)    = 1  where s(e) ≥ SAME_SPEED                        closer than that counts as the same hardware
    s(e)    ≥ MIN_SPEED (0.1)                                   one engine reporting absurd speed (a bug, a
                                                                hostile pod) weighs the others' loads ×10 at most
    load_s(e) = load_tokens(e) / s(e)

Why SAME_SPEED: an engine's timed rate moves with its batch mix (a step that also decodes takes longer for its
prompt tokens), so equal replicas report rates a few percent apart (`kvgate bench routing --shapes mixed-hardware
--result-file F` records each endpoint's estimate), and a slower replica's difference stands far outside that. Read
as real, small differences would reshuffle a pool of equal
replicas, which with every s(e) = 1 routes exactly as by tokens: a pool whose replicas differ by less than
1/SAME_SPEED (1.25×) is treated as uniform.

KV capacity, likewise (a 40 GB and an 80 GB card hold different caches):

    C(e)    = e's KV cache in tokens (num_kv_blocks × block_size, from vllm:cache_config_info); unknown: the median of
              the known ones; none known: every endpoint alike
    k(e)    = C(e) / max C, 1 where ≥ SAME_SPEED, at least MIN_SPEED
"""

from __future__ import annotations

import numpy as np

from kvgate.epp.scheduling.framework import CycleState
from kvgate.epp.scheduling.plugins._normalize import per_snapshot
from kvgate.epp.types import EndpointState

SAME_SPEED = 0.8
MIN_SPEED = 0.1
_KEY = "kvgate.relative-speed"
_KV_KEY = "kvgate.relative-kv-capacity"


def relative_speed(endpoints: list[EndpointState], cycle: CycleState | None = None) -> np.ndarray:
    """s(e) for `endpoints` (cached in the cycle's snapshot: the rates change only with a scrape)."""
    return per_snapshot(_KEY, cycle, endpoints, _compute)


def relative_kv_capacity(endpoints: list[EndpointState], cycle: CycleState | None = None) -> np.ndarray:
    """k(e) for `endpoints` (cached in the cycle's snapshot)."""
    return per_snapshot(_KV_KEY, cycle, endpoints, _compute_kv)


def _compute_kv(endpoints: list[EndpointState]) -> np.ndarray:
    return _relative(np.fromiter((np.nan if e.metrics.kv_cache_tokens is None else e.metrics.kv_cache_tokens
                                  for e in endpoints), dtype=float, count=len(endpoints)))


def timed_prefill_rates(endpoints: list[EndpointState]) -> np.ndarray:
    """R(e) in tokens/s, NaN where unmeasured. Only rates the engines timed themselves: one inferred from admissions
    follows the arrivals of an engine that keeps up (datalayer/prefill_rate.py), and routing by it starves whichever
    replica got less."""
    return np.fromiter(((e.metrics.prefill_tokens_per_s or np.nan) if e.metrics.prefill_rate_timed else np.nan
                        for e in endpoints), dtype=float, count=len(endpoints))


def prefill_rates(endpoints: list[EndpointState], default: float) -> np.ndarray:
    """R(e) in tokens/s, to turn prefill tokens into seconds: the engines' own timing (unmeasured ones at the
    measured median); none timed: each endpoint's estimated rate, else `default`."""
    timed = fill_unmeasured(timed_prefill_rates(endpoints))
    if timed is not None:
        return timed
    return np.fromiter((e.metrics.prefill_tokens_per_s or default for e in endpoints), dtype=float,
                       count=len(endpoints))


def _compute(endpoints: list[EndpointState]) -> np.ndarray:
    return _relative(timed_prefill_rates(endpoints))


def fill_unmeasured(values: np.ndarray) -> np.ndarray | None:
    """`values` with the unknown ones (NaN, ≤ 0) at the known ones' median; None when none is known."""
    measured = np.isfinite(values) & (values > 0)
    if not measured.any():
        return None
    return np.where(measured, values, np.median(values[measured]))


def _relative(values: np.ndarray) -> np.ndarray:
    """Each value ÷ the largest, unknown (NaN, ≤ 0) ones at the known median, snapped to 1 within SAME_SPEED and
    kept ≥ MIN_SPEED."""
    filled = fill_unmeasured(values)
    if filled is None:
        return np.ones(len(values))
    ratio = filled / filled.max()
    return np.where(ratio >= SAME_SPEED, 1.0, np.maximum(ratio, MIN_SPEED))


def in_seconds(load: np.ndarray, endpoints: list[EndpointState], cycle: CycleState | None, unit: str) -> np.ndarray:
    """`load` (tokens, aligned with `endpoints`) as is for unit "tokens", divided by s(e) for "seconds"."""
    return load if unit == "tokens" else load / relative_speed(endpoints, cycle)
