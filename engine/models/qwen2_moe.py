"""Qwen2-MoE: Qwen2's attention (qkv bias) with sparse MoE MLPs that add a shared expert. A layer is sparse unless it
is listed in `mlp_only_layers` or `(layer index + 1)` is not a multiple of `decoder_sparse_step` (as Qwen3-MoE);
sparse layers route each token to `num_experts_per_tok` of `num_experts` experts of width `moe_intermediate_size`
(the top-k weights renormalised when `norm_topk_prob`), and add a shared SwiGLU expert of width
`shared_expert_intermediate_size`, scaled per token by sigmoid(shared_expert_gate(x))."""

import torch
from torch import nn

from kvgate.engine.models.layers import GatedMLP
from kvgate.engine.models.llama import dense_mlp
from kvgate.engine.models.moe import FusedMoE, SparseMoeBlock
from kvgate.engine.models.qwen2 import Qwen2ForCausalLM
from kvgate.engine.models.qwen3_moe import is_sparse_layer, routed_experts


class SharedExpertMoeBlock(SparseMoeBlock):
    """SparseMoeBlock (router `gate`, routed `experts`) plus `shared_expert`, which every token runs, gated by
    sigmoid(`shared_expert_gate`(x)) (one logit per token). Summed as HF's Qwen2MoeSparseMoeBlock: routed + gated
    shared."""

    def __init__(self, hidden_size: int, experts: FusedMoE, shared_intermediate_size: int, hidden_act: str) -> None:
        super().__init__(hidden_size, experts)
        self.shared_expert = GatedMLP(hidden_size, shared_intermediate_size, hidden_act)
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return super().forward(x) + shared


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    expert_params = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", None)}

    def __init__(self, config, max_positions: int) -> None:
        self.qkv_bias = bool(getattr(config, "qkv_bias", True))  # before Module.__init__: read by the decoder stack
        super().__init__(config, max_positions)

    @staticmethod
    def make_mlp(config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return dense_mlp(config, layer_idx)
        return SharedExpertMoeBlock(config.hidden_size, routed_experts(config),
                                    config.shared_expert_intermediate_size, config.hidden_act)
