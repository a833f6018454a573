"""Prometheus metrics with vLLM's names and meaning (the Model Server Protocol that EPPs scrape).

Gauges come from the engine loop's latest stats snapshot, read at scrape time by a custom collector:
nothing is computed per scrape beyond formatting, so a 50 ms scrape interval costs little. Counters and
latency histograms are updated by the server as requests progress.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvgate.engine.server.exposition import Family, FamilySpec, render
from kvgate.engine.server.latency_fit import Arrival, EngineLatencyFit
from kvgate.common.engine_latency_protocol import MODEL_OBSERVATIONS, TPOT_MODEL_WEIGHT, TTFT_MODEL_WEIGHT, backlog_after_phase

log = logging.getLogger(__name__)

disable_created_metrics()  # no *_created series: vLLM does not export them and scrapers need not parse them

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0)


# kvgate's own gauge for routers (vLLM has none): prompt tokens still to prefill across waiting and running
# requests — the exact prefill backlog, updated every engine step. Defined in scheduler.prefill_tokens_pending;
# requests the server handed to the engine loop that it has not reported yet count their prompt less what the prefix
# cache held when they reached the engine's side (engine_loop.arrival_probe), in full until that probe answers.
PREFILL_PENDING = "kvgate:num_prefill_tokens_pending"
# The running step's phase, so that a router can tell how much of that backlog is being computed as it reads it:
# the part of the backlog no step has taken yet, and how long the engine's current step has run (a step that
# computes a long cold prompt can last a large part of a second; a scrape lands anywhere in it).
PREFILL_AWAITING_STEP = "kvgate:num_prefill_tokens_awaiting_step"
STEP_AGE = "kvgate:engine_step_age_seconds"
# The engine's own prefill timing, from which a router learns how fast this replica prefills (a pool may mix
# hardware): prompt tokens computed, and the seconds of the engine steps that computed them.
PREFILL_TOKENS = "kvgate:prefill_tokens_computed"
PREFILL_SECONDS = "kvgate:prefill_step_seconds"


# vLLM's speculative-decoding counters (only with --speculative-config): name -> (help, SpecDecodeStats field)
SPEC_DECODE = {
    "vllm:spec_decode_num_drafts": ("Number of spec decoding drafts.", "num_drafts"),
    "vllm:spec_decode_num_draft_tokens": ("Number of draft tokens.", "num_draft_tokens"),
    "vllm:spec_decode_num_accepted_tokens": ("Number of accepted tokens.", "num_accepted_tokens"),
    "vllm:spec_decode_num_accepted_tokens_per_pos": ("Accepted tokens per draft position.", "accepted_per_pos"),
}


# kvgate's own (vLLM has none): what adaptive drafting held back, and a draft model's work — name -> (help, field)
SPEC_DECODE_PAUSED = ("kvgate:spec_decode_num_paused_steps", "Decode steps in which adaptive drafting held a "
                      "request's drafting back (--speculative-backoff-threshold).")
DRAFT_MODEL = {
    "kvgate:spec_decode_draft_computed_tokens": ("Positions the draft model ran its forwards over (catching up on "
                                                 "context and drafting).", "computed_tokens"),
    "kvgate:spec_decode_draft_catch_up_tokens": ("Of those, context positions the draft model caught up on.",
                                                 "catch_up_tokens"),
    "kvgate:spec_decode_draft_reused_tokens": ("Context positions the draft model skipped: full blocks whose K/V it "
                                               "already held for the same prefix (prefix reuse).", "reused_tokens"),
}


# The stats families, in the order a scrape lists them.
PENDING = FamilySpec(PREFILL_PENDING, "gauge", "Prompt tokens still to prefill (not yet computed or taken from the "
                     "prefix cache) across waiting and running requests.")
AWAITING_STEP = FamilySpec(PREFILL_AWAITING_STEP, "gauge", "Of kvgate:num_prefill_tokens_pending, the prompt tokens "
                           "of requests the engine has not taken into a step yet.")
AGE = FamilySpec(STEP_AGE, "gauge", "Seconds the engine's current step has run (since its last step report); 0 when "
                 "it has no requests.")
COMPUTED = FamilySpec(PREFILL_TOKENS, "counter", "Prompt tokens whose K/V the engine computed (prefix-cache hits not "
                      "counted; recomputation after preemption counted).")
STEP_SECONDS = FamilySpec(PREFILL_SECONDS, "counter", "Seconds of the engine steps that computed prompt tokens (each "
                          "such step counted whole).")
RUNNING = FamilySpec("vllm:num_requests_running", "gauge", "Requests in model execution batches.")
WAITING = FamilySpec("vllm:num_requests_waiting", "gauge", "Requests waiting to be processed.")
KV_USAGE = FamilySpec("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.")
QUERIES = FamilySpec("vllm:prefix_cache_queries", "counter", "Prefix cache queries, in tokens.")
HITS = FamilySpec("vllm:prefix_cache_hits", "counter", "Prefix cache hits, in tokens.")
PREEMPTIONS = FamilySpec("vllm:num_preemptions", "counter", "Cumulative number of preemptions.")
SPEC_PAUSED = FamilySpec(SPEC_DECODE_PAUSED[0], "counter", SPEC_DECODE_PAUSED[1])
SPEC_COUNTERS = {field_name: FamilySpec(name, "counter", text, ("model_name", "position") if
                                        field_name == "accepted_per_pos" else ("model_name",))
                 for name, (text, field_name) in SPEC_DECODE.items()}
DRAFT_COUNTERS = {field_name: FamilySpec(name, "counter", text) for name, (text, field_name) in DRAFT_MODEL.items()}
# cache_dtype: the --kv-cache-dtype value as given ("auto", "fp8", ...), as vLLM labels it
CACHE_INFO = FamilySpec("vllm:cache_config_info", "gauge", "Information of the KV cache configuration.",
                        ("block_size", "cache_dtype", "num_gpu_blocks", "model_name"))
LORA_INFO = FamilySpec("vllm:lora_requests_info", "gauge", "Running stats on LoRA requests.",
                       ("max_lora", "running_lora_adapters", "waiting_lora_adapters"))
# The engine's own latency model (engine/server/latency_fit.py; names and features: common/engine_latency_protocol.py)
TTFT_MODEL = FamilySpec(TTFT_MODEL_WEIGHT, "gauge", "This engine's TTFT model's weights (fitted online).",
                        ("model_name", "feature"))
TPOT_MODEL = FamilySpec(TPOT_MODEL_WEIGHT, "gauge", "This engine's TPOT model's weights (fitted online).",
                        ("model_name", "feature"))
MODEL_FITTED = FamilySpec(MODEL_OBSERVATIONS, "counter", "Requests this engine's latency models have fitted.",
                          ("model_name", "kind"))
MODEL_ERROR = FamilySpec("kvgate:ttft_model_relative_error", "gauge", "Quantiles of this engine's TTFT model's "
                         "relative error over its last 1000 predictions.", ("model_name", "quantile"))
STATS_FAMILIES = (PENDING, AWAITING_STEP, AGE, COMPUTED, STEP_SECONDS, RUNNING, WAITING, KV_USAGE, QUERIES, HITS,
                  PREEMPTIONS, SPEC_PAUSED, *SPEC_COUNTERS.values(), *DRAFT_COUNTERS.values(), CACHE_INFO, LORA_INFO,
                  TTFT_MODEL, TPOT_MODEL, MODEL_FITTED, MODEL_ERROR)


def queue_gauges(llm) -> tuple[int, int, float]:
    """(running, waiting, KV use) as the page shows them: requests the server accepted that the engine has not
    picked up yet count as waiting too."""
    stats = llm.stats
    if stats is None:
        return 0, 0, 0.0
    in_flight = max(llm.num_unfinished - stats.num_running - stats.num_waiting, 0)
    return stats.num_running, stats.num_waiting + in_flight, stats.kv_cache_usage


def latency_gauges(llm) -> tuple[int, int, int, float]:
    """(the prefill backlog after the running step's phase, running, waiting, KV use) now: a request's features
    for the engine's latency model. The phase at the engine's prefill rate over its life (a router estimates it
    over the last ~10 s from the same counters; one replica's speed does not drift)."""
    stats = llm.stats
    rate = (stats.prefill_tokens_computed / stats.prefill_step_seconds
            if stats is not None and stats.prefill_step_seconds > 0 else None)
    backlog = backlog_after_phase(llm.num_prefill_tokens_pending, llm.num_prefill_tokens_awaiting_step,
                                  llm.step_age_s, rate)
    return (backlog, *queue_gauges(llm))


def spec_decode_families(spec, model_name: str) -> Iterator[Family]:
    yield SPEC_PAUSED, [((model_name,), spec.num_paused_steps)]
    for field_name, family in SPEC_COUNTERS.items():
        value = getattr(spec, field_name)
        if isinstance(value, list):  # one series per draft position, as vLLM labels them
            yield family, [((model_name, str(position)), count) for position, count in enumerate(value)]
        else:
            yield family, [((model_name,), value)]


def draft_model_families(draft, model_name: str) -> Iterator[Family]:
    for field_name, family in DRAFT_COUNTERS.items():
        yield family, [((model_name,), getattr(draft, field_name))]


def _prometheus_family(spec: FamilySpec, samples) -> GaugeMetricFamily | CounterMetricFamily:
    family = (GaugeMetricFamily if spec.kind == "gauge" else CounterMetricFamily)(spec.name, spec.help,
                                                                                  labels=list(spec.labels))
    for values, value in samples:
        family.add_metric(list(values), value)
    return family


class EngineStatsCollector:
    """Reads AsyncLLM.stats/info when scraped: `families()` as plain tuples (the /metrics page renders them
    itself, exposition.py), `collect()` as prometheus_client's families (for a registry)."""

    def __init__(self, async_llm, model_name: str, clock: Callable[[], float] = time.time,
                 latency: EngineLatencyFit | None = None) -> None:
        self.llm = async_llm
        self.latency = latency
        self.model_name = model_name
        self.clock = clock  # the LoRA info gauge's value
        self.one = (model_name,)  # the label values of every model_name-only series

    def describe(self):
        """The families collect() may yield, without samples: a registry restricted by ?name[]= finds this
        collector by these names (prometheus_client skips collectors it cannot name)."""
        return [_prometheus_family(spec, ()) for spec in STATS_FAMILIES]

    def collect(self):
        for spec, samples in self.families():
            yield _prometheus_family(spec, samples)

    def families(self) -> Iterator[Family]:
        stats, info, one = self.llm.stats, self.llm.info, self.one
        yield PENDING, [(one, self.llm.num_prefill_tokens_pending)]
        yield AWAITING_STEP, [(one, self.llm.num_prefill_tokens_awaiting_step)]
        yield AGE, [(one, round(self.llm.step_age_s, 4))]
        yield COMPUTED, [(one, stats.prefill_tokens_computed if stats is not None else 0)]
        yield STEP_SECONDS, [(one, stats.prefill_step_seconds if stats is not None else 0.0)]
        if stats is not None:
            running, waiting, kv = queue_gauges(self.llm)
            yield RUNNING, [(one, running)]
            yield WAITING, [(one, waiting)]
            yield KV_USAGE, [(one, kv)]
            yield QUERIES, [(one, stats.prefix_cache_queries)]
            yield HITS, [(one, stats.prefix_cache_hits)]
            yield PREEMPTIONS, [(one, stats.num_preemptions)]
        else:
            for spec in (RUNNING, WAITING, KV_USAGE, QUERIES, HITS, PREEMPTIONS):
                yield spec, [(one, 0)]
        if stats is not None and stats.spec_decode is not None:
            yield from spec_decode_families(stats.spec_decode, self.model_name)
        if stats is not None and stats.draft_model is not None:
            yield from draft_model_families(stats.draft_model, self.model_name)
        if info is not None:
            yield CACHE_INFO, [((str(info.block_size), self.llm.config.kv_cache_dtype, str(info.num_blocks),
                                 self.model_name), 1)]
        # vLLM's shape: adapter names comma-joined, the value a timestamp. max_lora from the config, so an engine
        # that has not stepped yet (no stats) already shows its free slots to the EPP's lora-affinity-scorer.
        config = self.llm.config
        max_lora = config.max_loras if config.enable_lora else 0
        running = ",".join(stats.running_lora_adapters) if stats is not None else ""
        waiting = ",".join(stats.waiting_lora_adapters) if stats is not None else ""
        yield LORA_INFO, [((str(max_lora), running, waiting), self.clock())]
        if self.latency is not None:
            ttft, tpot, ttft_count, tpot_count = self.latency.published()
            name = self.model_name
            yield TTFT_MODEL, [((name, feature), w) for feature, w in ttft]
            yield TPOT_MODEL, [((name, feature), w) for feature, w in tpot]
            yield MODEL_FITTED, [((name, "ttft"), ttft_count), ((name, "tpot"), tpot_count)]
            errors = self.latency.relative_errors()
            if errors:
                yield MODEL_ERROR, [((name, str(q)), e) for q, e in errors.items()]


class ServerMetrics:
    """The /metrics page: the engine's stats (read at scrape time) and the server's request counters and
    histograms (`registry`, updated as requests progress)."""

    def __init__(self, async_llm, model_name: str) -> None:
        self.latency = EngineLatencyFit(lambda: latency_gauges(async_llm))
        self.stats = EngineStatsCollector(async_llm, model_name, latency=self.latency)
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed.", labels,
                                         registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       labels + ["finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.", labels,
                             buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.", labels,
                             buckets=REQUEST_BUCKETS, registry=r)
        self.queue_time = Histogram("vllm:request_queue_time_seconds", "Time spent waiting in the queue.",
                                    labels, buckets=REQUEST_BUCKETS, registry=r)
        self.model_name = model_name

    def page(self, names: frozenset[str] | None = None) -> bytes:
        """The Prometheus text: every family (`names` None), or only the samples named (`?name[]=`, as
        prometheus_client's restricted registry narrows a page). The stats first, written by exposition.render."""
        stats = render(self.stats.families(), names).encode()
        if names is None:
            return stats + generate_latest(self.registry)
        return stats + generate_latest(self.registry.restricted_registry(names))

    def track(self, num_prompt_tokens: int, num_samples: int, on_close=None, num_prompts: int = 1
              ) -> "RequestTracker":
        # the latency model fits requests of one prompt and one sample (their first token is theirs alone)
        arrival = self.latency.arrival() if num_prompts == 1 and num_samples == 1 else None
        return RequestTracker(self, num_prompt_tokens, num_samples, on_close, arrival)


class RequestTracker:
    """Latency and token accounting of one API request (all its prompts and samples)."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, num_samples: int, on_close=None,
                 arrival: Arrival | None = None) -> None:
        self.m = metrics
        self.latency_arrival = arrival  # the engine's gauges at arrival, for its latency model (None: not fitted)
        self.first_token_time: float | None = None
        self.first_count = 0
        self.on_close = on_close
        self.unfinished_samples = num_samples
        self.labels = (metrics.model_name,)
        self.arrival = time.monotonic()
        self.num_prompt_tokens = num_prompt_tokens
        self.last_token_time: float | None = None
        self.generated = 0
        self.done = False
        self.trace = None  # tracing.RequestTrace when the request is traced: its span is written on close

    def on_tokens(self, count: int, cached_tokens: int = 0) -> None:
        """`count` new tokens of a sample; `cached_tokens`: the prompt tokens the prefix cache held (its output's)."""
        if count <= 0:
            return
        now = time.monotonic()
        if self.last_token_time is None:
            self.m.ttft.labels(*self.labels).observe(now - self.arrival)
            self.first_token_time, self.first_count = now, count
            if self.latency_arrival is not None:
                self.m.latency.first_token(self.latency_arrival, self.num_prompt_tokens - cached_tokens, now)
        else:
            self.m.itl.labels(*self.labels).observe((now - self.last_token_time) / count)
        self.last_token_time = now
        self.generated += count

    def on_finished_sample(self, finish_reason: str | None, metrics: dict) -> None:
        self.unfinished_samples -= 1
        self.m.request_success.labels(self.m.model_name, finish_reason or "abort").inc()
        if self.trace is not None:
            self.trace.sample_finished(finish_reason, metrics)
        arrival, scheduled = metrics.get("arrival_time"), metrics.get("scheduled_time")
        if arrival is not None and scheduled is not None:
            self.m.queue_time.labels(*self.labels).observe(max(scheduled - arrival, 0.0))

    def close(self) -> None:
        """Idempotent: called when the handler ends, and as a fallback if it never ran."""
        if self.done:
            return
        self.done = True
        if self.on_close is not None:
            self.on_close()
        if self.unfinished_samples > 0:  # the client went away (or the engine failed) before the end
            self.m.request_success.labels(self.m.model_name, "abort").inc(self.unfinished_samples)
        self.m.prompt_tokens.labels(*self.labels).inc(self.num_prompt_tokens)
        self.m.generation_tokens.labels(*self.labels).inc(self.generated)
        self.m.e2e.labels(*self.labels).observe(time.monotonic() - self.arrival)
        if self.latency_arrival is not None and self.unfinished_samples == 0 and self.first_token_time is not None:
            self.m.latency.finished(self.latency_arrival, self.first_token_time, self.last_token_time,
                                    self.generated - self.first_count)
        if self.trace is not None:
            try:
                self.trace.end(self)
            except Exception:  # noqa: BLE001 - a span that cannot be written costs the trace, never the answer
                log.exception("writing the request's trace span failed")
