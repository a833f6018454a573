"""Errors the engine raises for bad input; callers (CLI, HTTP server) turn them into clear messages."""


class EngineError(Exception):
    """Base class of the engine's own errors."""


class EngineDeadError(EngineError):
    """The engine loop died (an exception, or its process was killed): nothing can be served any more."""


class InvalidRequestError(EngineError, ValueError):
    """A request (prompt or sampling parameters) the engine cannot serve; other requests are unaffected."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the offending request field, when one is to blame

    def __reduce__(self):  # keep `param` across the engine process's pipe
        return type(self), (str(self), self.param)


class ModelLoadError(EngineError, ValueError):
    """A model folder that cannot be loaded: missing files, unknown architecture, mismatched weights."""


class ConfigError(EngineError, ValueError):
    """Engine arguments that contradict each other or the model."""


class LoRAError(InvalidRequestError):
    """A LoRA adapter that cannot be served (bad folder, rank or target modules, unknown or duplicate name)."""
