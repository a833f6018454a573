"""The kvgate engine: a paged-KV LLM inference engine (vLLM V1's design, written small)."""

from kvgate.engine.config import EngineConfig
from kvgate.engine.errors import ConfigError, EngineError, InvalidRequestError, ModelLoadError
from kvgate.engine.llm import LLM
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.outputs import CompletionOutput, RequestOutput
from kvgate.engine.sampling_params import SamplingParams

__all__ = [
    "LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
    "EngineError", "InvalidRequestError", "ModelLoadError", "ConfigError",
]
