"""The GPU path of a quantized checkpoint (tensor_parallel_size 1): its linears stay quantized in memory and run
through engine/triton_quant.py's GEMMs.

After the model is built, route_kernel_linears replaces each nn.Linear whose checkpoint weights are all quantized
(for a fused projection: every shard, qkv_proj's q|k|v or gate_up_proj's gate|up) by a QuantizedLinear, and gives
the weight stream (stream.dequantize_weights) the route of each checkpoint module to it: the module's tensors go to
its shard of the QuantizedLinear in the kernels' layout (kernel_layout.py) instead of a dense weight into the model's
load_weights. A QuantizedLinear has no `weight` parameter, so load_weights expects none for it (and still writes its
bias, still refuses a tensor the model does not have); the stream checks that every shard arrived.

Left dense (dequantized at load, counted by reason in the QuantSummary): MoE experts (FusedMoE's stacked weights),
a fused projection with a dense shard, a tied LM head, and a shard whose tensors have no exact kernel layout
(NoKernelLayout) — that one shard only: the QuantizedLinear runs it with F.linear beside its kernel parts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvgate.common.errors import ModelLoadError
from kvgate.engine.quantization.kernel_layout import KernelWeight, NoKernelLayout, merge_rows

# Tests only: take the kernel path on the CPU too (the kernels under Triton's interpreter, TRITON_INTERPRET=1 set
# before triton's first import). No engine setting reaches it.
FORCE_ON_CPU = False

# shard ids of the model's fused projections (engine/models/llama.py's STACKED_PARAMS), in row order
FUSED_SHARDS = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": (0, 1)}


def kernel_path_applies(device: torch.device, tp_size: int, fused_kernels: bool, lora: bool) -> bool:
    """Whether a quantized checkpoint keeps its linears quantized: CUDA with Triton's kernels (use_fused_kernels),
    no tensor parallelism (its sharded linears keep the dense path) and no LoRA (it wraps dense weights)."""
    if tp_size != 1 or lora:
        return False
    if device.type == "cuda":
        return fused_kernels
    return FORCE_ON_CPU and device.type == "cpu"


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W's row blocks (the fused projection's shards) in the kernels' layout: adjacent shards of
    one layout merged into one GEMM, a shard without a kernel layout dense. Built empty, then filled by set_shard
    for every shard (the weight stream), at which point its buffers are on `device`."""

    def __init__(self, in_features: int, out_features: int, shards: list[tuple[object, slice]],
                 bias: nn.Parameter | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.shards = shards  # (shard id, its output rows) in row order
        self.bias = bias
        self.dtype, self.device = dtype, device
        self._arrived: list[KernelWeight | torch.Tensor | None] = [None] * len(shards)
        self.parts: list[tuple[str, dict]] = []  # ("int" | "fp8" | "dense", its settings and buffer names)
        self._views: list | None = None  # kernel_weights() of the current buffers (reset when they are moved)

    @property
    def complete(self) -> bool:
        return bool(self.parts)

    def set_shard(self, index: int, scheme, prefix: str, tensors: dict[str, torch.Tensor]) -> str | None:
        """Shard `index`'s checkpoint tensors in: None when it runs on the kernels, else why it is dense."""
        shard, rows = self.shards[index]
        expected = (rows.stop - rows.start, self.in_features)
        shape = tuple(scheme.dense_shape(prefix, tensors))
        if shape != expected:
            raise ModelLoadError(f"checkpoint tensor {prefix}.weight has shape {shape}, expected {expected}")
        reason = None
        try:
            part = scheme.to_kernel_layout(prefix, tensors)
        except NoKernelLayout as exc:
            part, reason = scheme.dequantize(prefix, tensors, self.dtype), str(exc)
        self._arrived[index] = part
        if all(p is not None for p in self._arrived):
            self._build()
        return reason

    def _build(self) -> None:
        merged: list[KernelWeight | torch.Tensor] = []
        for part in self._arrived:
            last = merged[-1] if merged else None
            if isinstance(part, torch.Tensor) and isinstance(last, torch.Tensor):
                merged[-1] = torch.cat((last, part))
            elif isinstance(part, KernelWeight) and isinstance(last, KernelWeight) and \
                    (both := merge_rows(last, part)) is not None:
                merged[-1] = both
            else:
                merged.append(part)
        self._arrived = []
        for i, part in enumerate(merged):
            if isinstance(part, torch.Tensor):
                self.register_buffer(f"dense{i}", part.to(self.device, copy=True))
                self.parts.append(("dense", {"weight": f"dense{i}"}))
                continue
            names = {}
            for key, tensor in part.tensors().items():
                names[key] = f"{key}{i}"
                self.register_buffer(names[key], tensor.to(self.device, copy=True))
            self.parts.append((part.kind, {**names, "bits": part.bits, "group_size": part.group_size,
                                           "block": part.block}))

    def _apply(self, fn, *args, **kwargs):
        self._views = None  # the buffers are replaced (.to(), .half(), ...)
        return super()._apply(fn, *args, **kwargs)

    def kernel_weights(self) -> list[KernelWeight | torch.Tensor]:
        """The parts as KernelWeights (dense ones as their weight), over the current buffers."""
        if self._views is not None:
            return self._views
        out = []
        for kind, spec in self.parts:
            get = lambda key: getattr(self, spec[key]) if key in spec else None  # noqa: E731
            if kind == "dense":
                out.append(get("weight"))
                continue
            weight = get("weight")
            out.append(KernelWeight(kind, weight, get("scales"), get("zeros"), spec["bits"], spec["group_size"],
                                    spec["block"], (weight.shape[0], self.in_features), get("perm")))
        if self.parts:
            self._views = out
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kvgate.engine.triton_quant import fp8_weight_gemm, int_weight_gemm

        flat = x.reshape(-1, self.in_features)
        outs = []
        for part in self.kernel_weights():
            if isinstance(part, torch.Tensor):
                outs.append(F.linear(flat, part))
                continue
            inputs = flat if part.perm is None else flat.index_select(1, part.perm)
            if part.kind == "int":
                outs.append(int_weight_gemm(inputs, part.weight, part.scales, part.zeros, part.bits,
                                            part.group_size))
            else:
                outs.append(fp8_weight_gemm(inputs, part.weight, part.scales, part.block))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"parts={[kind for kind, _ in self.parts]}, bias={self.bias is not None}")


def route_kernel_linears(model: nn.Module, plan: dict, dtype: torch.dtype,
                         device: torch.device) -> tuple[dict[str, tuple[QuantizedLinear, int]], dict[str, int]]:
    """Replace the model's fully quantized linears by QuantizedLinears, whose quantized tensors will live on
    `device` (a shard without a kernel layout dense in `dtype`). The model may still be on the meta device (the
    loader routes before allocating, so a replaced linear's dense weight is never allocated). plan:
    stream.plan_modules' (checkpoint module prefix -> scheme). Returns (prefix -> (its QuantizedLinear, shard
    index), reason -> checkpoint modules left to the dense path for it)."""
    from kvgate.engine.models.llama import STACKED_PARAMS, LlamaForCausalLM

    dense: dict[str, int] = {}

    def leave(reason: str, count: int = 1) -> None:
        dense[reason] = dense.get(reason, 0) + count

    if not isinstance(model, LlamaForCausalLM):
        leave(f"{type(model).__name__} has no quantized-kernel routing", len(plan))
        return {}, dense
    members: dict[str, list[tuple[object, str]]] = {}
    for prefix in plan:
        name, shard = prefix, None
        for piece, ours in model.checkpoint_renames:
            name = name.replace(piece, ours)
        for fused, piece, shard_id in STACKED_PARAMS:
            if name.endswith("." + piece):
                name, shard = name[:-len(piece)] + fused, shard_id
                break
        try:
            module = model.get_submodule(name)
        except AttributeError:
            module = None
        if type(module) is not nn.Linear:
            leave("MoE experts" if ".experts." in name else "not a linear of the model")
            continue
        members.setdefault(name, []).append((shard, prefix))
    routes = {}
    for name, found in members.items():
        module = model.get_submodule(name)
        order = FUSED_SHARDS.get(name.rsplit(".", 1)[-1], (None,))
        by_shard = dict(found)
        if set(by_shard) != set(order) or len(found) != len(order):
            leave("a fused projection with dense shards", len(found))
            continue
        if name == "lm_head" and getattr(model, "tie_word_embeddings", False):
            leave("a tied LM head", len(found))
            continue
        weight = module.weight
        shards = [(s, model._shard_slice(weight, s) if s is not None else slice(0, weight.shape[0])) for s in order]
        qlinear = QuantizedLinear(module.in_features, module.out_features, shards, module.bias, dtype, device)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, qlinear)
        routes.update({by_shard[s]: (qlinear, i) for i, s in enumerate(order)})
    return routes, dense


def check_routes_complete(routes: dict[str, tuple[QuantizedLinear, int]]) -> None:
    for prefix, (qlinear, _) in routes.items():
        if not qlinear.complete:
            raise ModelLoadError(f"quantized module {prefix!r}: its fused projection's shards never all arrived")
