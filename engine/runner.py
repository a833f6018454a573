"""What the engine core needs of a model runner, and the one place where the torch and sim backends differ.

`load_model(config)` gives the runner with what comes with it (tokenizer, HF config, context length); the engine
core (llm_engine.py) only wires it to the scheduler and never asks which backend it has.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from kvgate.engine.auto_config import GIVEN, Settings, apply_cpu_threads, resolve_dtype, resolve_step_budget
from kvgate.common.errors import ConfigError
from kvgate.engine.config import EngineConfig
from kvgate.common.tokenizer_files import load_tokenizer
from kvgate.engine.loader import load_hf_config
from kvgate.engine.lora.request import LoRARequest
from kvgate.engine.scheduler import SchedulerOutput


class StepResult(Protocol):
    # {request id: (index of its first prompt token scored, one {token id: Logprob} per token)}: the prompt logprobs
    # the step's chunks computed (prompt_logprobs.py); empty when none asked
    prompt_logprobs: dict

    def result(self) -> tuple[dict[str, int], dict[str, dict]]:
        """What execute returns, once the step has run."""


class Runner(Protocol):
    device: torch.device
    dtype: torch.dtype
    # positions this far behind a sequence's next query are read by no layer again (every layer slides): its KV
    # blocks wholly behind them may be freed; None: every block is read until the sequence ends
    kv_window: int | None

    @property
    def bytes_per_block(self) -> int:
        """KV-cache bytes of one block (every layer's K and V)."""

    def determine_num_blocks(self) -> int:
        """KV blocks that fit the memory it may use."""

    def allocate_kv_cache(self, num_blocks: int) -> None: ...

    def execute(self, out: SchedulerOutput) -> tuple[dict[str, int], dict[str, dict]]:
        """Run one scheduled batch: ({request id: sampled token}, {request id: its logprobs})."""

    def launch(self, out: SchedulerOutput, running: object | None = None) -> StepResult:
        """Queue one scheduled batch (execute without the wait); running: the step queued before it, whose sampled
        ids fill this step's output placeholders (async scheduling)."""

    def load_lora(self, lora: LoRARequest) -> object:
        """An adapter read and checked (LoRAError when it cannot be served), in the form set_lora_slot takes."""

    def set_lora_slot(self, slot: int, adapter: object | None) -> None: ...

    def close(self) -> None:
        """Release what it holds outside memory (threads)."""


@dataclass
class LoadedModel:
    runner: Runner
    tokenizer: object
    hf_config: object
    max_model_len: int  # the model's or the given one; auto_config.fit_to_kv_cache may lower it
    config: EngineConfig  # with max_num_batched_tokens resolved and max_num_seqs at its upper bound
    settings: Settings  # what was derived so far, and why


def load_model(config: EngineConfig, read_weights: bool = True) -> LoadedModel:
    """read_weights False (`kvgate serve --print-config`): the same settings without reading a byte of the weights
    (plan_model)."""
    settings = Settings()
    if config.backend == "sim":
        from kvgate.engine.sim_runner import SimModelRunner, SimProfile, sim_hf_config

        profile = config.sim_profile or SimProfile()
        tokenizer = load_tokenizer(_sim_tokenizer_path(config))
        hf_config = sim_hf_config(profile, tokenizer)
        max_model_len = config.resolve_max_model_len(hf_config)
        config = resolve_step_budget(config, max_model_len, settings)
        return LoadedModel(SimModelRunner(config, profile, tokenizer, max_model_len), tokenizer, hf_config,
                           max_model_len, config, settings)
    if not read_weights:
        return plan_model(config, settings)
    from kvgate.engine.model_runner import ModelRunner

    hf_config, tokenizer, device, dtype, max_model_len = _resolve_model(config, settings)
    config = resolve_step_budget(config, max_model_len, settings)
    if config.tensor_parallel_size == 1:
        runner = ModelRunner(config, hf_config, device, dtype, max_model_len)
    else:
        runner = _tensor_parallel_runner(config, hf_config, device, dtype, max_model_len, settings)
    return LoadedModel(runner, tokenizer, hf_config, max_model_len, config, settings)


def _tensor_parallel_runner(config: EngineConfig, hf_config, device, dtype, max_model_len: int, settings: Settings):
    """Rank 0's ModelRunner, with ranks 1..N-1 started (distributed/workers.py) and each one's model built."""
    from kvgate.engine.distributed.group import TensorParallelGroup
    from kvgate.engine.distributed.workers import start_ranks
    from kvgate.engine.model_runner import ModelRunner
    from kvgate.engine.models import MODEL_REGISTRY, resolve_model_class
    from kvgate.engine.models.parallel_linear import attention_heads

    if resolve_model_class(hf_config) not in MODEL_REGISTRY.values():  # its HF modules hold whole weights
        raise ConfigError(f"tensor_parallel_size > 1 needs a native model family; "
                          f"{'/'.join(getattr(hf_config, 'architectures', None) or ['this model'])} runs on the "
                          "transformers fallback, which is not sharded")
    # the heads' split checked before any process starts (the other sizes as the model is built, on every rank)
    heads = hf_config.num_attention_heads
    attention_heads(heads, getattr(hf_config, "num_key_value_heads", None) or heads,
                    TensorParallelGroup(0, config.tensor_parallel_size))
    group, workers = start_ranks(config, hf_config, device, dtype, max_model_len)
    try:
        runner = ModelRunner(config, hf_config, device, dtype, max_model_len, tp=group, workers=workers)
        for rank in range(1, group.size):  # each worker says when its model is built
            workers.receive(rank)
    except BaseException:
        workers.close()
        group.abort()
        raise
    settings.add("tensor_parallel_size", group.size, f"given: ranks 1..{group.size - 1} are worker processes "
                 f"(pids {', '.join(str(p.pid) for p in workers.procs)}), {torch.get_num_threads()} CPU threads each")
    return runner


def _resolve_model(config: EngineConfig, settings: Settings):
    """What comes before the weights: the HF config and tokenizer, device, threads, dtype and context length."""
    hf_config = load_hf_config(config.model)
    tokenizer = load_tokenizer(config.model, config.tokenizer)
    device = config.resolve_device()
    settings.add("device", device, GIVEN if config.device != "auto" else
                 "auto: " + ("a CUDA device" if device.type == "cuda" else "torch sees no CUDA device"))
    apply_cpu_threads(config.cpu_threads, settings)  # before the weights load: the loader's copies use them
    dtype, why = resolve_dtype(config, hf_config, device)
    settings.add("dtype", str(dtype).removeprefix("torch."), why)
    max_model_len = config.resolve_max_model_len(hf_config)
    return hf_config, tokenizer, device, dtype, max_model_len


def plan_model(config: EngineConfig, settings: Settings) -> LoadedModel:
    """load_model's settings without its weights (`kvgate serve --print-config`): the architecture from config.json,
    the weights' sizes from their safetensors headers (checked against the model as a load checks them, each tensor
    counted at the dtype the engine casts it to; printed as `weights` and `draft_weights`, which a start does not
    log), the KV cache's bytes per block from the architecture. Its runner is a RunnerPlan, which sizes the KV cache
    as ModelRunner does; only a CUDA memory profile needs a ModelRunner, built with its parameters allocated but
    not read (read_weights False): that profile measures the device's memory after a forward pass, which needs the
    model on the device, but not the values of its weights."""
    from kvgate.engine.kv_quant import kv_quant_spec
    from kvgate.engine.loader import build_model, checkpoint_file_bytes, checkpoint_weight_bytes
    from kvgate.engine.quantization import quant_config_from_hf
    from kvgate.engine.model_runner import (ModelRunner, check_kv_cache_backend, choose_attention_backend,
                                            kv_cache_is_measured)

    from kvgate.engine.distributed.group import TensorParallelGroup, building_for

    hf_config, tokenizer, device, dtype, max_model_len = _resolve_model(config, settings)
    meta = torch.device("meta")
    if config.tensor_parallel_size > 1 and kv_cache_is_measured(config, device):
        raise ConfigError("--print-config with tensor_parallel_size > 1 on CUDA cannot profile the ranks' memory: "
                          "give --kv-cache-memory or --num-gpu-blocks-override")
    # With tensor parallelism the weights and the KV cache per block are rank 0's (each rank has its share).
    with building_for(TensorParallelGroup(0, config.tensor_parallel_size)):
        model = build_model(hf_config, meta, dtype, max_model_len)
    qconfig = quant_config_from_hf(hf_config, config.quantization)
    _add_weights(settings, "weights", config.model, checkpoint_weight_bytes(model, config.model, qconfig), dtype,
                 None if qconfig is None else (qconfig.describe(), checkpoint_file_bytes(config.model)))
    models = [(model, hf_config.num_hidden_layers)]
    spec = config.speculative_config
    if spec is not None and spec.method == "draft_model":
        from kvgate.engine.draft_model import resolve_draft

        path, draft_hf = resolve_draft(spec, config, hf_config, max_model_len)
        draft = build_model(draft_hf, meta, dtype, max_model_len)
        _add_weights(settings, "draft_weights", path,
                     checkpoint_weight_bytes(draft, path, quant_config_from_hf(draft_hf)), dtype)
        models.append((draft, draft_hf.num_hidden_layers))
    config = resolve_step_budget(config, max_model_len, settings)
    if kv_cache_is_measured(config, device):
        runner = ModelRunner(config, hf_config, device, dtype, max_model_len, read_weights=False)
    else:
        kv_quant = kv_quant_spec(config.kv_cache_dtype)
        check_kv_cache_backend(config.kv_cache_dtype, kv_quant, choose_attention_backend(config.attention_backend,
                                                                                         device), device)
        runner = RunnerPlan(config, device, dtype, max_model_len, models, kv_quant)
    return LoadedModel(runner, tokenizer, hf_config, max_model_len, config, settings)


def _add_weights(settings: Settings, name: str, path: str, sized: tuple[int, int], dtype: torch.dtype,
                 quantized: tuple[str, int] | None = None) -> None:
    """quantized: (the checkpoint's quantization, the bytes it stores) of a checkpoint dequantized at load."""
    nbytes, tensors = sized
    size = f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
    how = (f"; the checkpoint stores {quantized[1]} bytes, quantized with {quantized[0]}, dequantized at load"
           if quantized else "")
    settings.add(name, size, f"{nbytes} bytes: {tensors} tensors as {str(dtype).removeprefix('torch.')}, from the "
                 f"safetensors headers in {path}{how}")


class RunnerPlan:
    """A runner's KV-cache sizing without its model: bytes per block from the meta-device models' shapes (the target
    and a draft model), the blocks as ModelRunner.determine_num_blocks gives them. It cannot run a step."""

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype, max_model_len: int,
                 models: list[tuple[object, int]], kv_quant) -> None:
        self.config, self.device, self.dtype, self.max_model_len = config, device, dtype, max_model_len
        self.models, self.kv_quant = models, kv_quant

    @property
    def bytes_per_block(self) -> int:
        from kvgate.engine.kv_quant import kv_bytes_per_block

        return sum(kv_bytes_per_block(model, layers, self.config.block_size, self.dtype, self.kv_quant)
                   for model, layers in self.models)

    def determine_num_blocks(self) -> int:
        from kvgate.engine.model_runner import kv_cache_blocks

        return kv_cache_blocks(self.config, self.device, self.bytes_per_block, self.max_model_len, None)

    def close(self) -> None:
        pass


def _sim_tokenizer_path(config: EngineConfig) -> str:
    """The sim serves any model name: a folder's own tokenizer if it has one, else the byte tokenizer."""
    from kvgate.common.demo import ensure_byte_tokenizer

    if config.tokenizer:
        return config.tokenizer
    folder = Path(config.model)
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
        return str(folder)
    return str(ensure_byte_tokenizer())
