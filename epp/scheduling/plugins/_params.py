"""Validation of a plugin's `parameters` mapping: clear errors, not silent typos."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Counts and sizes beyond any real pool (2^40 index bytes, blocks, endpoints): larger is a typo, and would
# overflow the float and numpy arithmetic the plugins do with them.
MAX_INT_PARAM = 1 << 40
LOAD_UNITS = ("tokens", "seconds")  # loadUnit: seconds divides a load by the endpoint's relative speed


def _quote(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_keys(params: Mapping[str, Any] | None, allowed: set[str], plugin_type: str) -> Mapping[str, Any]:
    params = params or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"{plugin_type}: parameters must be a mapping, got {type(params).__name__}")
    # YAML keys may be numbers, booleans or null: sorted as text
    unknown = sorted(k[:80] if isinstance(k, str) else _quote(k) for k in set(params) - allowed)
    if unknown:
        known = ", ".join(sorted(allowed)) or "none"
        raise ValueError(f"{plugin_type}: unknown parameter(s) {', '.join(unknown)} (known: {known})")
    return params


def int_param(params: Mapping[str, Any], key: str, default: int, plugin_type: str, minimum: int = 0) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{plugin_type}: parameter {key} must be an integer, got {_quote(value)}")
    if value < minimum:
        raise ValueError(f"{plugin_type}: parameter {key} must be >= {minimum}, got {_quote(value)}")
    if value > MAX_INT_PARAM:
        raise ValueError(f"{plugin_type}: parameter {key} must be <= {MAX_INT_PARAM}, got {_quote(value)}")
    return value


def bool_param(params: Mapping[str, Any], key: str, default: bool, plugin_type: str) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{plugin_type}: parameter {key} must be true or false, got {_quote(value)}")
    return value


def float_param(params: Mapping[str, Any], key: str, default: float, plugin_type: str, minimum: float = 0.0,
                maximum: float = float(MAX_INT_PARAM), min_inclusive: bool = True) -> float:
    """A finite number in [minimum, maximum] ((minimum, maximum] with min_inclusive=False); integers accepted."""
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{plugin_type}: parameter {key} must be a number, got {_quote(value)}")
    low_ok = value >= minimum if min_inclusive else value > minimum
    if not (low_ok and value <= maximum):  # NaN fails too
        low = "[" if min_inclusive else "("
        raise ValueError(f"{plugin_type}: parameter {key} must be in {low}{minimum:g}, {maximum:g}], "
                         f"got {_quote(value)}")
    return float(value)


def str_param(params: Mapping[str, Any], key: str, default: str, plugin_type: str) -> str:
    value = params.get(key, default)
    if not isinstance(value, str) or len(value) > 253:
        raise ValueError(f"{plugin_type}: parameter {key} must be a string of at most 253 characters, "
                         f"got {_quote(value)}")
    return value


def choice_param(params: Mapping[str, Any], key: str, default: str, choices: tuple[str, ...], plugin_type: str) -> str:
    value = params.get(key, default)
    if value not in choices:
        raise ValueError(f"{plugin_type}: parameter {key} must be one of {', '.join(choices)}, got {_quote(value)}")
    return value


def load_unit_param(params: Mapping[str, Any], plugin_type: str) -> str:
    """loadUnit: tokens (default) or seconds (plugins/_relative_speed.py)."""
    return choice_param(params, "loadUnit", "tokens", LOAD_UNITS, plugin_type)
