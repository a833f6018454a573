"""The latency model a kvgate engine fits from the requests it serves and publishes on its /metrics page, and how a
router evaluates it: names and features in one place, for the engine (engine/server/latency_fit.py) and the EPP
(epp/datalayer, predicted-latency-scorer with learnFrom: engines).

Why the engine fits it: the engine times every request exactly (arrival to first token, first to last token) and
knows its state at arrival exactly (its prefill backlog and the running step's phase, what its prefix cache held of
the prompt), where an EPP learning from responses needs every response body streamed through it (about twice the
gateway tier's CPU per request, docs/benchmarks.md) and sees its features through a 50 ms scrape. Each engine fits its
own model, so a pool of mixed hardware gets one per speed without a rate estimate.

Features of a request at an engine (`ttft_features`, `tpot_features`), scaled to comparable ranges:

    TTFT:  1,  backlog / 10^4,  uncached / 10^4,  running / 100,  waiting / 100
    TPOT:  1,  running / 100,  kv

backlog: the prompt tokens the engine still has to prefill, less what its running step has computed of them
(`backlog_after_phase`); uncached: the request's prompt tokens the prefix cache did not hold; running, waiting: the
engine's requests (vllm:num_requests_running / _waiting); kv: its KV-cache use (0..1). At the engine these are its
gauges at the request's arrival; at a router, the same gauges as scraped plus what the router sent since. KV use is
not a TTFT feature: it moves with the running requests, and where it barely moves (a lightly loaded engine) its
fitted weight is noise that a router would then multiply by a fuller cache.

On the page (gauges and a counter, one series per feature or kind):

    kvgate:ttft_model_weight{feature="bias"|...}       the TTFT model's weights, in seconds per feature unit
    kvgate:tpot_model_weight{feature="bias"|...}       the TPOT model's weights
    kvgate:latency_model_observations_total{kind="ttft"|"tpot"}   the requests each model has fitted

A router uses an engine's model once it has fitted MIN_OBSERVATIONS TTFTs.
"""

from __future__ import annotations

import numpy as np

TTFT_MODEL_WEIGHT = "kvgate:ttft_model_weight"
TPOT_MODEL_WEIGHT = "kvgate:tpot_model_weight"
MODEL_OBSERVATIONS = "kvgate:latency_model_observations"  # a counter: the page says ..._total
TTFT_FEATURES = ("bias", "backlog_per_10k", "uncached_per_10k", "running_per_100", "waiting_per_100")
TPOT_FEATURES = ("bias", "running_per_100", "kv_usage")
MIN_OBSERVATIONS = 32  # TTFTs fitted before a router trusts the model: several per weight (5), the prior barely pulls


def _columns(*values) -> list[np.ndarray]:
    return np.broadcast_arrays(*(np.atleast_1d(np.asarray(v, dtype=float)) for v in values))


def ttft_features(backlog, uncached, running, waiting) -> np.ndarray:
    """[n, len(TTFT_FEATURES)] for n (endpoint, request) pairs; scalars give one row."""
    b, u, r, w = _columns(backlog, uncached, running, waiting)
    return np.column_stack([np.ones_like(b), b / 1e4, u / 1e4, r / 100.0, w / 100.0])


def tpot_features(running, kv_usage) -> np.ndarray:
    """[n, len(TPOT_FEATURES)]; scalars give one row."""
    r, kv = _columns(running, kv_usage)
    return np.column_stack([np.ones_like(r), r / 100.0, kv])


def backlog_after_phase(pending: int, awaiting: int | None, step_age_s: float | None, rate: float | None) -> int:
    """The prefill backlog less what the engine's running step has computed of it: that step's age × the engine's
    prefill rate, at most the part of the backlog a step has taken (requests awaiting a step are not being computed).
    The backlog itself where the phase or the rate is unknown. Why: the backlog gauge moves only when a step ends,
    and a step computing a cold 2300-token prompt lasts ~0.46 s on the bench's sim engines (docs/benchmarks.md, "The
    running step's phase")."""
    if awaiting is None or step_age_s is None or not rate:
        return pending
    in_steps = max(pending - awaiting, 0)
    return pending - min(in_steps, int(step_age_s * rate))
