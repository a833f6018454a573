"""Qwen2: the Llama stack with a bias on the q/k/v projections (and usually tied embeddings)."""

from kvgate.engine.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
