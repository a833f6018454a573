"""Engine arguments (the `kvgate serve` flags) and their validation against the model."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvgate.common.errors import ConfigError

if TYPE_CHECKING:
    import torch

# --kv-cache-dtype values (vLLM's names; kv_quant.py imports torch, so the list lives here)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")

# dtype names -> torch attribute names (torch itself is imported only when a device or dtype is resolved)
_DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
}

# Without a GPU to measure, the KV cache gets this much memory unless --kv-cache-memory says otherwise
# (or less, when max_num_seqs full-length sequences need less).
CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30

# max_num_seqs and max_num_batched_tokens when not given (vLLM's); auto_config.py may lower max_num_seqs to fit.
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

# vLLM's largest supported --max-lora-rank.
MAX_LORA_RANK = 512

# The longest one engine step may take before the server declares the engine dead (AsyncLLM; --engine-step-timeout).
# vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S default: far above any sane step (a full 2048-token batch of a large
# model on a slow accelerator takes seconds), far below a client's patience.
DEFAULT_STEP_TIMEOUT_S = 60.0


@dataclass
class EngineConfig:
    model: str
    backend: str = "torch"  # torch | sim (a timing model instead of weights, see sim_runner.py)
    sim_profile: object | None = None  # SimProfile for the sim backend; None = its defaults
    tokenizer: str | None = None
    served_model_name: str | None = None
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"
    # vLLM's --quantization: fp8 | compressed-tensors | gptq | awq; None = the checkpoint's quantization_config
    # (engine/quantization); given, it must be the checkpoint's method.
    quantization: str | None = None
    block_size: int = 16
    # None: derived at start (auto_config.py), as are max_model_len, dtype and cpu_threads.
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_cache_memory: int | None = None  # bytes; None = automatic
    # vLLM's --kv-cache-dtype: auto (the model's dtype) or a quantized cache (kv_quant.py); fp8 = fp8_e4m3
    kv_cache_dtype: str = "auto"
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    # The GPU path (vLLM's flags): --enforce-eager turns CUDA graphs off; graphs of mixed prefill+decode steps are
    # captured up to max_cudagraph_capture_size tokens (None: cuda_graphs.DEFAULT_MAX_CAPTURE_SIZE; 0: decode
    # graphs only). attention_backend: auto | sdpa | triton (see model_runner.choose_attention_backend).
    enforce_eager: bool = False
    max_cudagraph_capture_size: int | None = None
    attention_backend: str = "auto"
    # Split-KV decode on the Triton path (triton_split_decode.py): the most splits one sequence's context takes in a
    # decode step of a small batch; 1 turns it off.
    max_decode_splits: int = 32
    # vLLM's --async-scheduling: schedule the next step while the device runs this one (model_runner.launch).
    # None: on for the torch backend on CUDA, off elsewhere (on CPU the forward pass is itself host work, and the
    # sim's step is a sleep).
    async_scheduling: bool | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    # vLLM's --long-prefill-token-threshold: at most this many prompt tokens of one request a step (0: no cap)
    long_prefill_token_threshold: int = 0
    scheduling_policy: str = "fcfs"
    seed: int = 0
    cpu_threads: int | None = None  # torch's intra-op threads; None: OMP_NUM_THREADS, else the pod's CPUs
    kv_events_config: object | None = None  # KVEventsConfig (kv_events.py); None = no KV-cache events
    # Multi-LoRA (vLLM's flags): adapters resident for a batch, their largest rank, adapters kept loaded in host
    # memory (None = max_loras), and the adapters served from the start (LoRAModulePath, engine/lora/request.py).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple = ()
    # vLLM's --speculative-config: a SpeculativeConfig (spec_decode.py), or its dict; None = no speculation.
    speculative_config: object | None = None
    # Adaptive drafting (spec_decode.DraftBackoff; no vLLM counterpart, so not a --speculative-config key): a request
    # whose moving average of accepted drafts per drafted step falls below this pauses drafting, for pauses that
    # double while probes fail; 0 drafts every step (vLLM's behaviour). Applies to ngram and draft_model alike.
    speculative_backoff_threshold: float = 0.25
    # vLLM's --generation-config (auto: the model folder's generation_config.json, vllm: none, or a folder) and
    # --override-generation-config (a dict): sampling defaults for requests that leave fields out
    # (generation_defaults.py; the server and LLM.get_default_sampling_params read them).
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    # vLLM's --tensor-parallel-size: the model sharded over this many ranks (rank 0 this process, the others worker
    # processes; engine/distributed/), each on its own GPU on CUDA.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            from kvgate.engine.spec_decode import SpeculativeConfig

            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if self.speculative_config is not None:
            if self.backend != "torch":
                raise ConfigError("speculative decoding needs the torch backend (the sim has no model to verify with)")
            # A step's drafts are proposed from the request's tokens, which async scheduling does not have yet.
            if self.async_scheduling:
                raise ConfigError("speculative decoding runs with synchronous scheduling: drop --async-scheduling")
        threshold = self.speculative_backoff_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold >= 0:
            raise ConfigError(f"speculative_backoff_threshold must be a number >= 0, got {threshold!r}")
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise ConfigError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
        if tp > 1:
            if self.backend != "torch":
                raise ConfigError("tensor_parallel_size > 1 needs the torch backend")
            if self.enable_lora:
                raise ConfigError("LoRA adapters are not supported with tensor_parallel_size > 1")
            if self.speculative_config is not None and self.speculative_config.method == "draft_model":
                raise ConfigError("a draft model (speculative decoding) is not supported with tensor_parallel_size "
                                  "> 1: use the ngram method")
        if self.backend not in ("torch", "sim"):
            raise ConfigError(f"backend must be torch or sim, got {self.backend!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "cpu_threads"):
            value = getattr(self, name)
            if name != "block_size" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        threshold = self.long_prefill_token_threshold
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ConfigError(f"long_prefill_token_threshold must be an integer >= 0, got {threshold!r}")
        if threshold and not self.enable_chunked_prefill:
            raise ConfigError("long_prefill_token_threshold caps a prompt's chunks: it needs chunked prefill")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"kv_cache_memory must be a positive number of bytes, got {self.kv_cache_memory}")
        if self.quantization is not None:
            from kvgate.engine.quantization.config import METHODS

            if self.quantization not in METHODS:
                raise ConfigError(f"quantization must be one of {', '.join(METHODS)} (or None: from the checkpoint), "
                                  f"got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                              f"{self.kv_cache_dtype!r}")
        if self.attention_backend not in ("auto", "sdpa", "triton"):
            raise ConfigError(f"attention_backend must be auto, sdpa or triton, got {self.attention_backend!r}")
        if self.max_cudagraph_capture_size is not None and (
                not isinstance(self.max_cudagraph_capture_size, int) or self.max_cudagraph_capture_size < 0):
            raise ConfigError("max_cudagraph_capture_size must be a non-negative integer, got "
                              f"{self.max_cudagraph_capture_size!r}")
        splits = self.max_decode_splits
        if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= 256:
            raise ConfigError(f"max_decode_splits must be an integer in [1, 256], got {self.max_decode_splits!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ConfigError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("lora_modules were given but LoRA is off: add enable_lora (--enable-lora)")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.max_lora_rank > MAX_LORA_RANK:
            raise ConfigError(f"max_lora_rank must be <= {MAX_LORA_RANK}, got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ConfigError(f"lora_modules names must be unique, got {names}")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ConfigError(f"dtype must be auto or one of {sorted(set(_DTYPES))}, got {self.dtype!r}")

    def resolve_device(self) -> "torch.device":
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device cuda was asked for, but torch sees no CUDA device")
        return device

    def resolve_dtype(self, hf_config, device: "torch.device") -> "torch.dtype":
        """The dtype auto_config.resolve_dtype gives (and says why)."""
        from kvgate.engine.auto_config import resolve_dtype

        return resolve_dtype(self, hf_config, device)[0]

    def resolve_max_model_len(self, hf_config) -> int:
        limit = getattr(hf_config, "max_position_embeddings", None)
        if self.max_model_len is None:
            if limit is None:
                raise ConfigError("the model config has no max_position_embeddings: set max_model_len")
            return int(limit)
        if limit is not None and self.max_model_len > limit:
            raise ConfigError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings {limit}"
            )
        return self.max_model_len
