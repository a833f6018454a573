"""Qwen3: the Llama stack with per-head RMSNorm on queries and keys before RoPE."""

from kvgate.engine.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
