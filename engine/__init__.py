"""The kvgate engine: a paged-KV LLM inference engine (vLLM V1's design, written small).

Exports load on first use (PEP 562), so that `kvgate epp` / `kvgate operator`, which share the command
line with the engine, never pay for importing torch.
"""

import importlib

_EXPORTS = {
    "LLM": "kvgate.engine.llm",
    "LLMEngine": "kvgate.engine.llm_engine",
    "EngineConfig": "kvgate.engine.config",
    "SamplingParams": "kvgate.engine.sampling_params",
    "RequestOutput": "kvgate.engine.outputs",
    "CompletionOutput": "kvgate.engine.outputs",
    "EngineError": "kvgate.common.errors",
    "InvalidRequestError": "kvgate.common.errors",
    "ModelLoadError": "kvgate.common.errors",
    "ConfigError": "kvgate.common.errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvgate.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
