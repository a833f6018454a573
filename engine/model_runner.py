"""Runs the model: owns the weights, the paged KV cache tensors and one batched forward pass per step."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import torch

from kvgate.engine.attention import AttentionMetadata
from kvgate.engine.config import CPU_DEFAULT_KV_CACHE_BYTES, EngineConfig
from kvgate.engine.cpu_allocator import keep_large_allocations_in_heap
from kvgate.engine.errors import ConfigError
from kvgate.engine.kv_cache_manager import cdiv
from kvgate.engine.loader import iterate_weights
from kvgate.engine.lora.adapter import LoRAWeights, load_lora_weights
from kvgate.engine.lora.layers import add_lora_layers, module_shapes, set_slot
from kvgate.engine.lora.request import LoRARequest
from kvgate.engine.models import resolve_model_class
from kvgate.engine.models.layers import RotaryEmbedding
from kvgate.engine.request import Request
from kvgate.engine.sampler import Sampler, SamplingBatch
from kvgate.engine.scheduler import SchedulerOutput
from kvgate.engine.structured_output import fill_bitmasks

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, device: torch.device, dtype: torch.dtype,
                 max_model_len: int) -> None:
        self.config = config
        self.hf_config = hf_config
        self.device = device
        self.dtype = dtype
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.vocab_size = hf_config.vocab_size
        if device.type == "cpu":
            keep_large_allocations_in_heap()
        model_cls = resolve_model_class(hf_config)
        with torch.device("meta"):
            model = model_cls(hf_config, max_positions=max_model_len)
        model = model.to(dtype=dtype).to_empty(device=device)
        model.tie_weights()
        for module in model.modules():
            if isinstance(module, RotaryEmbedding):
                module.reset_buffers(device)
        model.load_weights(iterate_weights(config.model, dtype))
        self.model = model.eval()
        self.lora_state = self.lora_layers = None
        if config.enable_lora:  # after the base weights: the wrapped projections keep them as they are
            self.lora_state, self.lora_layers = add_lora_layers(model, config.max_loras, config.max_lora_rank)
        self.num_layers = hf_config.num_hidden_layers
        self.sliding_window = model.sliding_window
        if self.sliding_window is not None and self.sliding_window >= max_model_len:
            self.sliding_window = None
        self.sampler = Sampler()
        # Structured-output masks beside the forward pass (see execute); started by the first constrained request.
        self.fill_masks_in_thread = device.type != "cpu"
        self._mask_pool: ThreadPoolExecutor | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.num_blocks = 0

    # -- KV cache ---------------------------------------------------------------------------------

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.model.num_kv_heads * self.model.head_dim * elem

    def determine_num_blocks(self) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks_override is not None:
            num_blocks = cfg.num_gpu_blocks_override
        elif cfg.kv_cache_memory is not None:
            num_blocks = cfg.kv_cache_memory // self.bytes_per_block
        elif self.device.type == "cuda":
            num_blocks = self._profile_cuda_kv_bytes() // self.bytes_per_block
        else:
            full = cfg.max_num_seqs * cdiv(self.max_model_len, self.block_size) * self.bytes_per_block
            num_blocks = min(CPU_DEFAULT_KV_CACHE_BYTES, full) // self.bytes_per_block
        if num_blocks * self.block_size < self.max_model_len:
            raise ConfigError(
                f"the KV cache holds {num_blocks * self.block_size} tokens ({num_blocks} blocks of "
                f"{self.bytes_per_block} bytes), fewer than max_model_len {self.max_model_len}: "
                "give it more memory (kv_cache_memory) or lower max_model_len"
            )
        return num_blocks

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (2, self.model.num_kv_heads, num_blocks * self.block_size, self.model.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.num_blocks = num_blocks

    def _profile_cuda_kv_bytes(self) -> int:
        """Free memory after a worst-case forward (max_num_batched_tokens), times gpu_memory_utilization."""
        n = min(self.config.max_num_batched_tokens, self.max_model_len)
        self.allocate_kv_cache(cdiv(n, self.block_size))
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        baseline = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            ids = torch.zeros(n, dtype=torch.long, device=self.device)
            meta = self._attention_metadata([(0, n, list(range(self.num_blocks)))])
            hidden = self.model(ids, torch.arange(n, device=self.device), self.kv_caches, meta)
            rows = min(self.config.max_num_seqs, n)
            self.model.compute_logits(hidden[:rows]).float().softmax(-1)
        torch.cuda.synchronize(self.device)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - baseline
        self.kv_caches = []
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        available = int(total * self.config.gpu_memory_utilization - used - activation_peak)
        log.info("CUDA memory: total %.1f GiB, in use %.1f GiB, activation peak %.2f GiB -> KV cache %.1f GiB",
                 total / 2**30, used / 2**30, activation_peak / 2**30, max(available, 0) / 2**30)
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

    # -- one step ---------------------------------------------------------------------------------

    def _attention_metadata(self, seqs) -> AttentionMetadata:
        return AttentionMetadata.build(seqs, self.block_size, self.device, self.model.num_kv_heads,
                                       self.num_blocks, self.sliding_window)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput):
        """One forward pass for the whole batch; returns {request_id: token} and {request_id: logprobs}."""
        input_ids: list[int] = []
        positions: list[int] = []
        seqs = []
        sample_rows: list[int] = []
        samplers: list[Request] = []
        lora_rows: dict[int, list[int]] = {}  # slot -> token rows of this step
        for s in out.scheduled:
            r = s.request
            start, n = r.num_computed_tokens, s.num_new_tokens
            if r.lora_request is not None:
                lora_rows.setdefault(out.lora_slots[r.lora_request.lora_int_id], []).extend(
                    range(len(input_ids), len(input_ids) + n))
            input_ids.extend(r.all_token_ids[start : start + n])
            positions.extend(range(start, start + n))
            seqs.append((start, n, s.block_ids))
            if s.samples:
                sample_rows.append(len(input_ids) - 1)
                samplers.append(r)
        # Structured-output masks: only constrained rows get one, so unconstrained batches pay nothing. On an
        # accelerator they are filled in a thread while the forward pass runs (the CPU is idle then; llguidance
        # drops the GIL). On CPU the forward pass already uses every core, and a mask thread beside it only
        # fights torch's threads: `kvgate bench structured-outputs --num-requests 128` (demo, 2 shared cores)
        # ran the half-constrained batch at 0.33x with the thread and 0.91x filling the masks in line.
        masks = None
        if any(r.grammar is not None for r in samplers):
            width = (self.vocab_size + 31) // 32
            if not self.fill_masks_in_thread:
                masks = fill_bitmasks(samplers, width)
            else:
                if self._mask_pool is None:
                    self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-grammar")
                masks = self._mask_pool.submit(fill_bitmasks, samplers, width)
        dev = self.device
        meta = self._attention_metadata(seqs)
        if self.lora_state is not None:
            self.lora_state.groups = [(slot, torch.tensor(rows, dtype=torch.long, device=dev))
                                      for slot, rows in lora_rows.items()]
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            self.kv_caches,
            meta,
        )
        if not samplers:
            return {}, {}
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=dev)])
        grammar = ([], None) if masks is None else masks if isinstance(masks, tuple) else masks.result()
        for r in samplers:  # a seeded request's own generator, made at its first token and kept on the request
            if r.generator is None and r.sampling_params.seed is not None:
                r.generator = torch.Generator(device=dev)
                r.generator.manual_seed(r.sampling_params.seed)
        batch = SamplingBatch.build(samplers, self.vocab_size, dev, grammar)
        tokens, logprobs = self.sampler(logits, batch)
        ids = [r.request_id for r in samplers]
        token_map = dict(zip(ids, tokens.tolist()))
        logprob_map = {rid: lp for rid, lp in zip(ids, logprobs)} if logprobs is not None else {}
        return token_map, logprob_map
