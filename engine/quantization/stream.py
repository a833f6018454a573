"""The weight stream's quantization step: the loader's (name, tensor) pairs in, the model's dense (name, tensor)
pairs out, so the model's load_weights is the same for every checkpoint.

Each quantized linear's tensors (its scheme's: weight_packed + weight_scale + ..., qweight + qzeros + scales, ...)
are grouped by module: the names of the whole checkpoint are known up front (the safetensors headers), so a module
is dequantized the moment its last tensor arrives, whatever the order and file, and yielded as `<module>.weight` in
the model dtype; every other tensor passes through as it came. What waits for a module's other tensors is the
loader's zero-copy views of the mapped files (no copy), and one dense weight exists at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from kvgate.common.errors import ModelLoadError
from kvgate.engine.quantization.config import QuantConfig
from kvgate.engine.quantization.scheme import LinearScheme


@dataclass
class QuantSummary:
    """What a load read: the method and schemes, how many linear weights were quantized and how many dense."""

    method: str
    quantized: int = 0
    dense: int = 0
    schemes: set[str] = field(default_factory=set)  # each scheme's bits, group or block size and strategy
    # the GPU path (linear.py): quantized linear weights kept quantized on the kernels, and those dequantized at
    # load anyway, by reason; None: every quantized linear dequantized at load (the CPU and tensor-parallel path)
    kernels: int | None = None
    dequantized: dict[str, int] = field(default_factory=dict)
    # on CUDA without the kernel path: why (tensor parallelism, LoRA, the SDPA backend), for the start line
    dense_path: str | None = None

    def line(self) -> str:
        """E.g. "gptq (int4 group 128, symmetric): 196 linear weights quantized, 1 dense"; on the GPU path
        followed by "; 168 on the quantized kernels, 28 dequantized at load (28 MoE experts)"."""
        line = (f"{self.method} ({'; '.join(sorted(self.schemes)) or 'no quantized tensor'}): {self.quantized} "
                f"linear weights quantized, {self.dense} dense")
        if self.kernels is None:
            return line
        reasons = ", ".join(f"{n} {why}" for why, n in sorted(self.dequantized.items()))
        return (line + f"; {self.kernels} on the quantized kernels, {self.quantized - self.kernels} dequantized at "
                f"load" + (f" ({reasons})" if reasons else ""))


@dataclass(frozen=True)
class _Module:
    scheme: LinearScheme
    members: tuple[str, ...]  # suffixes present in the checkpoint


def plan_modules(names: Iterable[str], qconfig: QuantConfig) -> dict[str, _Module]:
    """prefix -> its scheme and tensors, for every module with quantized tensors among `names` (all the
    checkpoint's): a module is quantized when it has a tensor a scheme requires beyond `weight`. A required tensor
    missing, or one the scheme does not read, is a ModelLoadError naming it."""
    names = set(names)
    schemes = qconfig.schemes
    markers = {s for scheme in schemes for s in scheme.required if s != "weight"}
    known = {"weight"} | {s for scheme in schemes
                          for s in scheme.required + scheme.optional + scheme.dropped + scheme.refused}
    prefixes = {name.rsplit(".", 1)[0] for name in names if "." in name and name.rsplit(".", 1)[1] in markers}
    plan = {}
    for prefix in sorted(prefixes):
        present = {s for s in known if f"{prefix}.{s}" in names}
        candidates = qconfig.schemes_for(prefix)
        # the first scheme whose tensors are all there (FP8: weight_scale_inv, or vLLM's weight_scale)
        scheme = next((s for s in candidates if set(s.required) <= present), candidates[0])
        for suffix in scheme.required:
            if suffix not in present:
                raise ModelLoadError(f"quantized module {prefix!r} ({qconfig.method}) lacks tensor "
                                     f"{prefix}.{suffix}")
        unread = sorted(present - set(scheme.required + scheme.optional + scheme.dropped))
        if unread:
            raise ModelLoadError(f"checkpoint tensor {prefix}.{unread[0]} is not read by the {qconfig.method} "
                                 f"scheme of {prefix!r} ({scheme.describe()})")
        plan[prefix] = _Module(scheme, tuple(sorted(present)))
    return plan


def dequantize_weights(stream: Iterable[tuple[str, torch.Tensor]], qconfig: QuantConfig, dtype: torch.dtype,
                       names: Iterable[str], release: Callable[[str], None] | None = None,
                       summary: QuantSummary | None = None,
                       routes: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """`stream` with each quantized linear's tensors replaced by its dense `<module>.weight` in `dtype`. names:
    every name the stream yields (the checkpoint's), to plan the modules up front. release(name), when given, is
    called for each quantized tensor once its module is dequantized (the loader drops its mapped pages). On the
    meta device (the checkpoint's shapes alone) the dense weight is an empty meta tensor of its shape. summary:
    filled with the counts as the stream is consumed. routes: linear.route_kernel_linears' (prefix ->
    (QuantizedLinear, shard index)): a routed module's tensors go to its shard in the kernels' layout, and nothing is
    yielded for it."""
    plan = plan_modules(names, qconfig)
    owner = {f"{prefix}.{suffix}": (prefix, suffix) for prefix, module in plan.items() for suffix in module.members}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in stream:
        if name not in owner:
            if summary is not None and name.endswith(".weight") and tensor.dim() == 2 and "embed_tokens" not in name:
                summary.dense += 1
            yield name, tensor
            continue
        prefix, suffix = owner[name]
        module = plan[prefix]
        tensors = pending.setdefault(prefix, {})
        tensors[suffix] = tensor
        if len(tensors) < len(module.members):
            continue
        del pending[prefix]
        scheme = module.scheme
        if routes is not None and prefix in routes:
            qlinear, index = routes[prefix]
            reason = qlinear.set_shard(index, scheme, prefix, tensors)
            if release is not None:
                for s in module.members:
                    release(f"{prefix}.{s}")
            del tensors
            if summary is not None:
                summary.quantized += 1
                summary.schemes.add(scheme.describe())
                if reason is None:
                    summary.kernels = (summary.kernels or 0) + 1
                else:
                    summary.dequantized[reason] = summary.dequantized.get(reason, 0) + 1
            continue
        if any(t.device.type == "meta" for s, t in tensors.items() if s != "weight_shape"):
            dense = torch.empty(scheme.dense_shape(prefix, tensors), dtype=dtype, device="meta")
        else:
            dense = scheme.dequantize(prefix, tensors, dtype)
        if release is not None:
            for s in module.members:
                release(f"{prefix}.{s}")
        del tensors
        if summary is not None:
            summary.quantized += 1
            summary.schemes.add(scheme.describe())
        yield f"{prefix}.weight", dense
    if pending:
        prefix = next(iter(pending))
        lacking = sorted(set(plan[prefix].members) - set(pending[prefix]))
        raise ModelLoadError(f"quantized module {prefix!r}: tensor {prefix}.{lacking[0]} never arrived"
                             + (f" (and {len(pending) - 1} more modules incomplete)" if len(pending) > 1 else ""))
