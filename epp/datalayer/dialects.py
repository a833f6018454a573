"""Engine metric dialects: where each engine keeps the Model Server Protocol numbers, as a table.

A Dialect names, for each number the scheduler needs, the metric families (and label values) that carry it.
`families()` is the set of sample names the dialect reads: the datalayer asks prometheus_client-based
servers (vLLM, SGLang, `kvgate serve`) for only those with the exposition's `?name[]=` filter.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from urllib.parse import quote

from kvgate.common.engine_latency_protocol import MODEL_OBSERVATIONS, TPOT_MODEL_WEIGHT, TTFT_MODEL_WEIGHT


@dataclass(frozen=True)
class Series:
    """A metric family, optionally narrowed to samples carrying these label values."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Dialect:
    """Where one engine keeps the Model Server Protocol numbers; for each, the first family present wins."""

    waiting: tuple[Series, ...]  # summed over label sets
    running: tuple[Series, ...]  # summed over label sets
    kv_usage: tuple[Series, ...]  # max over label sets, 0..1
    lora_info: str | None = None  # vLLM-style info gauge: labels max_lora, running/waiting_lora_adapters
    cache_info: str | None = None  # vLLM-style info gauge: labels block_size, num_gpu_blocks
    block_size: Series | None = None  # tokens per KV block, as a sample value
    num_blocks: Series | None = None  # KV blocks in total, as a sample value
    prefill_pending: Series | None = None  # prompt tokens still to prefill (kvgate's gauge), summed
    prefill_awaiting_step: Series | None = None  # of those, in requests no step has taken yet (kvgate's), summed
    step_age: Series | None = None  # seconds the engine's current step has run (kvgate's gauge), max
    prefix_queries: Series | None = None  # prompt tokens looked up in the prefix cache (counter), summed
    prefix_hits: Series | None = None  # of those, found cached (counter), summed
    prefill_computed: Series | None = None  # prompt tokens the engine computed (kvgate's counter), summed
    prefill_seconds: Series | None = None  # seconds of the steps that computed them (kvgate's counter), summed
    ttft_model: str | None = None  # a kvgate engine's TTFT model weights, one sample per `feature` label
    tpot_model: str | None = None  # and its TPOT model's
    model_observations: Series | None = None  # the TTFTs that model has fitted (counter)
    name_filter: bool = False  # the engine serves prometheus_client's exposition, which honours ?name[]=

    def families(self) -> tuple[str, ...]:
        """The sample names this dialect reads, in a stable order."""
        names: list[str] = []
        for series in (*self.waiting, *self.running, *self.kv_usage, self.block_size, self.num_blocks,
                       self.prefill_pending, self.prefill_awaiting_step, self.step_age, self.prefix_queries,
                       self.prefix_hits, self.prefill_computed, self.prefill_seconds, self.model_observations):
            if series is not None and series.name not in names:
                names.append(series.name)
        for name in (self.lora_info, self.cache_info, self.ttft_model, self.tpot_model):
            if name and name not in names:
                names.append(name)
        return tuple(names)

    def metrics_path(self, filtered: bool = True) -> str:
        """/metrics, narrowed to `families()` where the engine honours the filter and `filtered` asks for it."""
        return _metrics_path(self, filtered and self.name_filter)


@functools.lru_cache(maxsize=64)  # asked once per scrape: building it cost ~50 us (quote), a lookup ~0.1 us
def _metrics_path(dialect: Dialect, filtered: bool) -> str:
    if not filtered:
        return "/metrics"
    return "/metrics?" + "&".join("name%5B%5D=" + quote(name, safe="") for name in dialect.families())


_TRT_REQUESTS, _TRT_KV = "nv_trt_llm_request_metrics", "nv_trt_llm_kv_cache_block_metrics"

DIALECTS: dict[str, Dialect] = {
    "vllm": Dialect(
        waiting=(Series("vllm:num_requests_waiting"),),
        running=(Series("vllm:num_requests_running"),),
        kv_usage=(Series("vllm:kv_cache_usage_perc"), Series("vllm:gpu_cache_usage_perc")),
        lora_info="vllm:lora_requests_info",
        cache_info="vllm:cache_config_info",
        # kvgate's own backlog gauge (engine/server/metrics.py; vLLM has none) and vLLM's prefix-cache counters,
        # from which the datalayer estimates the prefill rate (datalayer/prefill_rate.py)
        prefill_pending=Series("kvgate:num_prefill_tokens_pending"),
        # and the running step's phase, from which the scheduler tells how much of that backlog is being computed
        prefill_awaiting_step=Series("kvgate:num_prefill_tokens_awaiting_step"),
        step_age=Series("kvgate:engine_step_age_seconds"),
        prefix_queries=Series("vllm:prefix_cache_queries_total"),
        prefix_hits=Series("vllm:prefix_cache_hits_total"),
        # kvgate engines time their own prefill steps: the exact rate where present
        prefill_computed=Series("kvgate:prefill_tokens_computed_total"),
        prefill_seconds=Series("kvgate:prefill_step_seconds_total"),
        # and fit their own latency model from the requests they serve (common/engine_latency_protocol.py)
        ttft_model=TTFT_MODEL_WEIGHT,
        tpot_model=TPOT_MODEL_WEIGHT,
        model_observations=Series(MODEL_OBSERVATIONS + "_total", (("kind", "ttft"),)),
        name_filter=True,
    ),
    "sglang": Dialect(
        waiting=(Series("sglang:num_queue_reqs"),),
        running=(Series("sglang:num_running_reqs"),),
        kv_usage=(Series("sglang:token_usage"),),
        name_filter=True,
    ),
    # Triton's TensorRT-LLM backend, as the Model Server Protocol maps it (its C++ metrics server has no filter).
    "trtllm": Dialect(
        waiting=(Series(_TRT_REQUESTS, (("request_type", "waiting"),)),),
        running=(Series(_TRT_REQUESTS, (("request_type", "scheduled"),)),),
        kv_usage=(Series(_TRT_KV, (("kv_cache_block_type", "fraction"),)),),
        block_size=Series(_TRT_KV, (("kv_cache_block_type", "tokens_per"),)),
        num_blocks=Series(_TRT_KV, (("kv_cache_block_type", "max"),)),
    ),
}
DIALECTS["triton-tensorrt-llm"] = DIALECTS["trtllm"]


def dialect_for(engine_type: str) -> Dialect:
    return DIALECTS.get(engine_type) or DIALECTS["vllm"]
