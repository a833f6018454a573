"""engine/models/moe.py against HF transformers' own sparse MoE blocks (Qwen3-MoE, Mixtral, Qwen2-MoE) in fp32: the
same routing (softmax, top-k, each family's normalisation) and the same weighted sum of the experts' outputs (plus
Qwen2-MoE's gated shared expert)."""

import pytest
import torch

from kvgate.engine.models.mixtral import MixtralForCausalLM
from kvgate.engine.models.moe import select_experts, torch_experts
from kvgate.engine.models.qwen2_moe import Qwen2MoeForCausalLM
from kvgate.engine.models.qwen3_moe import Qwen3MoeForCausalLM, is_sparse_layer
from tests.engine.tiny_models import make_config


def _hf_block(family: str, norm_topk_prob: bool = True):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    config = make_config(family)
    config._experts_implementation = "eager"  # HF's per-expert loop (the reference), not a grouped-matmul kernel
    if family == "qwen3_moe":
        config.norm_topk_prob = norm_topk_prob
        block, ours = Qwen3MoeSparseMoeBlock(config), Qwen3MoeForCausalLM.make_mlp(config, 1)
    elif family == "qwen2_moe":
        config.norm_topk_prob = norm_topk_prob
        block, ours = Qwen2MoeSparseMoeBlock(config), Qwen2MoeForCausalLM.make_mlp(config, 0)
    else:
        block, ours = MixtralSparseMoeBlock(config), MixtralForCausalLM.make_mlp(config, 0)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
        ours.gate.weight.copy_(block.gate.weight)
        ours.experts.w13_weight.copy_(block.experts.gate_up_proj)
        ours.experts.w2_weight.copy_(block.experts.down_proj)
        if family == "qwen2_moe":
            shared = block.shared_expert
            ours.shared_expert.gate_up_proj.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
            ours.shared_expert.down_proj.weight.copy_(shared.down_proj.weight)
            ours.shared_expert_gate.weight.copy_(block.shared_expert_gate.weight)
    return config, block.eval(), ours.eval()


@pytest.mark.parametrize("family,norm", [("qwen3_moe", True), ("qwen3_moe", False), ("mixtral", True),
                                         ("qwen2_moe", False), ("qwen2_moe", True)])
def test_sparse_block_matches_hf(family, norm):
    config, hf, ours = _hf_block(family, norm)
    x = torch.randn(1, 37, config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(x)
        got = ours(x[0])
    # fp32 round-off only: each expert's batch holds its tokens in another order than HF's
    torch.testing.assert_close(got, expected.reshape(got.shape), rtol=1e-5, atol=1e-5)


def test_routing_normalisation():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    w, ids = select_experts(logits, 2, renormalize=False, weights_in_fp32=False)
    probs = torch.softmax(logits, dim=-1)
    assert ids.tolist() == [[0, 1]] and torch.allclose(w, probs[:, :2])
    w, _ = select_experts(logits, 2, renormalize=True, weights_in_fp32=True)
    assert torch.allclose(w.sum(-1), torch.ones(1)) and w.dtype == torch.float32
    w, _ = select_experts(logits.bfloat16(), 2, renormalize=True, weights_in_fp32=False)
    assert w.dtype == torch.bfloat16


def test_experts_with_no_tokens_and_unused_experts():
    w13, w2 = torch.randn(4, 6, 5), torch.randn(4, 5, 3)
    assert torch_experts(torch.zeros(0, 5), w13, w2, torch.zeros(0, 2), torch.zeros(0, 2, dtype=torch.long)).shape == (0, 5)
    x = torch.randn(3, 5)
    out = torch_experts(x, w13, w2, torch.ones(3, 1), torch.full((3, 1), 2))  # every token to expert 2 alone
    gate, up = (x @ w13[2].T).split(3, dim=-1)
    torch.testing.assert_close(out, (torch.nn.functional.silu(gate) * up) @ w2[2].T)


def test_which_qwen3_moe_layers_are_sparse():
    config = make_config("qwen3_moe")
    assert [is_sparse_layer(config, i) for i in range(3)] == [False, True, True]  # mlp_only_layers=[0]
    config.mlp_only_layers, config.decoder_sparse_step = [], 2
    assert [is_sparse_layer(config, i) for i in range(4)] == [False, True, False, True]


def test_lora_on_a_moe_model_is_a_config_error(tiny_model_dir):
    from kvgate.common.errors import ConfigError
    from kvgate.engine import LLM

    folder, _ = tiny_model_dir("mixtral")
    with pytest.raises(ConfigError, match="LoRA is not supported for MixtralForCausalLM"):
        LLM(str(folder), max_model_len=64, enable_lora=True)


def test_roofline_counts_the_experts_a_batch_reads():
    """bench's decode bound: all dense weights, and per MoE layer top_k experts for one sequence, up to all of
    them for a large batch."""
    from kvgate.bench.engine_roofline import weight_bytes

    config = make_config("qwen3_moe")
    model = Qwen3MoeForCausalLM(config, 64)
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    expert = 3 * config.moe_intermediate_size * config.hidden_size * 4
    sparse_layers = 2
    weights = weight_bytes(model)
    assert weights.dense == total - sparse_layers * config.num_experts * expert
    assert weights.read_by(1) == weights.dense + sparse_layers * config.num_experts_per_tok * expert
    assert weights.read_by(1000) == total


def test_qwen2_moe_sliding_layers_among_full_ones_get_their_own_windows():
    config = make_config("qwen2_moe")
    assert [is_sparse_layer(config, i) for i in range(3)] == [True, True, False]  # mlp_only_layers=[2]
    config.use_sliding_window, config.sliding_window, config.max_window_layers = True, 8, 0
    config.layer_types = ["sliding_attention", "full_attention", "sliding_attention"]  # use_sliding_window's pattern
    model = Qwen2MoeForCausalLM(config, 64)
    assert model.layer_windows == [8, None, 8]
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [8, None, 8]
