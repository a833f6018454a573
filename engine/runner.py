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
from kvgate.engine.config import EngineConfig
from kvgate.engine.loader import load_hf_config, load_tokenizer
from kvgate.engine.lora.request import LoRARequest
from kvgate.engine.scheduler import SchedulerOutput


class StepResult(Protocol):
    def result(self) -> tuple[dict[str, int], dict[str, dict]]:
        """What execute returns, once the step has run."""


class Runner(Protocol):
    device: torch.device
    dtype: torch.dtype

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


def load_model(config: EngineConfig) -> LoadedModel:
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
    from kvgate.engine.model_runner import ModelRunner

    hf_config = load_hf_config(config.model)
    tokenizer = load_tokenizer(config.model, config.tokenizer)
    device = config.resolve_device()
    settings.add("device", device, GIVEN if config.device != "auto" else
                 "auto: " + ("a CUDA device" if device.type == "cuda" else "torch sees no CUDA device"))
    apply_cpu_threads(config.cpu_threads, settings)  # before the weights load: the loader's copies use them
    dtype, why = resolve_dtype(config, hf_config, device)
    settings.add("dtype", str(dtype).removeprefix("torch."), why)
    max_model_len = config.resolve_max_model_len(hf_config)
    config = resolve_step_budget(config, max_model_len, settings)
    runner = ModelRunner(config, hf_config, device, dtype, max_model_len)
    return LoadedModel(runner, tokenizer, hf_config, max_model_len, config, settings)


def _sim_tokenizer_path(config: EngineConfig) -> str:
    """The sim serves any model name: a folder's own tokenizer if it has one, else the byte tokenizer."""
    from kvgate.engine.demo import ensure_byte_tokenizer

    if config.tokenizer:
        return config.tokenizer
    folder = Path(config.model)
    if (folder / "tokenizer.json").is_file() or (folder / "tokenizer_config.json").is_file():
        return str(folder)
    return str(ensure_byte_tokenizer())
