"""A checkpoint's quantization_config (config.json) read and checked into a QuantConfig: which scheme each
linear module's tensors follow, and which modules stay dense. An unknown method, or a setting this engine does not
load, is a ModelLoadError naming the key; a --quantization that is not the checkpoint's is a ConfigError."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvgate.common.errors import ConfigError, ModelLoadError
from kvgate.engine.quantization.scheme import LinearScheme

# vLLM's --quantization names of the methods this engine loads (config.json's quant_method values).
METHODS = ("fp8", "compressed-tensors", "gptq", "awq")


@dataclass(frozen=True)
class QuantConfig:
    method: str
    # (targets, scheme) in the config's order; a target is a module name, "re:<regex>" (matched from the start
    # of the name) or "Linear" (every linear module).
    groups: tuple[tuple[tuple[str, ...], LinearScheme], ...]
    ignore: tuple[str, ...] = ()

    @property
    def schemes(self) -> tuple[LinearScheme, ...]:
        return tuple(scheme for _, scheme in self.groups)

    def describe(self) -> str:
        kinds = sorted({scheme.describe() for scheme in self.schemes})
        return f"{self.method} ({'; '.join(kinds)})" if kinds else self.method

    def schemes_for(self, prefix: str) -> list[LinearScheme]:
        """The schemes that may store the quantized module `prefix`, best first (a ModelLoadError when the config
        leaves it dense): a target naming it before a regex, a regex before "Linear"; among equals, the config's
        order."""
        if any(_matches(prefix, target) for target in self.ignore):
            raise ModelLoadError(f"module {prefix!r} has quantized tensors, but quantization_config ignores it")
        found = [scheme for rank in (_by_name, _by_regex, _by_class)
                 for targets, scheme in self.groups if any(rank(prefix, t) for t in targets)]
        if not found:
            raise ModelLoadError(f"module {prefix!r} has quantized tensors, but no quantization_config group "
                                 "targets it")
        return found


def _by_name(prefix: str, target: str) -> bool:
    return target == prefix


def _by_regex(prefix: str, target: str) -> bool:
    return target.startswith("re:") and re.match(target[3:], prefix) is not None


def _by_class(prefix: str, target: str) -> bool:
    return target == "Linear"


def _matches(prefix: str, target: str) -> bool:
    """An ignore entry: a module name (or a parent of it, as transformers' modules_to_not_convert), a regex."""
    if target.startswith("re:"):
        return re.match(target[3:], prefix) is not None
    return prefix == target or prefix.startswith(target + ".") or prefix.endswith("." + target)


def quant_config_from_hf(hf_config, given: str | None = None) -> QuantConfig | None:
    """The QuantConfig of hf_config's quantization_config (None: an unquantized checkpoint). given: --quantization
    (None: from config.json), which must be the checkpoint's method."""
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else qc
    if given is not None and given not in METHODS:
        raise ConfigError(f"quantization must be one of {', '.join(METHODS)}, got {given!r}")
    if qc is None:
        if given is not None:
            raise ConfigError(f"--quantization {given} was given, but the checkpoint's config.json has no "
                              "quantization_config (an unquantized checkpoint)")
        return None
    if not isinstance(qc, dict):
        raise ModelLoadError(f"quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method not in METHODS:
        raise ModelLoadError(f"quantization_config.quant_method is {method!r:.60}: supported {', '.join(METHODS)}")
    if given is not None and given != method:
        raise ConfigError(f"--quantization {given} was given, but the checkpoint is quantized with {method} "
                          "(quantization_config.quant_method)")
    return parse_quant_config(qc)


def parse_quant_config(qc: dict) -> QuantConfig:
    method = qc["quant_method"]
    if method == "fp8":
        from kvgate.engine.quantization.fp8 import parse_fp8

        schemes, ignore = parse_fp8(qc)
        return QuantConfig(method, tuple((("Linear",), scheme) for scheme in schemes), ignore)
    if method == "compressed-tensors":
        from kvgate.engine.quantization.compressed_tensors import parse_compressed_tensors

        groups, ignore = parse_compressed_tensors(qc)
        return QuantConfig(method, tuple(groups), ignore)
    if method == "gptq":
        from kvgate.engine.quantization.gptq import parse_gptq

        return QuantConfig(method, ((("Linear",), parse_gptq(qc)),))
    from kvgate.engine.quantization.awq import parse_awq

    scheme, ignore = parse_awq(qc)
    return QuantConfig(method, ((("Linear",), scheme),), ignore)
