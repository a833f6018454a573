"""Prometheus metrics with vLLM's names and meaning (the Model Server Protocol that EPPs scrape).

Gauges come from the engine loop's latest stats snapshot, read at scrape time by a custom collector:
nothing is computed per scrape beyond formatting, so a 50 ms scrape interval costs little. Counters and
latency histograms are updated by the server as requests progress.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

disable_created_metrics()  # no *_created series: vLLM does not export them and scrapers need not parse them

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0)


# kvgate's own gauge for routers (vLLM has none): prompt tokens still to prefill across waiting and running
# requests — the exact prefill backlog, updated every engine step. Defined in scheduler.prefill_tokens_pending;
# requests the server handed to the engine loop that it has not reported yet count in full.
PREFILL_PENDING = "kvgate:num_prefill_tokens_pending"
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


def _model_counter(name: str, text: str, model_name: str, value) -> CounterMetricFamily:
    family = CounterMetricFamily(name, text, labels=["model_name"])
    family.add_metric([model_name], value)
    return family


def draft_model_families(draft, model_name: str):
    for name, (text, field) in DRAFT_MODEL.items():
        yield _model_counter(name, text, model_name, getattr(draft, field))


def spec_decode_families(spec, model_name: str):
    yield _model_counter(*SPEC_DECODE_PAUSED, model_name, spec.num_paused_steps)
    for name, (text, field) in SPEC_DECODE.items():
        value = getattr(spec, field)
        if isinstance(value, list):  # one series per draft position, as vLLM labels them
            family = CounterMetricFamily(name, text, labels=["model_name", "position"])
            for position, count in enumerate(value):
                family.add_metric([model_name, str(position)], count)
            yield family
        else:
            yield _model_counter(name, text, model_name, value)


class EngineStatsCollector:
    """Reads AsyncLLM.stats/info when scraped."""

    def __init__(self, async_llm, model_name: str) -> None:
        self.llm = async_llm
        self.model_name = model_name

    def describe(self):
        """The families collect() yields, without samples: a registry restricted by ?name[]= finds this
        collector by these names (prometheus_client skips collectors it cannot name)."""
        return [GaugeMetricFamily(name, name) for name in (
                    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                    "vllm:cache_config_info", "vllm:lora_requests_info", PREFILL_PENDING)] + \
               [CounterMetricFamily(name, name) for name in (
                   "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions", PREFILL_TOKENS,
                   PREFILL_SECONDS, *SPEC_DECODE, SPEC_DECODE_PAUSED[0], *DRAFT_MODEL)]

    def collect(self):
        stats, info = self.llm.stats, self.llm.info
        labels = ["model_name"]
        values = [self.model_name]
        running = GaugeMetricFamily("vllm:num_requests_running", "Requests in model execution batches.",
                                    labels=labels)
        waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be processed.",
                                    labels=labels)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                                  labels=labels)
        queries = CounterMetricFamily("vllm:prefix_cache_queries", "Prefix cache queries, in tokens.",
                                      labels=labels)
        hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", labels=labels)
        preemptions = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemptions.",
                                          labels=labels)
        pending = GaugeMetricFamily(PREFILL_PENDING, "Prompt tokens still to prefill (not yet computed or taken "
                                    "from the prefix cache) across waiting and running requests.", labels=labels)
        pending.add_metric(values, self.llm.num_prefill_tokens_pending)
        yield pending
        computed = CounterMetricFamily(PREFILL_TOKENS, "Prompt tokens whose K/V the engine computed (prefix-cache "
                                       "hits not counted; recomputation after preemption counted).", labels=labels)
        seconds = CounterMetricFamily(PREFILL_SECONDS, "Seconds of the engine steps that computed prompt tokens "
                                      "(each such step counted whole).", labels=labels)
        computed.add_metric(values, stats.prefill_tokens_computed if stats is not None else 0)
        seconds.add_metric(values, stats.prefill_step_seconds if stats is not None else 0.0)
        yield from (computed, seconds)
        if stats is not None:
            running.add_metric(values, stats.num_running)
            # Requests the server accepted that the engine has not picked up yet count as waiting too.
            in_flight = max(self.llm.num_unfinished - stats.num_running - stats.num_waiting, 0)
            waiting.add_metric(values, stats.num_waiting + in_flight)
            usage.add_metric(values, stats.kv_cache_usage)
            queries.add_metric(values, stats.prefix_cache_queries)
            hits.add_metric(values, stats.prefix_cache_hits)
            preemptions.add_metric(values, stats.num_preemptions)
        else:
            for family in (running, waiting, usage, queries, hits, preemptions):
                family.add_metric(values, 0)
        yield from (running, waiting, usage, queries, hits, preemptions)
        if stats is not None and stats.spec_decode is not None:
            yield from spec_decode_families(stats.spec_decode, self.model_name)
        if stats is not None and stats.draft_model is not None:
            yield from draft_model_families(stats.draft_model, self.model_name)
        if info is not None:
            # cache_dtype: the --kv-cache-dtype value as given ("auto", "fp8", ...), as vLLM labels it
            cache = GaugeMetricFamily("vllm:cache_config_info", "Information of the KV cache configuration.",
                                      labels=["block_size", "cache_dtype", "num_gpu_blocks", "model_name"])
            cache.add_metric([str(info.block_size), self.llm.config.kv_cache_dtype, str(info.num_blocks),
                              self.model_name], 1)
            yield cache
        lora = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                 labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        # vLLM's shape: adapter names comma-joined, the value a timestamp. max_lora from the config, so an engine
        # that has not stepped yet (no stats) already shows its free slots to the EPP's lora-affinity-scorer.
        config = self.llm.config
        max_lora = config.max_loras if config.enable_lora else 0
        running = ",".join(stats.running_lora_adapters) if stats is not None else ""
        waiting = ",".join(stats.waiting_lora_adapters) if stats is not None else ""
        lora.add_metric([str(max_lora), running, waiting], time.time())
        yield lora


class ServerMetrics:
    def __init__(self, async_llm, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(async_llm, model_name))
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

    def track(self, num_prompt_tokens: int, num_samples: int, on_close=None) -> "RequestTracker":
        return RequestTracker(self, num_prompt_tokens, num_samples, on_close)


class RequestTracker:
    """Latency and token accounting of one API request (all its prompts and samples)."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, num_samples: int, on_close=None) -> None:
        self.m = metrics
        self.on_close = on_close
        self.unfinished_samples = num_samples
        self.labels = (metrics.model_name,)
        self.arrival = time.monotonic()
        self.num_prompt_tokens = num_prompt_tokens
        self.last_token_time: float | None = None
        self.generated = 0
        self.done = False

    def on_tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.monotonic()
        if self.last_token_time is None:
            self.m.ttft.labels(*self.labels).observe(now - self.arrival)
        else:
            self.m.itl.labels(*self.labels).observe((now - self.last_token_time) / count)
        self.last_token_time = now
        self.generated += count

    def on_finished_sample(self, finish_reason: str | None, metrics: dict) -> None:
        self.unfinished_samples -= 1
        self.m.request_success.labels(self.m.model_name, finish_reason or "abort").inc()
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
