"""How far a decode step is from the memory-bandwidth bound: `kvgate bench engine`'s step accounting.

A decode step must read every weight once (of a mixture-of-experts layer, the experts its batch is routed to:
WeightBytes) and the K/V of every token in its sequences' contexts once; at the
device's copy bandwidth (measured in the same run) that many bytes take the bound time. The step timer wraps an
engine's step and its runner: for each step that queues a decode-only batch it records the wall time of the whole
step (scheduling and output processing included: what a user waits for), the time spent in the runner (inputs,
launches, sampling, the wait for sampled tokens) and of that the wait alone, against the bound of that batch's
bytes. The step less its wait is the host's own work: with async scheduling it must stay under the device's time
for the step to be device-bound.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written (the median of repeats)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2 * nbytes / statistics.median(times)


@dataclass(frozen=True)
class WeightBytes:
    """The weight bytes a decode step reads: every dense parameter, and of each MoE layer's stacked experts those
    its batch is routed to, counted as the expected number of distinct experts when each token's top_k of E experts
    are drawn uniformly, E * (1 - (1 - top_k / E) ** batch): top_k experts for one sequence, all E for a large batch."""

    dense: int
    experts: tuple[tuple[int, int, int], ...] = ()  # per MoE layer: (experts, top_k, bytes of one expert)

    @property
    def total(self) -> int:
        return self.dense + sum(e * size for e, _, size in self.experts)

    def read_by(self, batch: int) -> int:
        return self.dense + round(sum(e * (1 - (1 - k / e) ** batch) * size for e, k, size in self.experts))


def weight_bytes(model: torch.nn.Module) -> WeightBytes:
    """The model's parameter bytes, each shared tensor once (a tied LM head reads the embedding table), with the
    FusedMoE layers' stacked expert weights apart; a QuantizedLinear's (the GPU path of a quantized checkpoint)
    quantized weights, scales and zero points at their held size."""
    from kvgate.engine.models.moe import FusedMoE
    from kvgate.engine.quantization.linear import QuantizedLinear

    seen, experts = set(), []
    for module in model.modules():
        if isinstance(module, FusedMoE):
            size = sum(p.numel() * p.element_size() for p in (module.w13_weight, module.w2_weight))
            experts.append((module.num_experts, module.top_k, size // module.num_experts))
            seen.update(p.data_ptr() for p in (module.w13_weight, module.w2_weight))
    total = 0
    held = [b for m in model.modules() if isinstance(m, QuantizedLinear) for b in m.buffers(recurse=False)]
    for p in [*model.parameters(), *held]:
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return WeightBytes(total, tuple(experts))


def stored_weight_bytes(model: torch.nn.Module, model_path) -> WeightBytes:
    """The checkpoint's weight bytes as its safetensors files store them (a quantized checkpoint's packed weights,
    scales and zero points at their stored size; from the headers alone), with each FusedMoE layer's experts
    apart as in weight_bytes: what a decode step would read if the engine kept the weights as stored. The engine
    dequantizes quantized linears at load (engine/quantization), so weight_bytes is what it reads."""
    from kvgate.engine.loader import open_safetensors
    from kvgate.engine.models.moe import FusedMoE

    layers = {name: module for name, module in model.named_modules() if isinstance(module, FusedMoE)}
    per_layer, dense = dict.fromkeys(layers, 0), 0
    for f in open_safetensors(model_path, map_data=False):
        for name, (_, _, begin, end) in f.entries.items():
            for piece, ours in getattr(model, "checkpoint_renames", ()):
                name = name.replace(piece, ours)
            layer = next((p for p in layers if name.startswith(p + ".")), None)
            if layer is None:
                dense += end - begin
            else:
                per_layer[layer] += end - begin
    return WeightBytes(dense, tuple((m.num_experts, m.top_k, per_layer[p] // m.num_experts)
                                    for p, m in layers.items()))


def kv_bytes_per_token(runner) -> int:
    return runner.bytes_per_block // runner.block_size


@dataclass
class StepTimer:
    """Wraps engine.step and engine.runner.launch (and the wait for a launched step's tokens); see the module doc.
    With async scheduling a step call queues one batch and waits for the one before: in a steady run its wall time
    is the time per step all the same."""

    engine: object
    bandwidth: float  # bytes/s
    weights: WeightBytes
    kv_per_token: int
    # the checkpoint's weights as stored, where a quantized checkpoint stores fewer bytes than the engine holds:
    # each step's bound at that size too (what kernels reading the quantized weights would be bound by)
    stored_weights: WeightBytes | None = None
    steps: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._step, self._launch = self.engine.step, self.engine.runner.launch
        self._pending: dict | None = None
        self._runner_s = 0.0
        self.engine.step = self._timed_step
        self.engine.runner.launch = self._timed_launch

    def close(self) -> None:
        self.engine.step, self.engine.runner.launch = self._step, self._launch

    def _timed_launch(self, out, *args, **kwargs):
        t0 = time.perf_counter()
        launched = self._launch(out, *args, **kwargs)
        self._runner_s += time.perf_counter() - t0
        if out.scheduled and all(s.num_new_tokens == 1 for s in out.scheduled):
            context = sum(s.start + 1 for s in out.scheduled)
            batch, kv = len(out.scheduled), context * self.kv_per_token
            self._pending = {"batch": batch, "context_tokens": context, "bytes": self.weights.read_by(batch) + kv}
            if self.stored_weights is not None:
                self._pending["stored_bytes"] = self.stored_weights.read_by(batch) + kv
        result = launched.result

        def timed_result():
            t1 = time.perf_counter()
            try:
                return result()
            finally:
                waited = time.perf_counter() - t1
                self._runner_s += waited
                self._wait_s += waited

        launched.result = timed_result
        return launched

    def _timed_step(self, *args, **kwargs):
        self._pending, self._runner_s, self._wait_s = None, 0.0, 0.0
        t0 = time.perf_counter()
        outputs = self._step(*args, **kwargs)
        if self._pending is not None:
            self._pending["step_s"] = time.perf_counter() - t0
            self._pending["execute_s"] = self._runner_s
            self._pending["wait_s"] = self._wait_s
            self.steps.append(self._pending)
        return outputs

    def summary(self) -> dict:
        """Totals over the decode-only steps: bound time / measured time is the fraction of the bound reached."""
        if not self.steps:
            return {"decode_steps": 0}
        bound = sum(s["bytes"] for s in self.steps) / self.bandwidth
        step_s = sum(s["step_s"] for s in self.steps)
        execute_s = sum(s["execute_s"] for s in self.steps)
        wait_s = sum(s["wait_s"] for s in self.steps)
        full = max(s["batch"] for s in self.steps)
        at_full = [s for s in self.steps if s["batch"] == full]
        return {
            "decode_steps": len(self.steps),
            "mean_batch": sum(s["batch"] for s in self.steps) / len(self.steps),
            "mean_step_ms": 1e3 * step_s / len(self.steps),
            "mean_execute_ms": 1e3 * execute_s / len(self.steps),
            # The host's own work in a step (scheduling, inputs, launches, outputs) and its wait for sampled ids:
            # a step with async scheduling is device-bound when it waits, host-bound when it does not.
            "mean_host_ms": 1e3 * (step_s - wait_s) / len(self.steps),
            "mean_wait_ms": 1e3 * wait_s / len(self.steps),
            "mean_bound_ms": 1e3 * bound / len(self.steps),
            "fraction_of_bound": bound / step_s,
            "fraction_of_bound_execute": bound / execute_s,
            "full_batch": full,
            "full_batch_steps": len(at_full),
            "full_batch_median_step_ms": 1e3 * statistics.median(s["step_s"] for s in at_full),
            "full_batch_median_bound_ms": 1e3 * statistics.median(s["bytes"] for s in at_full) / self.bandwidth,
            **({"mean_bound_stored_weights_ms": 1e3 * sum(s["stored_bytes"] for s in self.steps) / self.bandwidth
                / len(self.steps)} if self.stored_weights is not None else {}),
            "decode_seconds": step_s,
        }
