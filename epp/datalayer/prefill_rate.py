"""An engine's prefill throughput (prompt tokens computed per second), estimated online from its scrapes.

kvgate engines time their own prefill (engine/llm_engine.py): kvgate:prefill_tokens_computed_total counts the
prompt tokens they computed and kvgate:prefill_step_seconds_total the seconds of the steps that computed them, so

    estimate (timed) = Σ decayed Δtokens / Σ decayed Δseconds

exact at any load: a lightly loaded engine prefills each prompt in its own steps and is timed doing it. Where they
are exported this is the estimate (EndpointMetrics.prefill_rate_timed), trusted once MIN_BUSY_S of prefill steps
have been seen.

Otherwise (vLLM engines) the estimate comes from the prefix-cache counters. vLLM (and kvgate) engines count, at
admission, the prompt tokens looked up in the prefix cache and those found there (vllm:prefix_cache_queries_total,
vllm:prefix_cache_hits_total); their difference is the prompt tokens the engine had to compute. Between two scrapes
during which its prefill backlog (kvgate:num_prefill_tokens_pending) never emptied, the engine was prefilling the
whole time, so

    sample rate  = Δ(queries - hits) / Δt                    (only intervals with backlog at both ends)
    estimate     = Σ decayed Δ(queries - hits) / Σ decayed Δt, each term decayed by exp(-age / HALF_LIFE_S·ln2)

a time-weighted mean over the last ~HALF_LIFE_S seconds of busy time: an admission counted in one interval and
computed over the next ones (chunked prefill) averages out. No estimate (None) until MIN_BUSY_S of busy time has
been seen: consumers use their configured default until then. Engines without the counters get None. This one is
only right while the engine stays backlogged: admissions then follow the compute, but an engine that keeps up
admits each prompt as it arrives, so its estimate follows its arrivals (in `kvgate bench routing --workloads
mixed-speed-no-reuse`, replicas given equal shares of the traffic get about equal estimates however fast they
are, where the timed estimate separates them) — so the speed-aware load signals
(scheduling/plugins/_relative_speed.py) read timed estimates only.
"""

from __future__ import annotations

import math

from kvgate.epp.types import EndpointMetrics

HALF_LIFE_S = 10.0  # the estimate follows a changed engine (slower replica, other model) within ~10 s of load
MIN_BUSY_S = 0.5  # busy seconds observed before the estimate is trusted (10 scrape rounds at 50 ms)


class PrefillRateEstimator:
    """One endpoint's estimator; feed it every scrape's metrics in order.

    Its input is an engine's: a sample that is not finite is skipped (the datalayer's checks drop those before
    they get here; this holds for any caller), and a state that would stop being finite starts over, so the
    next good scrapes always bring the estimate back."""

    __slots__ = ("_last", "_tokens", "_busy", "_trusted", "_timed", "timed")

    def __init__(self) -> None:
        self._reset()

    def _reset(self, timed: bool = False) -> None:
        self._last: tuple[float, float, int] | None = None  # (updated_at, computed tokens, pending)
        self._tokens = 0.0
        self._busy = 0.0
        self._trusted = False  # MIN_BUSY_S seen: the ratio stays valid while idle (both sums decay alike)
        self._timed: tuple[float, float, float] | None = None  # (updated_at, tokens computed, step seconds)
        self.timed = timed  # the estimate comes from the engine's own step timing

    def update(self, m: EndpointMetrics) -> float | None:
        """The estimate after this scrape (tokens/s), or None while unmeasured."""
        if m.prefill_tokens_computed is not None and m.prefill_step_seconds is not None:
            return self._update_timed(m.updated_at, m.prefill_tokens_computed, m.prefill_step_seconds)
        if self.timed:  # the engine stopped exporting its timing (replaced by another build): start over
            self._reset()
        if m.prefix_cache_queries is None or m.prefix_cache_hits is None or m.prefill_tokens_pending is None:
            self._last = None
            return self.estimate()
        computed = m.prefix_cache_queries - m.prefix_cache_hits
        if not (math.isfinite(computed) and math.isfinite(m.updated_at)):
            self._last = None
            return self.estimate()
        last, self._last = self._last, (m.updated_at, computed, m.prefill_tokens_pending)
        if last is None:
            return self.estimate()
        dt, done = m.updated_at - last[0], computed - last[1]
        if dt <= 0 or done < 0:  # clock oddity, or the engine restarted (counters reset): skip it
            return self.estimate()
        decay = math.exp(-dt * math.log(2) / HALF_LIFE_S)
        self._tokens *= decay
        self._busy *= decay
        if last[2] > 0 and m.prefill_tokens_pending > 0:  # busy prefilling throughout the interval
            self._tokens += done
            self._busy += dt
            self._trusted = self._trusted or self._busy >= MIN_BUSY_S
        return self._checked()

    def _update_timed(self, at: float, tokens: float, seconds: float) -> float | None:
        if not self.timed:
            self._reset(timed=True)
        if not (math.isfinite(at) and math.isfinite(tokens) and math.isfinite(seconds)):
            self._timed = None  # the next good sample starts a new interval
            return self.estimate()
        last, self._timed = self._timed, (at, tokens, seconds)
        if last is None:
            return self.estimate()
        dt, done, spent = at - last[0], tokens - last[1], seconds - last[2]
        # a clock oddity, a restarted engine (counters reset) or numbers no engine reports: skip the interval
        if not (dt > 0 and done >= 0 and spent >= 0 and math.isfinite(done) and math.isfinite(spent)):
            return self.estimate()
        decay = math.exp(-dt * math.log(2) / HALF_LIFE_S)
        self._tokens = self._tokens * decay + done
        self._busy = self._busy * decay + spent
        self._trusted = self._trusted or self._busy >= MIN_BUSY_S
        return self._checked()

    def _checked(self) -> float | None:
        """The estimate, after starting over if the sums stopped being finite (no input can leave them so)."""
        if not (math.isfinite(self._tokens) and math.isfinite(self._busy)):
            self._reset(self.timed)
        return self.estimate()

    def estimate(self) -> float | None:
        if not self._trusted or self._tokens <= 0 or self._busy <= 0:
            return None
        return self._tokens / self._busy
