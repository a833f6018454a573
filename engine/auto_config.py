"""Settings the engine derives when it was not given them, from the device and the model, each with why.

`kvgate serve --print-config` prints them and exits; the engine logs the same lines when it starts. A setting's
source is "given" (a flag or an EngineConfig field) or the rule that derived it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.common.errors import ConfigError

log = logging.getLogger(__name__)

GIVEN = "given"

# CPU dtype. bfloat16 halves the bytes each step reads; with AVX512-BF16 (or AMX) the CPU also multiplies it
# natively. `python -m kvgate.bench.engine_cpu_dtype --rounds 7` prints bf16's speed-up over float32 (decode at
# several batch sizes and a prefill) for the demo's shapes, hidden 512 and Qwen2.5-0.5B's; on a CPU with
# AVX512-BF16 it picks this rule: bfloat16 where the CPU has the instructions and the model is at least hidden 512
# (clearly faster there at every batch); float32 for smaller models (not clearly faster at small batches) and CPUs
# without them. The
# tests' tiny models (hidden 64, the demo's 256) stay float32 on every CPU, so parity with HF in float32 holds.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
CPU_BF16_MIN_HIDDEN = 512


def cpu_bf16_flags(cpuinfo: str) -> list[str]:
    """The bfloat16 instruction sets among the first CPU's flags in /proc/cpuinfo text (x86)."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags = set(line.partition(":")[2].split())
            return [f for f in CPU_BF16_FLAGS if f in flags]
    return []


def cpu_dtype(hidden_size: int, bf16_flags: list[str]) -> tuple[str, str]:
    """(dtype name, why) on CPU when not given: the rule and measurement above."""
    if not bf16_flags:
        return "float32", "float32 on CPU: no AVX512-BF16/AMX (bfloat16 would be converted, not multiplied)"
    if hidden_size < CPU_BF16_MIN_HIDDEN:
        return "float32", (f"float32 on CPU: hidden size {hidden_size} < {CPU_BF16_MIN_HIDDEN}, where bfloat16 "
                           "is not clearly faster (auto_config.py)")
    return "bfloat16", (f"bfloat16 on CPU: {'+'.join(bf16_flags)}, hidden size {hidden_size} >= "
                        f"{CPU_BF16_MIN_HIDDEN} (faster than float32 there, auto_config.py)")


def read_cpuinfo(path: str = "/proc/cpuinfo") -> str:
    try:
        return Path(path).read_text()
    except OSError:  # not Linux: no flags known, float32
        return ""


@dataclass
class Setting:
    name: str
    value: object
    source: str


@dataclass
class Settings:
    """The engine's settings in the order they were resolved, each with its source."""

    items: list[Setting] = field(default_factory=list)

    def add(self, name: str, value: object, source: str) -> None:
        self.items.append(Setting(name, value, source))

    def get(self, name: str) -> Setting:
        return next(s for s in self.items if s.name == name)

    def lines(self) -> list[str]:
        width = max((len(s.name) for s in self.items), default=0)
        return [f"{s.name:<{width}}  {s.value}  ({s.source})" for s in self.items]

    def log(self) -> None:
        for line in self.lines():
            log.info("config: %s", line)


# -- CPU threads ---------------------------------------------------------------------------------------------------

def cgroup_cpu_quota(root: str | Path = "/sys/fs/cgroup") -> tuple[float | None, str]:
    """CPUs the cgroup's quota allows (None: no quota) and the file it came from: cgroup v2 cpu.max, else v1
    cpu.cfs_quota_us / cpu.cfs_period_us (-1 = no quota). A file that does not parse counts as no quota (the
    affinity still bounds the threads) rather than stopping the engine."""
    root = Path(root)
    v2 = root / "cpu.max"
    try:
        if v2.is_file():
            quota, _, period = v2.read_text().strip().partition(" ")
            if quota == "max":
                return None, str(v2)
            return _ratio(int(quota), int(period or 100000), v2)
        for folder in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
            quota_file = root / folder / "cpu.cfs_quota_us"
            if quota_file.is_file():
                quota = int(quota_file.read_text().strip())
                if quota <= 0:
                    return None, str(quota_file)
                return _ratio(quota, int((root / folder / "cpu.cfs_period_us").read_text().strip()), quota_file)
    except (OSError, ValueError) as exc:
        return None, f"cgroup CPU quota unreadable ({exc})"
    return None, "no cgroup CPU controller"


def _ratio(quota: int, period: int, where: Path) -> tuple[float | None, str]:
    if quota <= 0 or period <= 0:
        return None, f"{where}: quota {quota} / period {period} is no limit"
    return quota / period, str(where)


def available_cpus(affinity: int, root: str | Path = "/sys/fs/cgroup") -> tuple[int, str]:
    """Threads this process can keep busy: the smaller of its CPU affinity and its cgroup quota rounded up (a pod's
    1.5 CPUs run 2 threads part of the time), at least 1. os.cpu_count() is the node's, not the pod's."""
    quota, where = cgroup_cpu_quota(root)
    if quota is None:
        return max(1, affinity), f"CPU affinity {affinity}, no cgroup quota ({where})"
    limit = math.ceil(quota)
    return max(1, min(affinity, limit)), f"min(CPU affinity {affinity}, cgroup quota {quota:g} CPUs -> {limit})"


def resolve_cpu_threads(given: int | None, env: dict | None = None) -> tuple[int, str]:
    """--cpu-threads, else OMP_NUM_THREADS (torch reads it at start), else available_cpus of this process."""
    env = os.environ if env is None else env
    if given is not None:
        return given, GIVEN
    omp = env.get("OMP_NUM_THREADS", "").strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    return available_cpus(len(os.sched_getaffinity(0)))


def apply_cpu_threads(given: int | None, settings: Settings) -> None:
    import torch

    threads, source = resolve_cpu_threads(given)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    settings.add("cpu_threads", threads, source)


# -- dtype ---------------------------------------------------------------------------------------------------------

def resolve_dtype(config, hf_config, device) -> tuple[object, str]:
    """(torch dtype, why). GPU: the checkpoint's dtype, bfloat16 for float32 checkpoints, float16 where the GPU has
    no bfloat16 (compute capability < 8.0). CPU: cpu_dtype."""
    import torch

    from kvgate.engine.config import _DTYPES

    if config.dtype != "auto":
        return getattr(torch, _DTYPES[config.dtype]), GIVEN
    if device.type == "cpu":
        name, why = cpu_dtype(int(getattr(hf_config, "hidden_size", 0) or 0), cpu_bf16_flags(read_cpuinfo()))
        return getattr(torch, name), why
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, _DTYPES.get(dtype, "float32"))
    if dtype in (None, torch.float32):
        dtype, why = torch.bfloat16, f"checkpoint {dtype or 'dtype unknown'}: bfloat16 on GPU"
    else:
        why = "the checkpoint's dtype"
    if dtype == torch.bfloat16 and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 0):
            return torch.float16, f"{why}, but compute capability {capability[0]}.{capability[1]} has no bfloat16"
    return dtype, why


# -- sizes ---------------------------------------------------------------------------------------------------------

def resolve_step_budget(config, max_model_len: int, settings: Settings):
    """max_num_batched_tokens before the runner is built (it sizes the step buffers and the memory profile), and
    max_num_seqs at its default for now (an upper bound; fit_to_kv_cache lowers it once the cache is sized)."""
    from kvgate.engine.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS

    tokens = config.max_num_batched_tokens
    if tokens is not None:
        settings.add("max_num_batched_tokens", tokens, GIVEN)
    elif not config.enable_chunked_prefill and max_model_len > DEFAULT_MAX_NUM_BATCHED_TOKENS:
        tokens = max_model_len
        settings.add("max_num_batched_tokens", tokens, "max_model_len: without chunked prefill a prompt is one step")
    else:
        tokens = DEFAULT_MAX_NUM_BATCHED_TOKENS
        settings.add("max_num_batched_tokens", tokens, "default (vLLM's): longer prompts are prefilled in chunks")
    seqs = config.max_num_seqs if config.max_num_seqs is not None else DEFAULT_MAX_NUM_SEQS
    return dataclasses.replace(config, max_num_batched_tokens=tokens, max_num_seqs=seqs)


def cuda_kv_cache_bytes(total: int, own: int, free: int, activation_peak: int,
                        utilization: float) -> tuple[int, bool]:
    """The KV cache's bytes on a GPU, as vLLM's --gpu-memory-utilization means it: a per-engine limit. This engine
    may use `utilization` of the device's memory in all (`own`: what its allocator holds after the memory profile,
    weights mostly; then the worst step's activations and the KV cache), whatever other processes hold: two engines
    at 0.45 share one GPU. The cache is also no more than what is free less the activations (vLLM refuses to start
    instead when its share is not free; here the cache shrinks, and the second value, True, says so for the log).
    The CUDA context and the libraries' workspaces (~0.5 GiB, outside torch's allocator) are not counted."""
    share = total * utilization - own
    return int(min(share, free) - activation_peak), free < share


def kv_cache_source(config, device_type: str) -> str:
    if config.num_gpu_blocks_override is not None:
        return "given (num_gpu_blocks_override)"
    if config.kv_cache_memory is not None:
        return "given (kv_cache_memory)"
    if config.backend == "sim":
        return "the sim profile's kv_cache_memory"
    if device_type == "cuda":
        return (f"measured: gpu_memory_utilization {config.gpu_memory_utilization} of the GPU, less this engine's "
                "weights and a worst-case step's activations")
    return "CPU default: 1 GiB, or less when max_num_seqs full-length sequences need less"


def fit_to_kv_cache(given, config, max_model_len: int, num_blocks: int, settings: Settings) -> tuple[object, int]:
    """Once the KV cache is sized: max_model_len lowered to what it holds when not given (given and too long stays
    an error), max_num_seqs no more than its blocks (a running sequence holds at least one). given: the config as
    the user gave it (None = derive); config: the one the runner was built with. Returns (config, max_model_len)."""
    block_size = config.block_size
    capacity = num_blocks * block_size
    if capacity < max_model_len:
        if given.max_model_len is not None:
            raise ConfigError(f"the KV cache holds {capacity} tokens ({num_blocks} blocks), fewer than max_model_len "
                              f"{max_model_len}: give it more memory (kv_cache_memory) or lower max_model_len")
        if capacity < 2:
            raise ConfigError(f"the KV cache holds {capacity} tokens ({num_blocks} blocks): give it more memory "
                              "(kv_cache_memory)")
        settings.add("max_model_len", capacity, f"the model's {max_model_len}, lowered to what the KV cache holds")
        max_model_len = capacity
    else:
        settings.add("max_model_len", max_model_len, GIVEN if given.max_model_len is not None else "the model's")
    seqs = config.max_num_seqs
    if given.max_num_seqs is not None:
        settings.add("max_num_seqs", seqs, GIVEN)
    elif num_blocks < seqs:
        seqs = num_blocks
        settings.add("max_num_seqs", seqs, f"default {config.max_num_seqs}, lowered to the KV cache's {num_blocks} "
                                           "blocks (a running sequence holds at least one)")
    else:
        settings.add("max_num_seqs", seqs, "default (vLLM's); the KV cache has a block for each")
    return dataclasses.replace(config, max_num_seqs=seqs), max_model_len
