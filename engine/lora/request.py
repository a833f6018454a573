"""What names an adapter inside the engine (vLLM's `LoRARequest` field names, so code reading vLLM's reads ours).

`lora_int_id` is the adapter's number for its whole life in the engine (>= 1; 0 means the base model): the
prefix-cache hash and the KV events carry it, and a request holds it from admission to its end. The server
gives out ids; the engine only checks they are unique.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.common import bounded_json
from kvgate.common.errors import ConfigError


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str  # the model name clients send in `model`
    lora_int_id: int
    lora_path: str  # a PEFT folder: adapter_config.json + adapter_model.safetensors
    base_model_name: str | None = None  # /v1/models `parent`; None = the served model

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ConfigError("a LoRA adapter needs a name")
        if self.lora_int_id < 1:
            raise ConfigError(f"LoRA id must be >= 1 (0 is the base model), got {self.lora_int_id}")


@dataclass(frozen=True)
class LoRAModulePath:
    """One `--lora-modules` entry: `name=path`, or vLLM's JSON form `{"name": .., "path": .., "base_model_name": ..}`."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> "LoRAModulePath":
        text = text.strip()
        if text.startswith("{"):
            try:
                data = bounded_json.loads(text, bounded_json.FLAG_BYTES)
            except bounded_json.JSONLimitError as exc:
                raise ConfigError(f"--lora-modules entry: {exc}") from None
            except ValueError as exc:
                raise ConfigError(f"--lora-modules entry is not valid JSON: {exc}") from None
            if not isinstance(data, dict) or not isinstance(data.get("name"), str) or not isinstance(
                    data.get("path"), str):
                raise ConfigError('--lora-modules JSON needs string "name" and "path"')
            unknown = set(data) - {"name", "path", "base_model_name"}
            if unknown:
                raise ConfigError(f"--lora-modules JSON has unknown keys {sorted(unknown)}")
            base = data.get("base_model_name")
            if base is not None and not isinstance(base, str):
                raise ConfigError('--lora-modules "base_model_name" must be a string')
            name, path = data["name"], data["path"]
        else:
            name, sep, path = text.partition("=")
            base = None
            if not sep:
                raise ConfigError(f"--lora-modules entry {text!r} is not name=path or JSON")
        if not name or not path:
            raise ConfigError(f"--lora-modules entry {text!r} needs both a name and a path")
        return cls(name, path, base)
