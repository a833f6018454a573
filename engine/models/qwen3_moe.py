"""Qwen3-MoE: Qwen3's attention (q/k norm) with sparse MoE MLPs. A layer is sparse unless it is listed in
`mlp_only_layers` or `(layer index + 1)` is not a multiple of `decoder_sparse_step`; sparse layers route each
token to `num_experts_per_tok` of `num_experts` experts of width `moe_intermediate_size`, the top-k weights
renormalised when `norm_topk_prob`."""

from torch import nn

from kvgate.engine.models.llama import dense_mlp
from kvgate.engine.models.moe import FusedMoE, SparseMoeBlock
from kvgate.engine.models.qwen3 import Qwen3ForCausalLM


def is_sparse_layer(config, layer_idx: int) -> bool:
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    expert_params = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", None)}

    @staticmethod
    def make_mlp(config, layer_idx: int) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return dense_mlp(config, layer_idx)
        return SparseMoeBlock(config.hidden_size, routed_experts(config))


def routed_experts(config) -> FusedMoE:
    """A Qwen MoE layer's routed experts: top-k of the fp32 softmax, renormalised when norm_topk_prob, the weights
    cast back to the model's dtype."""
    return FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                    config.moe_intermediate_size, renormalize=bool(config.norm_topk_prob),
                    weights_in_fp32=False, hidden_act=config.hidden_act)
