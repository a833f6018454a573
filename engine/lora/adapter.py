"""Read a PEFT LoRA folder (`adapter_config.json` + `adapter_model.safetensors`) and check it against the base model.

PEFT's semantics, which the engine reproduces: a targeted projection W becomes `W x + (B A x) * scaling`, with
A [r, in], B [out, r] and scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). Tensor names are
`base_model.model.model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight`. What the engine does not serve is
refused here, when the adapter is added, never inside a step: DoRA, biases, fan_in_fan_out, per-module rank or
alpha patterns, embedding / LM-head targets, modules_to_save, and ranks above --max-lora-rank.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

from kvgate.common import bounded_json
from kvgate.common.errors import LoRAError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The projections a decoder layer has, by PEFT's (HF's) module names.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float
    target_modules: frozenset[str]


@dataclass
class LoRAWeights:
    """One adapter in host memory: {(layer, module): (A [r, in], B [out, r] with the scaling folded in)}."""

    rank: int
    weights: dict

    @property
    def nbytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def read_adapter_config(path: str | Path, max_rank: int) -> AdapterConfig:
    folder = Path(path)
    if not folder.is_dir():
        raise LoRAError(f"LoRA adapter folder {str(folder)!r} does not exist")
    file = folder / CONFIG_FILE
    try:
        config = bounded_json.read(file, bounded_json.CONFIG_BYTES)  # 16 MiB, 64 levels of nesting
    except FileNotFoundError:
        raise LoRAError(f"{str(folder)!r} is not a PEFT adapter: it has no {CONFIG_FILE}") from None
    except (OSError, ValueError) as exc:
        raise LoRAError(f"cannot read {file}: {exc}") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{file}: not a LoRA adapter (peft_type {config.get('peft_type')!r})")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise LoRAError(f"{file}: r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise LoRAError(f"LoRA rank {rank} is greater than max_lora_rank {max_rank} (--max-lora-rank)")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise LoRAError(f"{file}: lora_alpha must be a number, got {alpha!r}")
    unsupported = [(key, value) for key, value, ok in (
        ("bias", config.get("bias", "none"), config.get("bias", "none") == "none"),
        ("use_dora", config.get("use_dora"), not config.get("use_dora")),
        ("fan_in_fan_out", config.get("fan_in_fan_out"), not config.get("fan_in_fan_out")),
        ("rank_pattern", config.get("rank_pattern"), not config.get("rank_pattern")),
        ("alpha_pattern", config.get("alpha_pattern"), not config.get("alpha_pattern")),
        ("modules_to_save", config.get("modules_to_save"), not config.get("modules_to_save")),
        ("lora_bias", config.get("lora_bias"), not config.get("lora_bias")),
    ) if not ok]
    if unsupported:
        key, value = unsupported[0]
        raise LoRAError(f"{file}: {key} = {value!r} is not supported (plain LoRA only)")
    targets = config.get("target_modules")
    if isinstance(targets, str):  # PEFT also takes a regex or "all-linear"; the weights say what it matched
        targets = None
    elif not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise LoRAError(f"{file}: target_modules must be a list of module names")
    else:
        bad = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(SUPPORTED_MODULES))
        if bad:
            raise LoRAError(f"{file}: target modules {bad} are not supported "
                            f"(supported: {', '.join(SUPPORTED_MODULES)})")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, float(scaling), frozenset(t.rsplit(".", 1)[-1] for t in targets or ()))


def load_lora_weights(path: str | Path, max_rank: int, shapes: dict[str, tuple[int, int]], num_layers: int,
                      dtype) -> LoRAWeights:
    """The adapter's tensors in `dtype`, checked against the base model: `shapes` maps each module name to its
    (in_features, out_features)."""
    from safetensors import safe_open

    config = read_adapter_config(path, max_rank)
    file = Path(path) / WEIGHTS_FILE
    if not file.is_file():
        raise LoRAError(f"{str(path)!r} has no {WEIGHTS_FILE} (.bin adapters are not loaded: save with safetensors)")
    halves: dict[tuple[int, str], dict[str, object]] = {}
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                m = _KEY.match(name)
                if m is None:
                    raise LoRAError(f"{file}: tensor {name!r} is not a LoRA weight of a decoder layer's projection "
                                    f"(supported: {', '.join(SUPPORTED_MODULES)})")
                layer, module, half = int(m.group(1)), m.group(2), m.group(3)
                if module not in shapes:
                    raise LoRAError(f"{file}: target module {module!r} is not supported "
                                    f"(supported: {', '.join(SUPPORTED_MODULES)})")
                if layer >= num_layers:
                    raise LoRAError(f"{file}: tensor {name!r} is for layer {layer}; the model has {num_layers}")
                halves.setdefault((layer, module), {})[half] = f.get_tensor(name)
    except LoRAError:
        raise
    except Exception as exc:  # noqa: BLE001 - a corrupt file, whatever safetensors raises for it
        raise LoRAError(f"cannot read {file}: {exc}") from None
    if not halves:
        raise LoRAError(f"{file} holds no LoRA weights")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{file}: layer {layer} {module} has lora_{'A' if 'A' not in pair else 'B'} missing")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[module]
        if tuple(a.shape) != (config.rank, fan_in) or tuple(b.shape) != (fan_out, config.rank):
            raise LoRAError(f"{file}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; this "
                            f"model needs A ({config.rank}, {fan_in}) and B ({fan_out}, {config.rank})")
        weights[(layer, module)] = (a.to(dtype).contiguous(), (b.float() * config.scaling).to(dtype).contiguous())
    return LoRAWeights(config.rank, weights)
