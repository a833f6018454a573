"""Tiny random models of each supported family, built with transformers' own config classes and saved
as ordinary HF folders (safetensors + a byte-level tokenizer), so the engine loads them like real ones."""

from __future__ import annotations

import random
from pathlib import Path

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Mixture-of-experts families: in the HF parity tests; kept out of FAMILIES (the `family` fixture's list) so the
# other per-family tests do not grow.
MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe")
# Architectures outside the native families, served by the transformers fallback (engine/models/
# transformers_fallback.py); tests/engine/test_transformers_fallback.py runs them in every HF parity mode.
FALLBACK_FAMILIES = ("phi3", "olmo2", "granite")


def random_tokens(n: int, seed: int) -> list[int]:
    """n token ids of the byte-level vocabulary, reproducible by seed."""
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


def make_config(family: str):
    from transformers import (Gemma3TextConfig, GraniteConfig, LlamaConfig, MistralConfig, MixtralConfig, Olmo2Config,
                              OlmoeConfig, Phi3Config, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig)

    common = dict(vocab_size=262, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512, bos_token_id=256, eos_token_id=257)
    if family == "llama":  # GQA + Llama-3 rope scaling
        return LlamaConfig(**common, num_key_value_heads=2, tie_word_embeddings=False,
                           rope_parameters={"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 128})
    if family == "mistral":
        return MistralConfig(**common, num_key_value_heads=2, sliding_window=None, tie_word_embeddings=False)
    if family == "qwen2":  # qkv bias + tied embeddings
        return Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True)
    if family == "qwen3":  # q/k norm, explicit head_dim
        return Qwen3Config(**common, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    if family == "qwen3_moe":  # 8 experts, top-2 renormalised; layer 0 dense (mlp_only_layers), layers 1-2 sparse
        return Qwen3MoeConfig(**{**common, "num_hidden_layers": 3}, num_key_value_heads=2, head_dim=32,
                              num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, norm_topk_prob=True,
                              decoder_sparse_step=1, mlp_only_layers=[0], tie_word_embeddings=False)
    if family == "qwen2_moe":  # qkv bias, 8 experts top-2 not renormalised, a shared expert; layer 2 dense
        return Qwen2MoeConfig(**{**common, "num_hidden_layers": 3}, num_key_value_heads=2, num_experts=8,
                              num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=96,
                              norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[2],
                              tie_word_embeddings=False)
    if family == "mixtral":  # 4 experts of width intermediate_size, top-2
        return MixtralConfig(**common, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                             sliding_window=None, tie_word_embeddings=False)
    if family == "phi3":  # fused qkv_proj and gate_up_proj in HF's own modules
        return Phi3Config(**common, num_key_value_heads=2, tie_word_embeddings=False, pad_token_id=0)
    if family == "olmo2":  # q/k norm over all heads, norms after attention and MLP, tied embeddings
        return Olmo2Config(**common, num_key_value_heads=2, tie_word_embeddings=True, pad_token_id=0)
    if family == "granite":  # attention, embedding, residual and logits multipliers
        return GraniteConfig(**common, num_key_value_heads=2, tie_word_embeddings=False, attention_multiplier=0.1,
                             embedding_multiplier=3.0, residual_multiplier=0.5, logits_scaling=4.0)
    if family == "olmoe":  # an MoE whose per-expert checkpoint tensors transformers stacks on load: 8 experts, top-2
        return OlmoeConfig(**common, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
                           tie_word_embeddings=False, pad_token_id=0)
    if family == "gemma3":  # text-only Gemma 3 with every layer full attention (kvgate has one window for all):
        # q/k norm, query_pre_attn_scalar, a scaled embedding (a computed buffer), final logit softcapping
        return Gemma3TextConfig(**{**common, "num_hidden_layers": 3}, num_key_value_heads=2, head_dim=32,
                                layer_types=["full_attention"] * 3, final_logit_softcapping=30.0,
                                attn_logit_softcapping=None, query_pre_attn_scalar=24, pad_token_id=0)
    raise ValueError(family)


def sliding_qwen_config(family: str, window: int, **overrides):
    """The tiny Qwen2/Qwen3 config with 3 layers and use_sliding_window: max_window_layers 1 (layer 0 full attention,
    layers 1-2 sliding over `window` tokens) unless overridden; transformers builds layer_types from them."""
    config = make_config(family)
    base = config.to_dict()
    base.update(num_hidden_layers=3, use_sliding_window=True, sliding_window=window, max_window_layers=1,
                layer_types=None)
    base.update(overrides)
    return type(config)(**{k: v for k, v in base.items() if k not in ("model_type", "transformers_version")})


# Weight std of build_tiny_model's smooth variant: (q/k projections, the other matrices, embeddings and LM head).
# The default (0.2 everywhere) makes attention sharp and generation chaotic: any perturbation (bf16 weights alone)
# changes most 64-token greedy outputs. Small q/k/v/o/MLP weights and a wide embedding/LM head keep greedy margins
# wide while attention still decides the output (tests/engine/test_kv_cache_dtype.py measures both).
SMOOTH_STDS = (0.03, 0.05, 0.5)


def build_tiny_model(family: str, folder: Path, seed: int = 0, config=None, stds: tuple | None = None):
    """Save a random HF model of `family` (or of `config`) to `folder`; returns the HF model (fp32, eval mode).
    stds: (q/k, other matrices, embeddings and LM head) weight std; None: 0.2 for all."""
    from transformers import AutoModelForCausalLM

    from kvgate.common.demo import build_byte_tokenizer, write_tokenizer_files

    config = config or make_config(family)
    qk_std, matrix_std, embed_std = stds or (0.2, 0.2, 0.2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # wider than the default init so greedy choices are not near-ties
        for name, p in model.named_parameters():
            if p.dim() > 1:
                if "q_proj" in name or "k_proj" in name:
                    p.normal_(0.0, qk_std)
                elif "embed" in name or "lm_head" in name:
                    p.normal_(0.0, embed_std)
                else:
                    p.normal_(0.0, matrix_std)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
    model.eval()
    model.save_pretrained(str(folder), safe_serialization=True)
    write_tokenizer_files(build_byte_tokenizer(), folder, config.max_position_embeddings)
    return model


def hf_greedy(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """HF transformers' own greedy continuation of each prompt, exactly max_new tokens (no EOS stop)."""
    outs = []
    for prompt in prompts:
        with torch.no_grad():
            # an explicit mask: generate would otherwise take every token equal to pad_token_id (0) for padding
            gen = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
        outs.append(gen[0, len(prompt):].tolist())
    return outs


def hf_greedy_by_family(tiny_model_dir, prompts: list[list[int]], max_new: int):
    """family -> hf_greedy over the family's tiny model (tiny_model_dir's), computed once per family."""
    cache: dict[str, list[list[int]]] = {}

    def get(family: str) -> list[list[int]]:
        if family not in cache:
            cache[family] = hf_greedy(tiny_model_dir(family)[1], prompts, max_new)
        return cache[family]

    return get
