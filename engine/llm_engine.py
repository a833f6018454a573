"""The engine core: requests in, one scheduled batch per step, outputs out.

`LLMEngine` only wires parts together — the runner (runner.py: torch or sim), the scheduler, the KV cache manager,
LoRA slots, structured outputs and the KV-event publisher — and turns requests into outputs. It is single-threaded;
the offline `LLM` drives it in a loop and the HTTP server drives it from its own loop. With async scheduling (vLLM's
`--async-scheduling`, on by default on CUDA) a step queues the next batch on the device before it takes the
running batch's tokens, so the host's scheduling and output work overlaps the device's forward pass; a request
whose sampling reads its earlier output on the host (grammars, penalties) makes steps synchronous while it runs.
`n > 1` fans a request out into n child requests (seed + i each) that share the prompt's cached blocks. A request's
end is decided in `Request.check_stop` alone (called by the scheduler per token); the engine only turns requests
into outputs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvgate.engine.auto_config import fit_to_kv_cache, kv_cache_source
from kvgate.engine.config import EngineConfig
from kvgate.engine.detokenizer import IncrementalDetokenizer
from kvgate.common.errors import ConfigError, InvalidRequestError, LoRAError
from kvgate.engine.kv_cache_manager import KVCacheManager, cdiv
from kvgate.engine.kv_event_publisher import create_publisher, kv_events_enabled
from kvgate.engine.kv_events import KVEventBatch
from kvgate.engine.lora.manager import LoRAManager
from kvgate.engine.lora.request import LoRARequest
from kvgate.engine.outputs import CompletionOutput, RequestOutput
from kvgate.engine import prompt_logprobs
from kvgate.engine.request import Request, RequestStatus
from kvgate.engine.runner import Runner, StepResult, load_model
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.scheduler import Scheduler, SchedulerOutput
from kvgate.engine.spec_decode import DraftBackoff, NgramProposer, SpecDecodeStats
from kvgate.engine.structured_output import StructuredOutputManager

if TYPE_CHECKING:
    from kvgate.engine.draft_model import DraftStats

log = logging.getLogger(__name__)

# How long a step with nothing to run waits for a constraint's matcher to be built (then the loop looks for
# new commands again).
GRAMMAR_WAIT_S = 0.01


@dataclass
class EngineStats:
    """A cheap snapshot for metrics endpoints."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    block_size: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prefill_tokens_pending: int = 0  # see scheduler.prefill_tokens_pending
    # vLLM's vllm:lora_requests_info: max_loras (0: LoRA off) and the adapters of running / waiting requests
    max_lora: int = 0
    running_lora_adapters: list[str] = dataclasses.field(default_factory=list)
    waiting_lora_adapters: list[str] = dataclasses.field(default_factory=list)
    # Speculative decoding's counters (vLLM's vllm:spec_decode_*); None when it is off.
    spec_decode: SpecDecodeStats | None = None
    # A draft model's own work (kvgate:spec_decode_draft_*: positions computed, caught up on, reused from the prefix
    # cache); None without one.
    draft_model: DraftStats | None = None
    # The engine's own prefill timing (kvgate:prefill_tokens_computed / kvgate:prefill_step_seconds): prompt tokens
    # computed, and the wall seconds of the steps that computed them, each counted whole — how fast this replica
    # drains a prefill backlog under its batch mix, whatever its load (a router's speed signal).
    prefill_tokens_computed: int = 0
    prefill_step_seconds: float = 0.0


def prefill_tokens(out: SchedulerOutput) -> int:
    """Prompt (or recomputed) tokens a step computes: every token of a chunk but the one it samples from and the
    drafts it verifies — a decode computes none."""
    return sum(s.num_new_tokens - (1 + len(s.draft or ())) if s.samples else s.num_new_tokens for s in out.scheduled)


@dataclass(eq=False)
class _QueuedStep:
    """A batch queued on the device whose tokens the host has not taken yet."""

    out: SchedulerOutput
    result: StepResult
    kv_events: list  # what scheduling it changed in the block pool, announced once it has run


@dataclass(eq=False)
class _Child:
    parent_id: str
    index: int
    request: Request  # holds its detokenizer and structured-output grammar
    cumulative_logprob: float = 0.0


@dataclass(eq=False)
class _Parent:
    prompt: str | None
    prompt_token_ids: list[int]
    child_ids: list[str]
    num_finished: int = 0


def _eos_token_ids(model_path: str, hf_config, tokenizer) -> tuple[int, ...]:
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        gen = GenerationConfig.from_pretrained(model_path, local_files_only=True)
        eos = gen.eos_token_id
    except OSError:
        eos = getattr(hf_config, "eos_token_id", None)
    for value in (eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return tuple(sorted(ids))


def resolve_config(config: EngineConfig, read_weights: bool = True):
    """The model loaded and every setting resolved, the KV cache sized but not allocated: (LoadedModel, the resolved
    config, max_model_len, KV blocks). The settings (loaded.settings) are logged; `kvgate serve --print-config`
    prints them instead of serving, with read_weights False: the same settings, and no byte of the weights read
    (runner.plan_model; its runner cannot run a step)."""
    loaded = load_model(config, read_weights)  # the only place the torch and sim backends differ (runner.py)
    num_blocks = loaded.runner.determine_num_blocks()
    size = num_blocks * loaded.runner.bytes_per_block / 2**20
    loaded.settings.add("kv_cache_blocks", f"{num_blocks} ({size:.1f} MiB)",
                        kv_cache_source(config, loaded.runner.device.type))
    resolved, max_model_len = fit_to_kv_cache(config, loaded.config, loaded.max_model_len, num_blocks,
                                              loaded.settings)
    loaded.runner.max_model_len = max_model_len
    if not resolved.enable_chunked_prefill and resolved.max_num_batched_tokens < max_model_len:
        raise ConfigError(
            f"without chunked prefill, max_num_batched_tokens ({resolved.max_num_batched_tokens}) must be "
            f">= max_model_len ({max_model_len})"
        )
    loaded.settings.log()
    return loaded, resolved, max_model_len, num_blocks


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.model_name = config.served_model_name or config.model
        torch.manual_seed(config.seed)
        # What was not given is derived here (auto_config.py); self.config is the resolved config.
        loaded, config, self.max_model_len, num_blocks = resolve_config(config)
        self.config, self.settings = config, loaded.settings
        self.runner: Runner = loaded.runner
        self.tokenizer, self.hf_config = loaded.tokenizer, loaded.hf_config
        self.device, self.dtype = self.runner.device, self.runner.dtype
        # what the weights load read of a quantized checkpoint (quantization.QuantSummary); None: dense weights
        self.quantization = getattr(self.runner, "quantization", None)
        self.runner.allocate_kv_cache(num_blocks)
        self.kv_cache_manager = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                               max_blocks_per_request=cdiv(self.max_model_len, config.block_size),
                                               max_requests=config.max_num_seqs,
                                               record_kv_events=kv_events_enabled(config.kv_events_config),
                                               sliding_window=self.runner.kv_window)
        self.lora = self._build_lora()
        spec = config.speculative_config
        self.spec_stats = SpecDecodeStats(accepted_per_pos=[0] * spec.num_speculative_tokens) \
            if spec is not None else None
        self.scheduler = self._build_scheduler()
        self.prefill_tokens_computed = 0  # EngineStats' prefill timing
        self.prefill_step_seconds = 0.0
        self.eos_token_ids = _eos_token_ids(config.model, self.hf_config, self.tokenizer)
        self.vocab_size = self.hf_config.vocab_size
        self.structured_outputs = StructuredOutputManager(self.tokenizer, self.vocab_size, self.eos_token_ids)
        self.structured_outputs.prepare()
        # Constrained requests whose matcher is being built: id -> (Future of it, their children), and the
        # requests whose constraint was refused, for take_failures.
        self._grammar_builds: dict[str, tuple[concurrent.futures.Future, list]] = {}
        self._grammar_failures: list[tuple[str, Exception]] = []
        self._scheduling_failures: list = []  # (request, error) from SchedulerOutput.failed, for take_failures
        self._children: dict[str, _Child] = {}
        self._parents: dict[str, _Parent] = {}
        self.async_scheduling = config.async_scheduling if config.async_scheduling is not None else (
            config.backend == "torch" and self.device.type == "cuda" and config.speculative_config is None)
        self._queued: _QueuedStep | None = None  # async scheduling: the step the device is running
        # Last: it opens sockets, which nothing after it could close if it raised.
        self.kv_event_publisher = create_publisher(config.kv_events_config)
        if self.kv_event_publisher is not None and not config.enable_prefix_caching:
            log.warning("KV-cache events are on but prefix caching is off: no block will be announced")
        log.info("engine ready: %s (%s) on %s (%s), %d KV blocks x %d tokens (kv cache dtype %s), max_model_len %d, "
                 "async scheduling %s, speculative decoding %s, weights %s", self.model_name, self._model_path(),
                 self.device, self.dtype, num_blocks, config.block_size, config.kv_cache_dtype, self.max_model_len,
                 "on" if self.async_scheduling else "off", self._speculation_summary(), self._weights_summary())

    def _model_path(self) -> str:
        """The model's implementation: a native family or the transformers fallback (or the simulator)."""
        model = getattr(self.runner, "model", None)
        if model is None:
            return "simulated"
        from kvgate.engine.models import describe_model

        return describe_model(model)

    def _build_lora(self) -> LoRAManager | None:
        """The adapters' runner slots (None: LoRA off), with --lora-modules' adapters registered."""
        config = self.config
        lora = LoRAManager(config.max_loras, config.max_cpu_loras, self.runner.load_lora,
                           self.runner.set_lora_slot) if config.enable_lora else None
        for lora_id, module in enumerate(config.lora_modules, start=1):
            try:
                lora.add(LoRARequest(module.name, lora_id, module.path, module.base_model_name))
            except LoRAError as exc:
                raise ConfigError(f"--lora-modules {module.name}={module.path}: {exc}") from None
        return lora

    def _build_scheduler(self) -> Scheduler:
        config = self.config
        backoff = config.speculative_backoff_threshold
        return Scheduler(
            self.kv_cache_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=config.long_prefill_token_threshold,
            policy=config.scheduling_policy,
            lora=self.lora,
            proposer=self._proposer(),
            spec_stats=self.spec_stats,
            draft_backoff=DraftBackoff(backoff, self.spec_stats)
            if self.spec_stats is not None and backoff > 0 else None,
        )

    def _weights_summary(self) -> str:
        if self.quantization is None:
            return "dense"
        dtype = str(self.dtype).removeprefix('torch.')
        if self.quantization.kernels is not None:  # the GPU path: the line says what runs on the kernels
            return f"{self.quantization.line()}, computing in {dtype}"
        why = self.quantization.dense_path
        return f"{self.quantization.line()}, dequantized to {dtype} at load" + (f" ({why})" if why else "")

    def _speculation_summary(self) -> str:
        config = self.config
        if config.speculative_config is None:
            return "off"
        threshold = config.speculative_backoff_threshold
        return (f"{config.speculative_config}, adaptive drafting "
                + (f"below {threshold:g} accepted drafts per drafted step" if threshold > 0 else "off"))

    def _proposer(self):
        """Who drafts for speculative decoding: the n-gram lookup, or the runner's draft model; None = no one."""
        spec = self.config.speculative_config
        if spec is None:
            return None
        if spec.method == "draft_model":
            return self.runner.draft
        return NgramProposer(spec, self.max_model_len)

    # -- requests ---------------------------------------------------------------------------------

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    # -- LoRA adapters ----------------------------------------------------------------------------

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise LoRAError("LoRA is not enabled on this engine (start it with --enable-lora)")
        return self.lora

    def add_lora(self, lora: LoRARequest) -> None:
        """Serve a new adapter; LoRAError (nothing changes) when it cannot be served."""
        self._lora_manager().add(lora)
        log.info("LoRA adapter %s (id %d) added from %s", lora.lora_name, lora.lora_int_id, lora.lora_path)

    def remove_lora(self, lora_name: str) -> bool:
        """Stop serving an adapter: new requests for it are refused at once, those already in finish with it."""
        removed = self._lora_manager().remove(lora_name, self.scheduler.adapters_in_use())
        if removed:
            log.info("LoRA adapter %s removed", lora_name)
        return removed

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else self.lora.list()

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora_request: LoRARequest | None = None,
        block_hashes: list[bytes] | None = None,
    ) -> list[int]:
        """Queue a request (a text prompt or token ids) for the base model or a registered adapter; returns the
        prompt token ids. Raises on bad input. `block_hashes`: the prompt's leading block hashes as the engine loop's
        arrival probe computed them for these token ids, salt and adapter (engine_loop.arrival_probe), not hashed
        again."""
        params = params or SamplingParams()
        if lora_request is not None and self._lora_manager().get(lora_request.lora_name) != lora_request:
            raise LoRAError(f"LoRA adapter {lora_request.lora_name!r} is not loaded", param="model")
        if request_id in self._parents:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        text, token_ids = self._prompt_token_ids(prompt)
        params = self._request_params(params)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        child_ids = [request_id] if params.n == 1 else [f"{i}_{request_id}" for i in range(params.n)]
        # Build every child before registering any: a failure here leaves nothing
        # behind — no parent, no sibling generating for nobody.
        children = [(child_id, index, self._child_request(child_id, index, token_ids, params, arrival, priority,
                                                          cache_salt, lora_request, block_hashes))
                    for index, child_id in enumerate(child_ids)]
        self._parents[request_id] = _Parent(text, token_ids, child_ids)
        if params.structured_outputs is not None:
            # Built off this loop, once for all n samples; scheduled when ready (vLLM's WAITING_FOR_FSM).
            self._grammar_builds[request_id] = (self.structured_outputs.submit(params.structured_outputs), children)
            return token_ids
        self._schedule_children(request_id, children)
        return token_ids

    def _prompt_token_ids(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(the prompt's text or None, its token ids), checked to fit the vocabulary and leave room to generate."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenize(prompt)
        else:
            text, token_ids = None, list(prompt)
            if any(not isinstance(t, int) or isinstance(t, bool) for t in token_ids):
                raise InvalidRequestError("prompt token ids must be integers")
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if not token_ids:
            raise InvalidRequestError("the prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(token_ids)} tokens, but the model's context length is {self.max_model_len} "
                "(max_model_len), which leaves no room to generate"
            )
        return text, token_ids

    def _request_params(self, params: SamplingParams) -> SamplingParams:
        """The request's sampling parameters, checked against this model's vocabulary, with its EOS ids."""
        params.validate()
        # Ids past the vocabulary would index out of the logits inside a step (killing the loop for everyone).
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise InvalidRequestError(f"stop token id {bad_stop[0]} is outside the vocabulary [0, {self.vocab_size})",
                                      param="stop_token_ids")
        bad_bias = [t for t in params.logit_bias or () if t >= self.vocab_size]  # the same: it indexes the logits
        if bad_bias:
            raise InvalidRequestError(f"logit_bias token id {bad_bias[0]} is outside the vocabulary "
                                      f"[0, {self.vocab_size})", param="logit_bias")
        # A top_k past the vocabulary keeps every token: the same as off (and never overflows a tensor).
        top_k = 0 if params.top_k >= self.vocab_size else params.top_k
        return dataclasses.replace(params, eos_token_ids=self.eos_token_ids, top_k=top_k)

    def _child_request(self, child_id: str, index: int, token_ids: list[int], params: SamplingParams,
                       arrival: float, priority: int, cache_salt: str | None, lora_request: LoRARequest | None,
                       block_hashes: list[bytes] | None) -> Request:
        """Sample `index` of a request: with n > 1 a request of its own, seeded seed + index."""
        if params.n > 1:
            params = dataclasses.replace(params, n=1, seed=None if params.seed is None else params.seed + index)
        return Request(child_id, token_ids, params, arrival_time=arrival, priority=priority, cache_salt=cache_salt,
                       lora_request=lora_request, max_model_len=self.max_model_len, sample_index=index,
                       block_hashes=list(block_hashes or ()),
                       detokenizer=IncrementalDetokenizer(self.tokenizer, params, token_ids))

    def _schedule_children(self, request_id: str, children) -> None:
        for child_id, index, request in children:
            self._children[child_id] = _Child(request_id, index, request)
            self.scheduler.add_request(request)

    def _admit_built_grammars(self) -> None:
        """Schedule the requests whose matcher is built, fail those whose constraint was refused; when nothing
        else can run, wait a moment for a build rather than spin."""
        if not self._grammar_builds:
            return
        if not self.scheduler.has_unfinished_requests():
            concurrent.futures.wait([f for f, _ in self._grammar_builds.values()], timeout=GRAMMAR_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for request_id, (future, children) in list(self._grammar_builds.items()):
            if not future.done():
                continue
            del self._grammar_builds[request_id]
            try:
                template = future.result()
            except Exception as exc:  # noqa: BLE001 - the request's error (a 400), reported by take_failures
                self._parents.pop(request_id, None)
                self._grammar_failures.append((request_id, exc))
                continue
            for _, index, request in children:
                request.grammar = template if index == len(children) - 1 else template.copy()
            self._schedule_children(request_id, children)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request (all its n children); frees its KV blocks. False if it was not running."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return False
        if self._grammar_builds.pop(request_id, None) is not None:  # its matcher is still being built
            return True
        for child_id in parent.child_ids:
            self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
            self._children.pop(child_id, None)
        return True

    def take_failures(self) -> list[tuple[str, Exception]]:
        """Requests the engine ended with an error while scheduling: (request id, error), each request once, its
        other samples aborted. Callers report them (the server as an error answer, LLM.generate by raising)."""
        failures, self._grammar_failures = self._grammar_failures, []
        scheduling, self._scheduling_failures = self._scheduling_failures, []
        for child, exc in scheduling:
            record = self._children.get(child.request_id)
            if record is not None and self.abort_request(record.parent_id):
                failures.append((record.parent_id, exc))
        return failures

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._grammar_builds) or self._queued is not None

    # -- stepping ---------------------------------------------------------------------------------

    def step(self, final_only: bool = False) -> list[RequestOutput]:
        """Schedule and run one batch; returns an output for every request that got a token, or with final_only
        (vLLM's RequestOutputKind.FINAL_ONLY, what the offline LLM asks for) only for the samples that finished,
        which spares building a streaming output per request per step (`python -m tests.engine.gpu_profile engine`
        shows what outputs cost a step's host time).

        With async scheduling the tokens returned are those of the batch queued by the step before, taken after
        this step's batch is queued: the host's work on them runs while the device runs this step's batch. Without
        it (or while a request samples from host state), the step before ends before this one is scheduled and this
        step's batch ends before it returns."""
        started = time.perf_counter()
        self.check_health()
        self._admit_built_grammars()
        overlap = self.async_scheduling and self.scheduler.num_host_bound == 0
        outputs = [] if overlap else self._take(final_only)
        out = self._schedule()
        outputs += self._launch(out, final_only)
        if not overlap:
            outputs += self._take(final_only)
        self._count_prefill(out, started)
        return outputs

    def _schedule(self) -> SchedulerOutput:
        out = self.scheduler.schedule()
        self._scheduling_failures += out.failed
        return out

    def _launch(self, out: SchedulerOutput, final_only: bool) -> list[RequestOutput]:
        """Queue the batch on the device, then take the outputs of the step queued before it (whose sampled ids
        the new batch's placeholders read on the device). With nothing to run, only those outputs, and the block
        pool's changes announced."""
        if out.is_empty:
            outputs = self._take(final_only)
            self._publish_kv_events()
            return outputs
        events = self._take_kv_events()
        result = self.runner.launch(out, self._queued.result if self._queued is not None else None)
        outputs = self._take(final_only)
        self._queued = _QueuedStep(out, result, events)
        return outputs

    def _take(self, final_only: bool) -> list[RequestOutput]:
        """Wait for the queued step's tokens (if a step is queued), put them in place and turn them into outputs."""
        if self._queued is None:
            return []
        queued, self._queued = self._queued, None
        tokens, logprobs = queued.result.result()
        prompt_logprobs.record(queued.out.scheduled, queued.result.prompt_logprobs)
        progressed = self.scheduler.update_from_output(queued.out, tokens)
        # After the step ran: the blocks it announces hold their KV now.
        self._publish_kv_events(queued.kv_events)
        now = time.monotonic()
        outputs = []
        for r in progressed:
            self._record_token(r, logprobs.get(r.request_id), now)
            if not final_only or r.is_finished:
                outputs.append(self._make_output(r, now))
        return outputs

    def _count_prefill(self, out: SchedulerOutput, started: float) -> None:
        """EngineStats' prefill timing: a step that computed prompt tokens counts whole. With async scheduling the
        wait in it is for the step before: the same in a steady stream."""
        computed = prefill_tokens(out)
        if computed > 0:
            self.prefill_tokens_computed += computed
            self.prefill_step_seconds += time.perf_counter() - started

    def _take_kv_events(self) -> list:
        return self.kv_cache_manager.pool.take_kv_events() if self.kv_event_publisher is not None else []

    def _publish_kv_events(self, earlier: list | None = None) -> None:
        """Announce `earlier` (a queued step's changes) and what the pool recorded since."""
        if self.kv_event_publisher is not None:
            events = (earlier or []) + self.kv_cache_manager.pool.take_kv_events()
            if events:
                self.kv_event_publisher.publish(KVEventBatch(events))

    def _record_token(self, request: Request, logprobs, now: float) -> None:
        """What every new token updates, whether or not an output is built for it."""
        if request.first_token_time is None:
            request.first_token_time = now
        if logprobs is not None:
            request.logprobs.append(logprobs)
            self._children[request.request_id].cumulative_logprob += logprobs[request.output_token_ids[-1]].logprob

    def _make_output(self, request: Request, now: float) -> RequestOutput:
        child = self._children[request.request_id]
        token = request.output_token_ids[-1]
        finished = request.is_finished  # decided by Request.check_stop in the scheduler's update
        detokenizer = request.detokenizer
        completion = CompletionOutput(
            index=child.index,
            text=detokenizer.output_text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=request.logprobs,
            cumulative_logprob=child.cumulative_logprob if request.logprobs is not None else None,
            delta_text=detokenizer.next_delta(finished),
            delta_token_ids=[token] if request.num_step_tokens <= 1 else
            request.output_token_ids[-request.num_step_tokens:],
        )
        parent_id = child.parent_id
        parent = self._parents[parent_id]
        metrics = {}
        if finished:
            parent.num_finished += 1
            self._children.pop(request.request_id, None)
            metrics = {
                "arrival_time": request.arrival_time,
                "scheduled_time": request.scheduled_time,
                "first_token_time": request.first_token_time,
                "finished_time": now,
                "num_preemptions": request.num_preemptions,
            }
        all_done = parent.num_finished == len(parent.child_ids)
        if all_done:
            del self._parents[parent_id]
        return RequestOutput(
            request_id=parent_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            outputs=[completion],
            finished=all_done,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            metrics=metrics,
            # in a sample's first output (the prompt is computed by then) and its last, not in every step's (a
            # process engine loop pickles each output)
            prompt_logprobs=request.prompt_logprobs
            if finished or request.num_output_tokens <= max(request.num_step_tokens, 1) else None,
        )

    # -- introspection ----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        kv = self.kv_cache_manager
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage(),
            num_blocks=kv.num_blocks,
            block_size=kv.block_size,
            prefix_cache_queries=kv.prefix_stats.queries,
            prefix_cache_hits=kv.prefix_stats.hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_prefill_tokens_pending=self.scheduler.num_prefill_tokens_pending,
            spec_decode=dataclasses.replace(self.spec_stats, accepted_per_pos=list(self.spec_stats.accepted_per_pos))
            if self.spec_stats is not None else None,
            draft_model=dataclasses.replace(draft.stats) if (draft := getattr(self.runner, "draft", None)) else None,
            prefill_tokens_computed=self.prefill_tokens_computed, prefill_step_seconds=self.prefill_step_seconds,
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict:
        if self.lora is None:
            return {}
        running, waiting = self.scheduler.lora_adapters()
        return {"max_lora": self.lora.max_loras, "running_lora_adapters": running, "waiting_lora_adapters": waiting}

    def reset_prefix_cache(self) -> bool:
        if self._queued is not None:  # its announcements first, so a subscriber sees them before the reset
            self._publish_kv_events(self._queued.kv_events)
            self._queued.kv_events = []
        done = self.kv_cache_manager.reset_prefix_cache()
        self._publish_kv_events()
        return done

    @property
    def health_poll_s(self) -> float | None:
        """How often an idle loop must call check_health (None: never; the engine has no parts that can die apart
        from it, as tensor-parallel workers can)."""
        return getattr(self.runner, "health_poll_s", None)

    def check_health(self) -> None:
        """Raise (TensorParallelError) when a part of the engine outside this process has died."""
        check = getattr(self.runner, "check_health", None)
        if check is not None:
            check()

    def close(self) -> None:
        """Release what the engine holds outside its memory (the KV-event sockets, the runner's mask thread)."""
        self.runner.close()
        self.structured_outputs.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.shutdown()
            self.kv_event_publisher = None
