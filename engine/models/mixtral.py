"""Mixtral: the Mistral stack with every MLP a sparse MoE block: softmax router, top-`num_experts_per_tok` of
`num_local_experts` experts, the top-k weights always renormalised (kept in fp32). Checkpoint names
`block_sparse_moe.experts.{i}.w1/w3/w2` are the experts' gate/up/down projections."""

from torch import nn

from kvgate.engine.models.mistral import MistralForCausalLM
from kvgate.engine.models.moe import FusedMoE, SparseMoeBlock


class MixtralForCausalLM(MistralForCausalLM):
    checkpoint_renames = ((".block_sparse_moe.", ".mlp."),)
    expert_params = {"w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", None)}

    @staticmethod
    def make_mlp(config, layer_idx: int) -> nn.Module:
        experts = FusedMoE(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                           config.intermediate_size, renormalize=True, weights_in_fp32=True,
                           hidden_act=config.hidden_act)
        return SparseMoeBlock(config.hidden_size, experts)
