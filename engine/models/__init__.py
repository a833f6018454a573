"""Model registry: HF `architectures` name -> our implementation."""

from kvgate.common.errors import ModelLoadError
from kvgate.engine.models.llama import LlamaForCausalLM
from kvgate.engine.models.mistral import MistralForCausalLM
from kvgate.engine.models.mixtral import MixtralForCausalLM
from kvgate.engine.models.qwen2 import Qwen2ForCausalLM
from kvgate.engine.models.qwen3 import Qwen3ForCausalLM
from kvgate.engine.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def resolve_model_class(config):
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ModelLoadError(
        f"unsupported model architecture {archs or '(none given in config.json)'}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
