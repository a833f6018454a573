"""Mistral: the Llama stack with sliding-window attention (window from the config)."""

from kvgate.engine.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
