"""Runs the model: owns the weights, the paged KV cache tensors and one batched forward pass per step."""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from kvgate.engine.auto_config import cuda_kv_cache_bytes
from kvgate.engine.attention import AttentionMetadata
from kvgate.engine.block_table import BlockTable
from kvgate.engine.cuda_graphs import DEFAULT_MAX_CAPTURE_SIZE, GraphSet
from kvgate.engine.config import CPU_DEFAULT_KV_CACHE_BYTES, EngineConfig
from kvgate.engine.cpu_allocator import keep_large_allocations_in_heap
from kvgate.engine.distributed.group import SINGLE, TensorParallelGroup, building_for
from kvgate.common.errors import ConfigError
from kvgate.engine.kv_cache_manager import cdiv
from kvgate.engine.kv_quant import QuantizedKVCache, allocate_kv_caches, kv_bytes_per_block, kv_quant_spec
from kvgate.engine.loader import load_model
from kvgate.engine.lora.adapter import LoRAWeights, load_lora_weights
from kvgate.engine.lora.layers import add_lora_layers, module_shapes, set_slot
from kvgate.engine.lora.request import LoRARequest
from kvgate.engine.models.layer_windows import freeable_window
from kvgate.engine.models.layers import use_fused_kernels
from kvgate.engine import prompt_logprobs
from kvgate.engine.quantization.linear import kernel_path_applies
from kvgate.engine.penalty_state import PenaltyState
from kvgate.engine.sampler import LogprobTensors, Sampler, SamplingBatch
from kvgate.engine.scheduler import ScheduledRequest, SchedulerOutput
from kvgate.engine.spec_decode import verify_greedy, verify_sampled
from kvgate.engine.step_inputs import StepInputs
from kvgate.engine.structured_output import fill_bitmasks
from kvgate.engine.triton_attention import HAS_TRITON, TritonAttentionMetadata
from kvgate.engine.triton_split_decode import plan_splits, sm_count

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, read_weights: bool = True, tp: TensorParallelGroup = SINGLE,
                 workers=None) -> None:
        """read_weights False: the parameters (the draft model's too) are allocated but not read from the checkpoint
        (uninitialised), for `kvgate serve --print-config`'s CUDA memory profile: the same runner and allocations
        as a start, so the same KV cache size, without the time to read the weights.

        tp: the tensor-parallel group this runner's model is a shard for (SINGLE: no tensor parallelism). workers:
        on rank 0 of a group, the other ranks' processes (distributed/workers.py), which this runner drives: each
        step's inputs are broadcast to them, the KV cache is sized and allocated on all ranks alike. A worker's own
        runner has none and runs the steps that arrive (run_worker_step)."""
        self.config = config
        self.tp, self.workers = tp, workers
        # Rank 0 sends each step to the workers; False while every rank runs the same thing on its own (the KV-cache
        # profile, graph capture) and on the workers themselves.
        self._lead = workers is not None
        self.hf_config = hf_config
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.vocab_size = hf_config.vocab_size
        if device.type == "cpu":
            keep_large_allocations_in_heap()
        # CUDA: what torch's allocator held before this engine's first allocation (another engine of this process),
        # so that this engine's own memory is what it adds (gpu_memory_utilization is per engine)
        self._reserved_before = 0
        if device.type == "cuda":
            torch.cuda.empty_cache()  # blocks a freed engine left cached are not another engine's
            self._reserved_before = torch.cuda.memory_reserved(device)
        self.attention_backend = choose_attention_backend(config.attention_backend, device)
        # a quantized checkpoint's linears stay quantized on the Triton GEMMs (GPU path, no tensor parallelism)
        keep_quantized = kernel_path_applies(device, tp.size, self.attention_backend == "triton",
                                             config.enable_lora)
        with building_for(tp):
            self.model = model = load_model(hf_config, config.model, device, dtype, max_model_len,
                                            read_weights=read_weights, quantization=config.quantization,
                                            keep_quantized=keep_quantized)
        self.quantization = model.quantization  # what the load read (quantization.QuantSummary), None: dense
        if self.quantization is not None and device.type == "cuda" and not keep_quantized:
            self.quantization.dense_path = ("tensor parallelism" if tp.size > 1 else "LoRA" if config.enable_lora
                                            else "the SDPA attention backend")
        self.lora_state = self.lora_layers = None
        if config.enable_lora:  # after the base weights: the wrapped projections keep them as they are
            self.lora_state, self.lora_layers = add_lora_layers(model, config.max_loras, config.max_lora_rank)
        self.num_layers = hf_config.num_hidden_layers
        self.layer_windows = model.layer_windows  # each layer's sliding window (None: full attention)
        self._num_sms = sm_count(device)  # split-KV decode's target programs (_decode_splits)
        self.sampler = Sampler()
        self._penalty_state: PenaltyState | None = None  # penalized requests' token counts, from the first one
        # Structured-output masks beside the forward pass (see execute); started by the first constrained request.
        self.fill_masks_in_thread = device.type != "cpu"
        self._mask_pool: ThreadPoolExecutor | None = None
        self.kv_caches: list[torch.Tensor | QuantizedKVCache] = []
        self.num_blocks = 0
        self.kv_quant = kv_quant_spec(config.kv_cache_dtype)  # None: K/V in the model's dtype
        check_kv_cache_backend(config.kv_cache_dtype, self.kv_quant, self.attention_backend, device)
        if self.attention_backend == "triton":
            use_fused_kernels(self.model)
        spec = config.speculative_config
        self.draft = None  # draft_model.DraftModelProposer: a draft model with its own KV cache of our block ids
        if spec is not None and spec.method == "draft_model":
            from kvgate.engine.draft_model import DraftModelProposer

            self.draft = DraftModelProposer(spec, config, hf_config, device, dtype, max_model_len, self.kv_quant,
                                            read_weights, self.attention_backend,
                                            graphs=self.attention_backend == "triton" and not config.enforce_eager)
        # Blocks behind every layer's window may be freed (kv_cache_manager.py), but not under a draft model: it
        # catches up on a request's whole context when it first drafts, writing its own K/V at our block ids.
        self.kv_window = freeable_window(self.layer_windows) if self.draft is None else None
        if any(w is not None for w in self.layer_windows):
            sliding = sum(w is not None for w in self.layer_windows)
            log.info("attention: %d of %d layers slide (windows %s); blocks outside every window %s", sliding,
                     len(self.layer_windows), sorted({w for w in self.layer_windows if w is not None}),
                     f"freed (window {self.kv_window})" if self.kv_window is not None else "kept")
        self.inputs = StepInputs(config.max_num_batched_tokens, config.max_num_seqs,
                                 cdiv(max_model_len, self.block_size), self.block_size, device)
        # Padded step shapes (and, on CUDA, their captured graphs): with the Triton kernels unless --enforce-eager.
        # On CPU the same shapes and buffers run eagerly, which is how the tests check the graph path's padding.
        self.shapes: GraphSet | None = None
        if self.attention_backend == "triton" and not config.enforce_eager:
            capture = config.max_cudagraph_capture_size
            capture = DEFAULT_MAX_CAPTURE_SIZE if capture is None else capture
            self.shapes = GraphSet(min(config.max_num_seqs, config.max_num_batched_tokens),
                                   min(capture, config.max_num_batched_tokens))
        self._eager_causes: set[str] = set()
        self._token_buffers: list[tuple[torch.Tensor, torch.cuda.Event]] = []
        self._token_turn = 0

    # -- KV cache ---------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        """K and V of every layer for one block, scales of a quantized cache included (and the draft model's)."""
        draft = self.draft.bytes_per_block(self.block_size) if self.draft is not None else 0
        return kv_bytes_per_block(self.model, self.num_layers, self.block_size, self.dtype, self.kv_quant) + draft

    def determine_num_blocks(self) -> int:
        """Blocks the KV cache gets (whether max_model_len fits is auto_config.fit_to_kv_cache's to say). With
        tensor parallelism every rank sizes its own (its heads' share; on CUDA each profiles its GPU, the ranks'
        forward passes in step) and the fewest blocks any rank has room for is the engine's."""
        if not self._lead:
            return kv_cache_blocks(self.config, self.device, self.bytes_per_block, self.max_model_len,
                                   self._profile_cuda_kv_bytes)
        self.workers.send(("num_blocks",))
        self._lead = False
        try:
            own = kv_cache_blocks(self.config, self.device, self.bytes_per_block, self.max_model_len,
                                  self._profile_cuda_kv_bytes)
        finally:
            self._lead = True
        return min([own] + [self.workers.receive(rank) for rank in range(1, self.tp.size)])

    def allocate_kv_cache(self, num_blocks: int, capture_graphs: bool = True) -> None:
        if self._lead:  # every rank allocates its cache, then captures its graphs (their all-reduces) in step
            self.workers.send(("allocate", num_blocks, capture_graphs))
            self._lead = False
            try:
                self._allocate_kv_cache(num_blocks, capture_graphs)
            finally:
                self._lead = True
            for rank in range(1, self.tp.size):
                self.workers.receive(rank)
            return
        self._allocate_kv_cache(num_blocks, capture_graphs)

    def _allocate_kv_cache(self, num_blocks: int, capture_graphs: bool) -> None:
        self.kv_caches = allocate_kv_caches(self.model, self.num_layers, num_blocks, self.block_size, self.dtype,
                                            self.kv_quant, self.device)
        self.num_blocks = num_blocks
        if self.draft is not None:
            self.draft.allocate_kv_cache(num_blocks, capture_graphs and self.device.type == "cuda")
        if capture_graphs and self.shapes is not None and self.device.type == "cuda":
            self._capture_graphs()

    def _profile_cuda_kv_bytes(self) -> int:
        """The KV cache's bytes: gpu_memory_utilization of the GPU less this engine's weights and the activations of
        a worst-case forward (max_num_batched_tokens); auto_config.cuda_kv_cache_bytes."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        self.allocate_kv_cache(cdiv(n, self.block_size), capture_graphs=False)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            prompt = _ProfileRequest(n)
            table = BlockTable(self.num_blocks, rows=1)
            table.write(table.row("profile"), 0, list(range(self.num_blocks)))
            step = SchedulerOutput([ScheduledRequest(prompt, n, 0)], block_table=table)
            _, hidden = self._run_model(step)
            spec = self.config.speculative_config  # a speculating request samples at 1 + K rows
            rows = min(self.config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0)), n)
            self.model.compute_logits(hidden[:rows]).float().softmax(-1)
        torch.cuda.synchronize(self.device)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - baseline
        self.kv_caches = []
        if self.draft is not None:
            self.draft.kv_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        utilization = self.config.gpu_memory_utilization
        own = torch.cuda.memory_reserved(self.device) - self._reserved_before
        available, capped = cuda_kv_cache_bytes(total, own, free, activation_peak, utilization)
        if capped:
            log.warning("other processes hold GPU memory: the KV cache gets what is free, less than "
                        "gpu_memory_utilization %g allows", utilization)
        log.info("CUDA memory: total %.1f GiB, gpu_memory_utilization %g, this engine's weights %.1f GiB, free %.1f "
                 "GiB, activation peak %.2f GiB -> KV cache %.1f GiB", total / 2**30, utilization, own / 2**30,
                 free / 2**30, activation_peak / 2**30, max(available, 0) / 2**30)
        if available <= 0:
            raise ConfigError("no GPU memory left for the KV cache: lower max_num_batched_tokens or raise "
                              "gpu_memory_utilization")
        return available

    # -- LoRA -------------------------------------------------------------------------------------

    def load_lora(self, lora: LoRARequest) -> LoRAWeights:
        """Read and check an adapter against this model (LoRAError when it does not fit)."""
        return load_lora_weights(lora.lora_path, self.config.max_lora_rank, module_shapes(self.model),
                                 self.num_layers, self.dtype)

    def set_lora_slot(self, slot: int, adapter: LoRAWeights | None) -> None:
        set_slot(self.lora_layers, slot, adapter)

    def close(self) -> None:
        if self._mask_pool is not None:
            self._mask_pool.shutdown(wait=True)
        if self.workers is not None:
            self.workers.close()
            self.tp.abort()  # the workers are gone: drop the group's connections to them

    # -- tensor parallelism -----------------------------------------------------------------------

    @property
    def health_poll_s(self) -> float | None:
        """How often an idle engine loop checks on the tensor-parallel workers (None: no workers)."""
        return 0.2 if self.workers is not None else None

    def check_health(self) -> None:
        """Raise TensorParallelError when a tensor-parallel rank has died."""
        if self.workers is not None:
            self.workers.check()

    def _send_step(self, out: SchedulerOutput, batch, replay: bool, prompt_rows: torch.Tensor | None) -> None:
        """Rank 0: the step's header to the workers, then its inputs (the persistent buffers, async placeholders
        already filled on the device) in one broadcast."""
        n = len(out.scheduled)
        dev = self.inputs.dev
        # the block table's columns any sequence of the step reads (the rest of each row is not sent)
        width = cdiv(max(s.start + s.num_new_tokens for s in out.scheduled), self.block_size)
        verify = tuple(s.draft is not None for s in out.scheduled) if out.has_drafts else None
        num_samples = batch.sample_rows.shape[0]
        num_prompt_rows = 0 if prompt_rows is None else prompt_rows.shape[0]
        header = (batch.num_tokens, batch.num_padded_tokens, n, batch.num_padded_seqs, batch.decode_only,
                  num_samples, replay, verify, width, num_prompt_rows)
        self.workers.check()
        self.workers.send(("step", header))
        p, s = batch.num_padded_tokens, batch.num_padded_seqs
        packed = torch.cat([dev["input_ids"][:p], dev["positions"][:p], dev["slot_mapping"][:p],
                            dev["query_start_loc"][:s + 1].long(), dev["seq_lens"][:s].long(),
                            dev["block_table"][:s, :width].reshape(-1).long(), batch.sample_rows,
                            *([prompt_rows] if num_prompt_rows else [])])
        self.tp.broadcast(packed)

    @torch.inference_mode()
    def run_worker_step(self, header: tuple) -> None:
        """A worker rank: one step whose inputs rank 0 broadcasts (see _send_step): the forward pass on this rank's
        shard, and its part of the logits' gather."""
        num_tokens, p, n, s, decode_only, num_samples, replay, verify, width, num_prompt_rows = header
        dev = self.inputs.dev
        if width > dev["block_table"].shape[1]:
            raise RuntimeError(f"rank 0 sent {width} block table columns, this rank has {dev['block_table'].shape[1]}")
        sizes = [p, p, p, s + 1, s, s * width, num_samples, num_prompt_rows]
        packed = self.tp.broadcast(torch.empty(sum(sizes), dtype=torch.int64, device=self.device))
        parts = packed.split(sizes)
        for name, part in zip(("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens"), parts):
            dev[name][:part.shape[0]].copy_(part)
        dev["block_table"][:s, :width].copy_(parts[5].view(s, width))
        dev["sample_rows"][:num_samples].copy_(parts[6])
        seqs = None
        if self.attention_backend == "sdpa":
            qsl, lens = dev["query_start_loc"][:n + 1].tolist(), dev["seq_lens"][:n].tolist()
            tables = dev["block_table"][:n, :width].tolist()
            seqs = [(lens[i] - (qsl[i + 1] - qsl[i]), qsl[i + 1] - qsl[i], tables[i][:cdiv(lens[i], self.block_size)])
                    for i in range(n)]
        hidden = self._forward(num_tokens, p, s, decode_only, replay, seqs, list(verify) if verify else None)
        if num_prompt_rows:  # rank 0's prompt-logprob pieces, in its order
            prompt_logprobs.run_pieces(hidden, parts[7], self.model.compute_logits, self.vocab_size)
        if num_samples:
            self.model.compute_logits(hidden.index_select(0, dev["sample_rows"][:num_samples]))

    # -- one step ---------------------------------------------------------------------------------

    def _forward_static(self, num_tokens: int, decode_only: bool, num_seqs: int) -> torch.Tensor:
        """The model over the first num_tokens rows of the persistent buffers (what a CUDA graph captures)."""
        view = self.inputs.view
        meta = TritonAttentionMetadata(view("slot_mapping", num_tokens), view("block_table", num_seqs),
                                       view("seq_lens", num_seqs), view("query_start_loc", num_seqs + 1),
                                       self.block_size, decode_only,
                                       self._decode_splits(num_seqs) if decode_only else 1)
        return self.model(view("input_ids", num_tokens), view("positions", num_tokens), self.kv_caches, meta)

    def _decode_splits(self, num_seqs: int) -> int:
        """Split-KV splits of a decode step of num_seqs (padded) sequences: a function of the batch size alone, so
        each captured decode graph keeps one grid (triton_split_decode.plan_splits)."""
        return plan_splits(num_seqs, self.model.num_kv_heads, self._num_sms, self.config.max_decode_splits)

    def _graph_seqs(self, padded_tokens: int) -> int:
        """Sequences a graph of padded_tokens rows is captured for: no step has more than either bound."""
        return min(padded_tokens, self.config.max_num_seqs)

    def _capture_graphs(self) -> None:
        def fill(num_tokens: int, decode_only: bool) -> None:
            self.inputs.fill_padding(num_tokens, self._graph_seqs(num_tokens))

        def forward(num_tokens: int, decode_only: bool) -> torch.Tensor:
            return self._forward_static(num_tokens, decode_only, self._graph_seqs(num_tokens))

        with torch.inference_mode():
            self.shapes.capture(fill, forward, self.device)

    def _padded_shape(self, out: SchedulerOutput) -> tuple[int | None, int | None, str | None]:
        """(padded tokens, padded sequences, why not) for this step: a captured size, or eager."""
        if self.shapes is None:
            return None, None, None
        if self.lora_state is not None and out.lora_slots:
            return None, None, "a batch with LoRA adapters"
        num_tokens = out.num_scheduled_tokens
        decode_only = num_tokens == len(out.scheduled)
        padded = self.shapes.size_for(num_tokens, decode_only)
        if padded is None:
            return None, None, None  # larger than every graph: eager by design, not a fallback
        return padded, self._graph_seqs(padded), None

    def _run_model(self, out: SchedulerOutput, running: PendingStep | None = None,
                   prompt_rows: torch.Tensor | None = None):
        padded, padded_seqs, why_eager = self._padded_shape(out)
        if why_eager is not None and why_eager not in self._eager_causes:
            self._eager_causes.add(why_eager)
            log.info("CUDA graphs: steps with %s run eagerly", why_eager)
        batch = self.inputs.prepare(out, padded, padded_seqs, running.rows if running is not None else None)
        if batch.fill_rows is not None:  # decode tokens the running step samples, copied on the device
            input_ids = self.inputs.view("input_ids")
            input_ids.index_copy_(0, batch.fill_rows, running.tokens.index_select(0, batch.fill_src))
        if self.lora_state is not None:
            self.lora_state.groups = [(slot, torch.from_numpy(rows).to(self.device))
                                      for slot, rows in batch.lora_rows.items()]
        replay = self.shapes is not None and bool(self.shapes.graphs) and padded is not None
        if self._lead:
            self._send_step(out, batch, replay, prompt_rows)
        seqs = None
        if self.attention_backend == "sdpa":
            table, bs = out.block_table.ids, self.block_size
            seqs = [(s.start, s.num_new_tokens, table[s.block_row, :cdiv(s.start + s.num_new_tokens, bs)].tolist())
                    for s in out.scheduled]
        hidden = self._forward(batch.num_tokens, batch.num_padded_tokens, batch.num_padded_seqs, batch.decode_only,
                               replay, seqs, [s.draft is not None for s in out.scheduled] if out.has_drafts else None)
        return batch, hidden

    def _forward(self, num_tokens: int, num_padded_tokens: int, num_padded_seqs: int, decode_only: bool,
                 replay: bool, seqs: list | None, verify: list[bool] | None) -> torch.Tensor:
        """The model over the prepared buffers: SDPA over `seqs` ((computed, new, block ids) per sequence), a
        captured graph's replay, or the padded static forward."""
        if self.attention_backend == "sdpa":
            meta = AttentionMetadata.for_windows(self.layer_windows, seqs, self.block_size, self.device,
                                                 self.model.num_kv_heads, self.num_blocks,
                                                 slot_mapping=self.inputs.view("slot_mapping", num_tokens),
                                                 verify=verify, num_heads=self.model.num_heads)
            view = self.inputs.view
            return self.model(view("input_ids", num_tokens), view("positions", num_tokens), self.kv_caches, meta)
        if replay:
            return self.shapes.replay(num_padded_tokens, decode_only)
        return self._forward_static(num_padded_tokens, decode_only, num_padded_seqs)

    def execute(self, out: SchedulerOutput):
        """One forward pass for the whole batch; returns {request_id: token} and {request_id: logprobs}."""
        return self.launch(out).result()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, running: PendingStep | None = None) -> PendingStep:
        """Queue one forward pass and its sampling for the whole batch; the sampled ids come back through the
        returned step's result(). running: the step queued before this one, whose sampled ids this step's output
        placeholders read on the device (async scheduling)."""
        # Structured-output masks: only constrained rows get one, so unconstrained batches pay nothing. On an
        # accelerator they are filled in a thread while the forward pass runs (the CPU is idle then; llguidance
        # drops the GIL). On CPU the forward pass already uses every core, and a mask thread beside it only
        # fights torch's threads (`kvgate bench structured-outputs --num-requests 128` compares the two on a
        # half-constrained batch).
        samplers = [s.request for s in out.scheduled if s.samples]
        plain = all(r.plain_greedy for r in samplers)  # the common batch: an argmax, no per-row sampling state
        masks = None
        if not plain and any(r.grammar is not None for r in samplers):
            width = (self.vocab_size + 31) // 32
            if not self.fill_masks_in_thread:
                masks = fill_bitmasks(samplers, width)
            else:
                if self._mask_pool is None:
                    self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-grammar")
                masks = self._mask_pool.submit(fill_bitmasks, samplers, width)
        # prompt logprobs: the rows of the chunks that score prompt tokens, computed piece by piece after the forward
        plan = prompt_logprobs.plan_rows(out.scheduled)
        prompt_rows = None if plan is None else torch.tensor(plan.rows, dtype=torch.long, device=self.device)
        computed = {}
        try:  # with tensor parallelism, a rank that died mid-step fails its collective here: say which one
            batch, hidden = self._run_model(out, running, prompt_rows)
            if plan is not None:
                computed = prompt_logprobs.compute(hidden, plan, self.model.compute_logits, self.vocab_size,
                                                   prompt_rows)
            logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows)) if samplers else None
        except RuntimeError as exc:
            if self.workers is None:
                raise
            error = self.workers.explain(exc)
            self.tp.abort()  # no step can run on this group again
            raise error from exc
        if not samplers:
            step = PendingStep.done()
        elif out.has_drafts:
            step = self._verify_drafts(out, samplers, logits, plain, masks)
        else:
            tokens, logprobs = self._sample(samplers, logits, plain, masks)
            ids = [r.request_id for r in samplers]
            step = PendingStep.copy_back(ids, tokens, logprobs, self._next_token_buffer())
        step.prompt_logprobs = computed
        return step

    def _sample(self, samplers: list, logits: torch.Tensor, plain: bool,
                masks) -> tuple[torch.Tensor, LogprobTensors | None]:
        """One token per sampling request from its row of logits (and its logprobs on the device, if asked)."""
        if plain:
            return self.sampler.greedy(logits), None
        grammar = ([], None) if masks is None else masks if isinstance(masks, tuple) else masks.result()
        dev = self.device
        for r in samplers:  # a seeded request's own generator, made at its first token and kept on the request
            if r.generator is None and r.sampling_params.seed is not None:
                r.generator = torch.Generator(device=dev)
                r.generator.manual_seed(r.sampling_params.seed)
        if self._penalty_state is None and any(r.sampling_params.has_penalties for r in samplers):
            self._penalty_state = PenaltyState(self.vocab_size, dev)
        sampling = SamplingBatch.build(samplers, self.vocab_size, dev, grammar, self._penalty_state)
        return self.sampler(logits, sampling)

    def _verify_drafts(self, out: SchedulerOutput, samplers: list, logits: torch.Tensor, plain: bool,
                       masks) -> PendingStep:
        """A step with draft tokens (speculative decoding; synchronous scheduling): logits has 1 + len(draft) rows
        for a speculating request, one for any other. Every request first samples from its last row as usual (the
        others' tokens, exactly as without speculation); a speculating request's tokens are then its verified
        drafts and the token after them (spec_decode.py), {request id: [tokens]}."""
        last_rows, greedy, sampled = [], [], []
        row = 0
        for s in out.scheduled:
            if not s.samples:
                continue
            if s.draft is not None:
                (greedy if s.request.sampling_params.greedy else sampled).append((s.request, s.draft, row,
                                                                                   s.draft_probs))
                row += len(s.draft)
            last_rows.append(row)
            row += 1
        # Greedy rows are verified against one argmax of every row, read back once; an all-greedy plain batch takes
        # its other tokens from it too (the argmax _sample would compute).
        argmax = self.sampler.greedy(logits).tolist() if greedy else None
        ids = [r.request_id for r in samplers]
        if plain and argmax is not None:
            tokens, logprobs = [argmax[i] for i in last_rows], None
        else:
            sampled_last, logprob_rows = self._sample(samplers, logits[last_rows], plain, masks)
            tokens = sampled_last.tolist()
            logprobs = logprob_rows.entries() if logprob_rows is not None else None
        results: dict[str, int | list[int]] = dict(zip(ids, tokens))
        for request, draft, r0, _ in greedy:
            results[request.request_id] = verify_greedy(argmax[r0:r0 + len(draft) + 1], draft)
        if sampled:
            expanded = [r for r, d, *_ in sampled for _ in range(len(d) + 1)]
            index = torch.tensor([i for _, d, r0, _ in sampled for i in range(r0, r0 + len(d) + 1)],
                                 device=self.device)
            probs = self.sampler.probs(logits.index_select(0, index),
                                       SamplingBatch.build(expanded, self.vocab_size, self.device))
            offset = 0
            for request, draft, _, q in sampled:
                rows = probs[offset:offset + len(draft) + 1]
                results[request.request_id] = verify_sampled(rows, draft, request.generator, q)
                offset += len(draft) + 1
        logprob_map = {rid: lp for rid, lp in zip(ids, logprobs)} if logprobs is not None else {}
        return PendingStep.ready(results, logprob_map)

    def _next_token_buffer(self) -> tuple[torch.Tensor, torch.cuda.Event] | None:
        """The pinned buffer and event a step's sampled ids come back through, in turn: three, because the engine
        takes a step's tokens before it launches the step after next (two are queued at most), and allocating
        pinned memory and an event each step cost host time on the critical path."""
        if self.device.type != "cuda":
            return None
        if not self._token_buffers:
            self._token_buffers = [(torch.empty(self.config.max_num_seqs, dtype=torch.int64, pin_memory=True),
                                    torch.cuda.Event()) for _ in range(3)]
        self._token_turn = (self._token_turn + 1) % len(self._token_buffers)
        return self._token_buffers[self._token_turn]


class PendingStep:
    """A queued step's sampled ids: on the device (tokens, rows: request id -> row) for the next step's inputs, and
    copied to pinned host memory without waiting; result() waits for that copy (the step's one device-to-host
    wait)."""

    def __init__(self, ids: list[str], tokens: torch.Tensor | None, logprobs: dict) -> None:
        self.ids, self.tokens, self.logprobs = ids, tokens, logprobs
        self._logprob_rows: LogprobTensors | None = None  # the rows' logprobs, host copies once copied back
        # {request id: (first prompt index, entries)}: the prompt logprobs its chunks computed (prompt_logprobs.py)
        self.prompt_logprobs: dict = {}
        self.rows = {rid: i for i, rid in enumerate(ids)}
        self._host = self._event = self._ready = None

    @classmethod
    def ready(cls, results: dict, logprobs: dict) -> PendingStep:
        """A step whose tokens are already on the host (a speculative step verifies its drafts there)."""
        step = cls(list(results), None, logprobs)
        step._ready = results
        return step

    @classmethod
    def done(cls) -> PendingStep:
        return cls([], None, {})

    @classmethod
    def copy_back(cls, ids: list[str], tokens: torch.Tensor, logprobs: LogprobTensors | None = None,
                  host: tuple[torch.Tensor, torch.cuda.Event] | None = None) -> PendingStep:
        """host: a pinned buffer (at least len(ids) int64) and an event for it, the runner's, reused in turn.
        logprobs: the rows' logprobs on the device, copied back behind the same event."""
        step = cls(ids, tokens, {})
        if tokens.device.type == "cuda":
            buffer, event = host if host is not None else (torch.empty(len(ids), dtype=torch.int64, pin_memory=True),
                                                            torch.cuda.Event())
            step._host = buffer[:len(ids)]
            step._host.copy_(tokens, non_blocking=True)
            if logprobs is not None:  # requests with logprobs are rarer: their pinned buffers are made per step
                copies = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in logprobs.tensors()]
                for copy, t in zip(copies, logprobs.tensors()):
                    copy.copy_(t, non_blocking=True)
                logprobs = logprobs.with_tensors(copies)
            step._event = event
            event.record()
        else:
            step._host = tokens
        step._logprob_rows = logprobs
        return step

    def result(self) -> tuple[dict[str, int], dict[str, dict]]:
        if self._ready is not None:
            return self._ready, self.logprobs
        if self.tokens is None:
            return {}, {}
        if self._event is not None:
            self._event.synchronize()
        if self._logprob_rows is not None:
            entries, self._logprob_rows = self._logprob_rows.entries(), None
            self.logprobs = {rid: lp for rid, lp in zip(self.ids, entries) if lp is not None}
        return dict(zip(self.ids, self._host.tolist())), self.logprobs


class _ProfileRequest:
    """A prompt of n tokens for the memory profile's worst-case step."""

    def __init__(self, n: int) -> None:
        self.all_token_ids = [0] * n
        self.num_computed_tokens = 0
        self.num_tokens = n
        self.lora_request = None


def kv_cache_is_measured(config: EngineConfig, device: torch.device) -> bool:
    """Whether the KV cache's size comes from the CUDA memory profile (a forward pass of the loaded model)."""
    return config.num_gpu_blocks_override is None and config.kv_cache_memory is None and device.type == "cuda"


def kv_cache_blocks(config: EngineConfig, device: torch.device, bytes_per_block: int, max_model_len: int,
                    profile_cuda) -> int:
    """KV blocks: num_gpu_blocks_override; kv_cache_memory's; on CUDA what profile_cuda() measures (bytes); on CPU
    CPU_DEFAULT_KV_CACHE_BYTES' or, when fewer, max_num_seqs sequences of max_model_len tokens'. What ModelRunner
    gets and `kvgate serve --print-config` prints (runner.RunnerPlan) alike."""
    if config.num_gpu_blocks_override is not None:
        return config.num_gpu_blocks_override
    if config.kv_cache_memory is not None:
        return config.kv_cache_memory // bytes_per_block
    if kv_cache_is_measured(config, device):
        return profile_cuda() // bytes_per_block
    full = config.max_num_seqs * cdiv(max_model_len, config.block_size) * bytes_per_block
    return min(CPU_DEFAULT_KV_CACHE_BYTES, full) // bytes_per_block


def check_kv_cache_backend(kv_cache_dtype: str, kv_quant, attention_backend: str, device: torch.device) -> None:
    if (kv_quant is not None and kv_quant.value_dtype != torch.int8 and attention_backend == "triton"
            and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9)):
        raise ConfigError(f"kv_cache_dtype {kv_cache_dtype} on the Triton kernels needs fp8 conversions "
                          "(compute capability 8.9+: Ada, Hopper): use int8, or attention_backend sdpa")


def choose_attention_backend(name: str, device: torch.device) -> str:
    """sdpa (attention.py) or triton (triton_attention.py), chosen once at start and logged.

    auto: Triton's kernels on CUDA; SDPA over gathered blocks on CPU, where the gathers are cheap and the Triton
    interpreter is far slower than SDPA."""
    if name == "auto":
        name = "triton" if device.type == "cuda" and HAS_TRITON else "sdpa"
        if device.type == "cuda" and not HAS_TRITON:
            log.warning("attention: Triton is not installed; CUDA runs the SDPA path (slow: gathered copies)")
    if name == "triton":
        if not HAS_TRITON:
            raise ConfigError("attention_backend triton needs the triton package")
        if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError("attention_backend triton on CPU runs only under Triton's interpreter: set "
                              "TRITON_INTERPRET=1 before the engine starts (for tests; it is slow)")
    log.info("attention: %s on %s", name, device)
    return name
