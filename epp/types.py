"""Data shared by the EPP's parts: endpoints, their scraped metrics, requests and scheduling results."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvgate.common.engine_latency_protocol import backlog_after_phase


@dataclass(frozen=True)
class Endpoint:
    """One serving target: a pod's IP and one of the pool's target ports."""

    address: str  # "ip:port"
    name: str = ""  # pod name (or the address in standalone mode)
    namespace: str = ""
    labels: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)
    engine_type: str = "vllm"  # metrics dialect: vllm | sglang | trtllm
    # the pod's kvgate.dev/kv-events-* annotations (common/epp_protocol.py), only those: where its KV events are published
    annotations: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)

    @property
    def metrics_url(self) -> str:
        return f"http://{self.address}/metrics"


@dataclass
class EndpointMetrics:
    """The Model Server Protocol numbers of one endpoint, as last scraped."""

    waiting_queue_size: int = 0
    running_requests: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    max_lora: int = 0
    running_loras: frozenset[str] = frozenset()
    waiting_loras: frozenset[str] = frozenset()
    kv_block_size: int | None = None
    num_kv_blocks: int | None = None
    # kvgate engines: kvgate:num_prefill_tokens_pending (prompt tokens still to prefill); None = not exported
    prefill_tokens_pending: int | None = None
    # kvgate engines: kvgate:num_prefill_tokens_awaiting_step (of that backlog, prompts no step has taken yet) and
    # kvgate:engine_step_age_seconds (how long the engine's current step had run at the scrape); None = not exported
    prefill_tokens_awaiting_step: int | None = None
    step_age_s: float | None = None
    # vllm:prefix_cache_queries_total / _hits_total (tokens, counted at admission); None = not exported
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    # kvgate engines: kvgate:prefill_tokens_computed_total / kvgate:prefill_step_seconds_total (their own timing)
    prefill_tokens_computed: float | None = None
    prefill_step_seconds: float | None = None
    # the engine's prefill throughput, estimated online from those counters (datalayer/prefill_rate.py); timed:
    # from the engine's own step timing (exact at any load), else from the prefix-cache counters while busy
    prefill_tokens_per_s: float | None = None
    prefill_rate_timed: bool = False
    # kvgate engines: the latency model the engine fitted from the requests it served (kvgate:ttft_model_weight /
    # kvgate:tpot_model_weight in common/engine_latency_protocol.py's feature order) and the TTFTs it has fitted;
    # None = not exported
    ttft_model_weights: tuple[float, ...] | None = None
    tpot_model_weights: tuple[float, ...] | None = None
    ttft_model_observations: float | None = None
    updated_at: float = 0.0  # time.monotonic() of the last successful scrape; 0 = never

    @property
    def prefill_backlog(self) -> int | None:
        """The prefill backlog at the scrape, less what the engine's running step had computed of it by then: that
        step's age × the engine's prefill rate, at most the part of the backlog a step has taken (requests awaiting a
        step are not being computed). Why: the backlog gauge moves only when a step ends; a step computing a cold
        2300-token prompt lasts ~0.46 s on the bench's sim engines, and a scrape lands anywhere in it, so the gauge
        over-counts by up to a whole step's prompt tokens (docs/benchmarks.md, "The running step's phase"). The
        gauge as scraped where the engine does not export the phase or its rate is unknown; None without a gauge."""
        if self.prefill_tokens_pending is None:
            return None
        return backlog_after_phase(self.prefill_tokens_pending, self.prefill_tokens_awaiting_step, self.step_age_s,
                                   self.prefill_tokens_per_s)

    @property
    def kv_cache_tokens(self) -> int | None:
        """The KV cache's size in tokens (num_kv_blocks × kv_block_size, from vllm:cache_config_info); None:
        unknown."""
        return self.num_kv_blocks * self.kv_block_size if self.num_kv_blocks and self.kv_block_size else None


@dataclass(eq=False)
class EndpointState:
    """What scheduling plugins see of an endpoint at decision time.

    Compared by identity: the scheduler reuses what it derived from a list of states while the same objects
    come back (epp/scheduling/framework.py Snapshot), so a state is a snapshot, replaced rather than mutated.
    """

    endpoint: Endpoint
    metrics: EndpointMetrics
    stale: bool  # metrics older than the staleness threshold, never scraped, or its scrapes are failing
    in_flight_requests: int = 0  # routed by this EPP and not finished yet
    in_flight_tokens: int = 0  # their estimated prompt + output tokens
    available: bool = True  # scraped at least once and its scrapes are not failing: the engine is up

    @property
    def address(self) -> str:
        return self.endpoint.address


@dataclass
class LLMRequest:
    """The parsed request the scheduler decides on."""

    request_id: str
    model: str  # the model the client asked for
    target_model: str  # after InferenceModelRewrite
    prompt: str  # completions prompt, or the chat messages flattened to text: what prefix hashing sees
    headers: Mapping[str, str] = field(default_factory=dict)
    priority: int = 0  # from the InferenceObjective; < 0 = sheddable
    cache_salt: str | None = None
    max_tokens: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # the decoded JSON body, for plugins that need more than the flattened prompt (the precise prefix scorer
    # tokenizes chat messages with the model's template)
    body: Mapping | None = field(default=None, repr=False, compare=False)
    # what plugins worked out before the scheduling cycle, off the event loop (Director.prepare), keyed by plugin
    prepared: dict = field(default_factory=dict, repr=False, compare=False)
    # time.monotonic() when the first generated token passed the gateway (a streamed response's first chunk with
    # text; set by the ext-proc response path): what the learned latency model trains its TTFT on
    first_token_at: float | None = field(default=None, repr=False, compare=False)
    # priority and target model worked out (Director.classify): before flow control, which orders by priority
    classified: bool = field(default=False, repr=False, compare=False)
    # this replica's pick number as its peers know it (epp/peer_sync.py), until the response's end is published
    peer_seq: int | None = field(default=None, repr=False, compare=False)
    # seconds it waited in flow control's queue (Director.before_pick): not the EPP's work, so the request-path
    # histogram leaves it out (flow control's own histogram has it)
    flow_wait_s: float = field(default=0.0, repr=False, compare=False)

    @property
    def estimated_prompt_tokens(self) -> int:
        return max(1, len(self.prompt) // 4)
