"""Mixture-of-experts MLP: a router picks top-k experts per token; each expert is a SwiGLU MLP.

The experts' weights are stacked, as vLLM's FusedMoE holds them: w13_weight [E, 2I, H] (gate rows, then up rows)
and w2_weight [E, H, I]. The checkpoint's per-expert tensors are written into their expert's slice by the model's
load_weights (llama.py's expert_params). Numerics follow HF transformers' Qwen3Moe/Mixtral sparse blocks: softmax
over the router logits in fp32, top-k, optional renormalisation of the k weights, and each token's expert outputs
summed in ascending expert order.

Under tensor parallelism each rank holds every expert's slice of the intermediate features (w13's gate and up rows
and w2's columns of its slice, as vLLM shards them) and the experts' partial outputs are all-reduced.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvgate.engine.distributed import group as tp_group
from kvgate.engine.models.parallel_linear import split_evenly


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   weights_in_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k], expert ids [T, k]) of each token: fp32 softmax over all experts, top-k, and (renormalize)
    the k weights divided by their sum. weights_in_fp32 False casts them back to the logits' dtype (Qwen3-MoE
    does; Mixtral keeps fp32)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not weights_in_fp32:
        weights = weights.to(router_logits.dtype)
    return weights, ids


def torch_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """Each token's weighted sum of its experts' SwiGLU outputs. x: [T, H]; w13: [E, 2I, H]; w2: [E, H, I];
    topk_weights/topk_ids: [T, k]. The (token, slot) pairs are sorted by expert so that each expert runs once over
    a gathered batch of its tokens; the results are index_add-ed back, experts in ascending order (HF's order)."""
    num_tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order]
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    inter = w2.shape[-1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = tokens[start:start + count]
        gate, up = F.linear(x[rows], w13[expert]).split(inter, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, rows, (y * weights[start:start + count, None]).to(out.dtype))
        start += count
    return out


ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class FusedMoE(nn.Module):
    """The stacked experts of one layer: routing from given router logits, then the experts' computation.

    forward dispatches the computation to `self.experts_fn` (torch_experts, the CPU/any-device path); a fused GPU
    kernel with torch_experts' signature can be assigned there instead."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, weights_in_fp32: bool, hidden_act: str = "silu") -> None:
        super().__init__()
        if hidden_act not in ("silu", "swish"):
            raise NotImplementedError(f"MoE expert activation {hidden_act!r} is not supported")
        self.num_experts, self.top_k = num_experts, top_k
        self.tp = tp_group.current()
        intermediate_size = split_evenly(intermediate_size, self.tp, "the experts' intermediate size")
        self.intermediate_size = intermediate_size  # this rank's
        self.renormalize, self.weights_in_fp32 = renormalize, weights_in_fp32
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.experts_fn: ExpertsFn = torch_experts

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(router_logits, self.top_k, self.renormalize, self.weights_in_fp32)
        out = self.experts_fn(x, self.w13_weight, self.w2_weight, weights, ids)
        return self.tp.all_reduce(out) if self.tp.is_parallel else out

    def shard_weight(self, param: str, dest: torch.Tensor, tensor: torch.Tensor, shard) -> tuple:
        """This rank's slice of one expert's checkpoint tensor: its gate or up rows (w13), its columns (w2)."""
        if not self.tp.is_parallel:
            return dest, tensor
        start, size = self.tp.rank * self.intermediate_size, self.intermediate_size
        return dest, tensor.narrow(1 if param == "w2_weight" else 0, start, size)


class SparseMoeBlock(nn.Module):
    """The MLP of a sparse decoder layer: `gate` (the router, no bias) and `experts` (FusedMoE)."""

    def __init__(self, hidden_size: int, experts: FusedMoE) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden_size, experts.num_experts, bias=False)
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.gate(x))
