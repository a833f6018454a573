"""Model registry: HF `architectures` name -> our implementation; any other decoder-only causal LM that transformers
builds runs through the transformers fallback (transformers_fallback.py), imported only then (it imports
transformers' modeling code)."""

from kvgate.common.errors import ModelLoadError
from kvgate.engine.models.llama import LlamaForCausalLM
from kvgate.engine.models.mistral import MistralForCausalLM
from kvgate.engine.models.mixtral import MixtralForCausalLM
from kvgate.engine.models.qwen2 import Qwen2ForCausalLM
from kvgate.engine.models.qwen2_moe import Qwen2MoeForCausalLM
from kvgate.engine.models.qwen3 import Qwen3ForCausalLM
from kvgate.engine.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_REGISTRY = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def resolve_model_class(config):
    """The native family of config's architecture, else the transformers fallback; ModelLoadError for an
    architecture neither runs (encoder-decoder, multimodal, not a causal LM, attention features the paged attention
    does not compute)."""
    archs = list(getattr(config, "architectures", None) or [])
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    from kvgate.engine.models.transformers_fallback import TransformersForCausalLM, check_supported

    try:
        check_supported(config)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{exc} (native families: {', '.join(sorted(MODEL_REGISTRY))})") from None
    return TransformersForCausalLM


def describe_model(model) -> str:
    """Which path a loaded model takes, for the engine's start line."""
    if type(model).__name__ == "TransformersForCausalLM":
        return f"{model.architecture} on the transformers fallback"
    return f"native {type(model).__name__}"
