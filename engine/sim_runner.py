"""`--backend sim`: the real scheduler, KV blocks, prefix cache and metrics, with the forward pass replaced
by a timing model, so many replicas with GPU-like behaviour run on a small CPU machine.

Time of one step = step overhead
                 + prefill cost x tokens actually computed (prefix-cache hits are free)
                 + decode cost x sequences decoding
                 + attention cost x context tokens attended (every scheduled sequence's context).
The engine thread sleeps for that long (less the time the step really took); it never spins. Tokens
come from a per-request generator seeded by the request's seed (or its prompt) and adapter, so outputs are
deterministic, decode to printable text and never hit EOS. A request with a structured-output constraint
draws among the tokens its grammar allows (printable ones when any is allowed), so `--backend sim` honours
schemas, regexes and choices too, and ends when the grammar is complete.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from types import SimpleNamespace

import xxhash

from kvgate.engine.config import EngineConfig
from kvgate.common.errors import ConfigError
from kvgate.engine.kv_quant import kv_bytes_per_token_head, kv_quant_spec
from kvgate.engine.lora.adapter import AdapterConfig, read_adapter_config
from kvgate.engine.lora.request import LoRARequest
from kvgate.engine.prompt_logprobs import plan_rows
from kvgate.engine.request import Logprob, Request
from kvgate.engine.scheduler import SchedulerOutput
from kvgate.engine.structured_output import allowed_token_ids, fill_bitmasks

log = logging.getLogger(__name__)

_PRINTABLE = list(range(32, 127))


@dataclass
class SimProfile:
    """Defaults resemble Llama-3.1-8B in bf16 on one H100 SXM (vLLM-like kernels)."""

    step_overhead_ms: float = 6.0  # weights streamed once per step (16 GB at ~3 TB/s) + scheduling
    prefill_ms_per_token: float = 0.035  # ~16 GFLOP per token at ~450 TFLOP/s effective
    decode_ms_per_seq: float = 0.05
    ms_per_context_token: float = 0.00005  # 128 KiB of K/V per token read at ~2.6 TB/s
    kv_bytes_per_token: int = 131072  # 32 layers x 8 KV heads x 128 dims x 2 (K, V) x 2 bytes
    # The modelled head_dim: with --kv-cache-dtype int8/fp8 a token takes kv_bytes_per_token / 2 bytes (one per
    # value instead of bf16's two) plus a float32 scale per head_dim values, as the torch backend's cache does.
    head_dim: int = 128
    kv_cache_memory: int = 56 * 2**30  # 80 GB x 0.9 minus 16 GB of weights
    max_model_len: int = 32768
    slowdown: float = 1.0  # multiplies every cost: a slower (or busier) replica
    # Fault injection for chaos tests (`kvgate bench chaos`, tests/server/test_engine_death.py): the engine loop
    # raises SimulatedEngineFault on this step (counting steps that ran a batch). 0 (default) never fails.
    fail_after_steps: int = 0
    # ... and on this step the loop hangs for good instead (a deadlocked kernel): what the server's
    # --engine-step-timeout watchdog must catch (tests/server/test_engine_death.py). 0 (default) never hangs.
    hang_after_steps: int = 0

    @classmethod
    def load(cls, path: str | Path | None, **overrides) -> "SimProfile":
        values = {}
        if path:
            try:
                from kvgate.common import bounded_file, bounded_yaml

                # YAML or JSON, within bounded_yaml's limits (1 MiB, 64 levels, 10,000 nodes)
                values = bounded_yaml.load(bounded_file.read_text(path, bounded_yaml.MAX_CHARS)) or {}
            except Exception as exc:  # noqa: BLE001 - unreadable, over a limit or not YAML: a clear config error
                raise ConfigError(f"cannot read sim profile {path}: {' '.join(str(exc).split())[:500]}") from None
            if not isinstance(values, dict):
                raise ConfigError(f"sim profile {path}: expected a mapping of SimProfile fields")
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(values) - known)
            if unknown:
                raise ConfigError(f"sim profile {path}: unknown keys {unknown}; known: {sorted(known)}")
        values.update({k: v for k, v in overrides.items() if v is not None})
        profile = cls(**values)
        for f in fields(profile):
            if getattr(profile, f.name) < 0:
                raise ConfigError(f"sim profile: {f.name} must be >= 0")
        if profile.head_dim < 1:
            raise ConfigError("sim profile: head_dim must be >= 1")
        return profile

    def step_seconds(self, prefill_tokens: int, decode_seqs: int, context_tokens: int) -> float:
        ms = (self.step_overhead_ms + self.prefill_ms_per_token * prefill_tokens
              + self.decode_ms_per_seq * decode_seqs + self.ms_per_context_token * context_tokens)
        return ms * self.slowdown / 1000.0

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def sim_hf_config(profile: SimProfile, tokenizer):
    """The few config fields the engine reads, for a model that does not exist."""
    return SimpleNamespace(vocab_size=len(tokenizer), max_position_embeddings=profile.max_model_len,
                           eos_token_id=tokenizer.eos_token_id, architectures=["Simulated"])


class SimulatedEngineFault(RuntimeError):
    """Raised by the sim engine loop when its profile's `fail_after_steps` is reached: a loop that dies."""


class SimModelRunner:
    """Drop-in for ModelRunner: same KV sizing and execute() contract, no weights."""

    def __init__(self, config: EngineConfig, profile: SimProfile, tokenizer, max_model_len: int) -> None:
        import torch

        self.config = config
        self.profile = profile
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.device = torch.device("cpu")
        self.dtype = torch.bfloat16
        self.kv_window = None  # every block kept, as a full-attention model
        self.vocab_size = len(tokenizer)
        self.num_blocks = 0
        self.busy_seconds = 0.0  # modelled time, for checks and metrics
        self.num_steps = 0

    def determine_num_blocks(self) -> int:
        if self.config.num_gpu_blocks_override is not None:
            num_blocks = self.config.num_gpu_blocks_override
        else:
            memory = self.config.kv_cache_memory or self.profile.kv_cache_memory
            num_blocks = memory // (self.kv_bytes_per_token * self.block_size)
        return num_blocks

    @property
    def kv_bytes_per_token(self) -> int:
        """The profile's bf16 bytes a token, scaled as ModelRunner.bytes_per_block scales for --kv-cache-dtype."""
        spec = kv_quant_spec(self.config.kv_cache_dtype)
        bf16_elem, head_dim = 2, self.profile.head_dim
        per_head = kv_bytes_per_token_head(head_dim, bf16_elem, spec)
        return self.profile.kv_bytes_per_token * per_head // (head_dim * bf16_elem)

    @property
    def bytes_per_block(self) -> int:
        return self.kv_bytes_per_token * self.block_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks

    def _rng(self, request: Request) -> random.Random:
        rng = request.generator
        if rng is None:
            seed = request.sampling_params.seed
            if seed is None:  # same prompt, same text: unseeded requests are deterministic too
                seed = xxhash.xxh64_intdigest(repr((request.prompt_token_ids, request.sample_index)).encode())
            if request.lora_request is not None:  # each adapter writes its own text
                seed = xxhash.xxh64_intdigest(repr((seed, request.lora_request.lora_int_id)).encode())
            rng = request.generator = random.Random(seed)
        return rng

    def execute(self, out: SchedulerOutput):
        started = time.monotonic()
        self.num_steps += 1
        if self.profile.fail_after_steps and self.num_steps >= self.profile.fail_after_steps:
            raise SimulatedEngineFault(f"simulated engine fault at step {self.num_steps} (sim profile "
                                       f"fail_after_steps={self.profile.fail_after_steps})")
        if self.profile.hang_after_steps and self.num_steps >= self.profile.hang_after_steps:
            log.warning("simulated engine hang at step %d (sim profile hang_after_steps=%d)", self.num_steps,
                        self.profile.hang_after_steps)
            threading.Event().wait()  # never set: this step never ends (the GIL is released, as CUDA waits do)
        prefill_tokens = decode_seqs = context_tokens = 0
        constrained = [s.request for s in out.scheduled if s.samples and s.request.grammar is not None]
        rows, bitmask = fill_bitmasks(constrained, (self.vocab_size + 31) // 32)
        allowed = {r.request_id: allowed_token_ids(bitmask[j], self.vocab_size) for j, r in zip(rows, constrained)}
        tokens: dict[str, int] = {}
        logprobs: dict[str, dict[int, Logprob]] = {}
        for s in out.scheduled:
            r = s.request
            context_tokens += s.start + s.num_new_tokens
            if s.num_new_tokens == 1 and s.start > 0:
                decode_seqs += 1
            else:
                prefill_tokens += s.num_new_tokens
            if s.samples:
                rng = self._rng(r)
                token = self._draw(rng, allowed.get(r.request_id), r.sampling_params.eos_token_ids)
                tokens[r.request_id] = token
                if r.sampling_params.logprobs is not None:
                    entry = {token: Logprob(-0.05, 1)}
                    for rank in range(2, r.sampling_params.logprobs + 2):
                        entry.setdefault(rng.choice(_PRINTABLE), Logprob(-1.0 * rank, rank))
                    logprobs[r.request_id] = entry
        seconds = self.profile.step_seconds(prefill_tokens, decode_seqs, context_tokens)
        self.busy_seconds += seconds
        remaining = seconds - (time.monotonic() - started)
        if remaining > 0:
            time.sleep(remaining)
        return tokens, logprobs

    def launch(self, out: SchedulerOutput, running=None) -> "DoneStep":
        """The runner protocol's queued step: the sim runs it at once (its tokens never come from a step's)."""
        step = DoneStep(self.execute(out))
        step.prompt_logprobs = self._prompt_logprobs(out)
        return step

    @staticmethod
    def _prompt_logprobs(out: SchedulerOutput) -> dict[str, tuple[int, list[dict]]]:
        """Prompt logprobs in the shape the torch runner gives (no logits: each prompt token scores -1, rank 1, with
        made-up runners-up), so the API's shape is the same on the sim."""
        plan = plan_rows(out.scheduled)
        if plan is None:
            return {}
        entries = []
        for target, k in zip(plan.targets, plan.counts):
            entry = {target: Logprob(-1.0, 1)}
            for rank in range(2, k + 2):
                entry.setdefault(_PRINTABLE[(target + rank) % len(_PRINTABLE)], Logprob(-1.0 * rank, rank))
            entries.append(entry)
        computed, at = {}, 0
        for request_id, first, count in plan.spans:
            computed[request_id] = (first, entries[at:at + count])
            at += count
        return computed

    @staticmethod
    def _draw(rng: random.Random, allowed: list[int] | None, eos_token_ids) -> int:
        """A printable token, or one the grammar allows (printable ones and EOS first, so text reads as text
        and an output that may end does end now and then)."""
        if allowed is None:
            return rng.choice(_PRINTABLE)
        preferred = [t for t in allowed if 32 <= t < 127 or t in eos_token_ids]
        return rng.choice(preferred or allowed)

    def load_lora(self, lora: LoRARequest) -> AdapterConfig:
        """An adapter for the sim: its config read and its rank checked (there are no weights to apply)."""
        return read_adapter_config(lora.lora_path, self.config.max_lora_rank)

    def set_lora_slot(self, slot: int, adapter: AdapterConfig | None) -> None:
        """Nothing to copy: the sim's cost model has no adapter term."""

    def close(self) -> None:
        """Nothing to release (the torch runner's counterpart stops its mask thread)."""


class DoneStep:
    """A step that has run: result() without waiting."""

    def __init__(self, result: tuple[dict[str, int], dict]) -> None:
        self._result = result
        self.prompt_logprobs: dict = {}  # as PendingStep's

    def result(self) -> tuple[dict[str, int], dict]:
        return self._result
