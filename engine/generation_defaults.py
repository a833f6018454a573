"""The model's own sampling defaults, as vLLM takes them (`--generation-config`, `--override-generation-config`).

A checkpoint's generation_config.json may recommend sampling settings (Qwen3: temperature 0.6, top_p 0.95, top_k
20; Llama 3.1: temperature 0.6, top_p 0.9). vLLM applies them to every request that leaves the field out, and so
does kvgate, with vLLM's flag and meaning:

- `--generation-config auto` (the default): the model folder's generation_config.json; `vllm`: none (the OpenAI
  defaults: temperature 1, top_p 1, no top_k); a folder: that folder's generation_config.json (it must have one).
- `--override-generation-config '{"temperature": 0.5}'`: a JSON object laid over it.
- The keys taken: temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens (the most a request that
  gives no max_tokens generates). vLLM also caps every request's max_tokens at max_new_tokens when it comes from the
  override or from a generation-config folder (not from the model's own file); so does kvgate.

The file is read as vLLM reads it (GenerationConfig.to_diff_dict: the values that differ from transformers'
defaults, which since transformers 5 are unset, so every value the file sets), within common/bounded_json.py's
limits (16 MiB and 64 levels of nesting; the override 64 KiB). Values are checked at start with
the request checks (SamplingParams): a bad one stops the server with the file it came from.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.common import bounded_json
from kvgate.common.errors import ConfigError, InvalidRequestError

log = logging.getLogger("kvgate.engine")

SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MAX_NEW_TOKENS = "max_new_tokens"


@dataclass(frozen=True)
class GenerationDefaults:
    sampling: dict = field(default_factory=dict)  # SAMPLING_KEYS values for requests that leave them out
    max_tokens: int | None = None  # a request without max_tokens generates at most this many
    max_tokens_cap: int | None = None  # every request generates at most this many
    source: str = "none"

    def fill(self, fields: dict) -> dict:
        """`fields` (a request's sampling fields, None where it left one out) with the defaults where it did."""
        return {k: (self.sampling.get(k) if v is None else v) for k, v in fields.items()}

    def max_tokens_for(self, requested: int | None, room: int) -> int:
        """What a request generates at most: its max_tokens (checked against the context by the caller) or the
        room left in the context, lowered to max_new_tokens as vLLM lowers it."""
        limit = requested if requested is not None else min(room, self.max_tokens or room)
        return min(limit, self.max_tokens_cap or limit)


def load_generation_defaults(model_path: str, generation_config: str = "auto",
                             override: dict | None = None) -> GenerationDefaults:
    """The defaults for `model_path` (a folder; anything else, such as a sim backend's model name, has none)."""
    if generation_config == "vllm":
        values, source = {}, "vllm (none)"
    elif generation_config == "auto":
        folder = Path(model_path)
        values = _read_folder(folder) if (folder / "generation_config.json").is_file() else {}
        source = f"{folder / 'generation_config.json'}" if values else "auto (none in the model folder)"
    else:
        folder = Path(generation_config)
        if not (folder / "generation_config.json").is_file():
            raise ConfigError(f"--generation-config {generation_config}: no generation_config.json in that folder "
                              "(auto: the model's; vllm: none)")
        values, source = _read_folder(folder), str(folder / "generation_config.json")
    cap = None
    if override:
        if not isinstance(override, dict):
            raise ConfigError("--override-generation-config must be a JSON object")
        values = {**values, **override}
        source += " + --override-generation-config"
        cap = override.get(MAX_NEW_TOKENS)
    elif generation_config not in ("auto", "vllm"):
        cap = values.get(MAX_NEW_TOKENS)
    ignored = sorted(k for k in (override or {}) if k not in SAMPLING_KEYS + (MAX_NEW_TOKENS,))
    if ignored:
        log.warning("--override-generation-config: %s not used (kvgate takes %s)", ", ".join(ignored),
                    ", ".join(SAMPLING_KEYS + (MAX_NEW_TOKENS,)))
    sampling = {k: values[k] for k in SAMPLING_KEYS if values.get(k) is not None}
    max_tokens = values.get(MAX_NEW_TOKENS)
    defaults = GenerationDefaults(sampling, max_tokens, cap, source)
    _check(defaults)
    if sampling or max_tokens is not None:
        log.warning("sampling defaults from %s: %s (requests that leave these out get them; "
                    "--generation-config vllm turns them off)", source,
                    ", ".join(f"{k}={v}" for k, v in {**sampling, MAX_NEW_TOKENS: max_tokens}.items()
                              if v is not None))
    return defaults


def parse_override(text: str | None) -> dict | None:
    """--override-generation-config's JSON (a ConfigError when it is not an object)."""
    if text is None:
        return None
    try:
        value = bounded_json.loads(text, bounded_json.FLAG_BYTES)
    except bounded_json.JSONLimitError as exc:
        raise ConfigError(f"--override-generation-config: {exc}") from None
    except ValueError as exc:
        raise ConfigError(f"--override-generation-config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError("--override-generation-config must be a JSON object, e.g. '{\"temperature\": 0.5}'")
    return value


def _read_folder(folder: Path) -> dict:
    from transformers import GenerationConfig

    try:
        bounded_json.check_file(folder / "generation_config.json", bounded_json.CONFIG_BYTES)
        config = GenerationConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError, TypeError) as exc:  # unreadable, over a limit, not JSON, or fields of the wrong kind
        raise ConfigError(f"cannot read {folder / 'generation_config.json'}: {exc}") from None
    return config.to_diff_dict()


def _check(defaults: GenerationDefaults) -> None:
    from kvgate.engine.sampling_params import SamplingParams

    for value in (defaults.max_tokens, defaults.max_tokens_cap):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{defaults.source}: max_new_tokens must be an integer >= 1, got {value!r}")
    try:
        SamplingParams(**defaults.sampling)  # the request checks: finite, in range, of the right type
    except (InvalidRequestError, TypeError) as exc:
        raise ConfigError(f"{defaults.source}: {exc}") from None
