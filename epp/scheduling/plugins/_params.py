"""Validation of a plugin's `parameters` mapping: clear errors, not silent typos."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def check_keys(params: Mapping[str, Any] | None, allowed: set[str], plugin_type: str) -> Mapping[str, Any]:
    params = params or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"{plugin_type}: parameters must be a mapping, got {type(params).__name__}")
    unknown = sorted(set(params) - allowed)
    if unknown:
        known = ", ".join(sorted(allowed)) or "none"
        raise ValueError(f"{plugin_type}: unknown parameter(s) {', '.join(unknown)} (known: {known})")
    return params


def int_param(params: Mapping[str, Any], key: str, default: int, plugin_type: str, minimum: int = 0) -> int:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{plugin_type}: parameter {key} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{plugin_type}: parameter {key} must be >= {minimum}, got {value}")
    return value


def bool_param(params: Mapping[str, Any], key: str, default: bool, plugin_type: str) -> bool:
    value = params.get(key, default)
    if not isinstance(value, bool):
        raise ValueError(f"{plugin_type}: parameter {key} must be true or false, got {value!r}")
    return value
