"""The shape of the ModelServer and InferencePool fields the operator reads, checked before anything is rendered.

The API server validates both against their CRD schemas first, so a spec of the wrong shape reaches the operator
only from a cluster whose CRD is older or missing its schema, or a client that bypasses it. The renderers
trust the shape (a `model` that is a string, a port that is a list), so without this check such a spec was an
exception escaping the reconcile (AttributeError, TypeError, KeyError — found by fuzzing,
tests/operator/test_fuzz_reconcile.py) and a retry loop every few seconds, instead of a status condition.

A shape is a Python type (str, bool, `Int` for integers with bounds, `Mapping` for any mapping), a dict of
optional fields, `ListOf(shape)`, or `MapOf(shape)` (string keys). `problems` lists where a value differs,
e.g. "spec.model.pvc.claimName: expected a string, got int". Only the fields the operator reads are checked;
null is accepted where the field is optional (the renderers treat it as unset), not where it is `Required`.
The bounds are the CRDs'.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_TYPE_NAMES = {str: "a string", bool: "true or false", Mapping: "a mapping"}


@dataclass(frozen=True)
class Int:
    minimum: int = -(2**63)
    maximum: int = 2**63 - 1


@dataclass(frozen=True)
class Number:
    """A number (integer or not) in [minimum, maximum], or (minimum, maximum] with exclusive_minimum."""
    minimum: float
    maximum: float
    exclusive_minimum: bool = False


@dataclass(frozen=True)
class Required:
    """A field that must be present and not null (the CRD's `required`, which the renderers rely on)."""
    shape: Any


@dataclass(frozen=True)
class ListOf:
    item: Any


@dataclass(frozen=True)
class MapOf:
    value: Any


INT32 = Int(-(2**31), 2**31 - 1)
PORT = Int(1, 65535)
INT_OR_STRING = (int, str)

MODELSERVER_SPEC = {
    "poolRef": {"name": str},
    "replicas": Int(0, 2**31 - 1),
    "minReplicas": Int(0, 1000),
    "maxReplicas": Int(1, 1000),
    "autoscaling": {"provider": str, "targetWaitingPerReplica": Number(0.1, 10000),
                    "targetKVUtilization": Number(0.05, 1), "targetQueueWaitSeconds": Number(0.01, 3600),
                    "tolerance": Number(0, 0.9), "scaleUpStabilizationSeconds": Int(0, 3600),
                    "scaleDownStabilizationSeconds": Int(0, 86400), "scaleDownDelaySeconds": Int(0, 86400),
                    "scaleUpMaxPods": Int(1, 1000), "scaleUpMaxPercent": Int(0, 1000)},
    "model": {"path": str, "servedModelName": str, "pvc": {"claimName": Required(str), "readOnly": bool},
              "hostPath": {"path": Required(str)}, "image": {"reference": Required(str), "pullPolicy": str}},
    "engine": {"type": str, "backend": str, "device": str, "dtype": str, "blockSize": Int(1, 2**31 - 1),
               "maxNumSeqs": Int(1, 2**31 - 1), "maxNumBatchedTokens": Int(1, 2**31 - 1),
               "maxModelLen": Int(1, 2**31 - 1), "kvCacheMemory": INT_OR_STRING, "enablePrefixCaching": bool,
               "gpuMemoryUtilization": Number(0, 1, exclusive_minimum=True), "kvCacheDtype": str,
               "quantization": str, "tensorParallelSize": Int(1, 16),
               "speculativeConfig": {"method": str, "numSpeculativeTokens": Required(Int(1, 32)),
                                     "promptLookupMin": Int(1, 64), "promptLookupMax": Int(1, 64)},
               "shutdownGracePeriodSeconds": Int(1, 3600),
               "apiKeySecretRef": {"name": Required(str), "key": Required(str)},
               "kvEvents": {"port": Required(Int(1024, 65535)), "replayPort": Int(1024, 65535)},
               "lora": {"maxLoras": Int(1, 64), "maxLoraRank": Int(1, 512), "maxCpuLoras": Int(1, 1024),
                        "adapters": Required(ListOf({"name": Required(str), "path": Required(str)})),
                        "source": Required({"pvc": {"claimName": Required(str)},
                                            "image": {"reference": Required(str), "pullPolicy": str}})}},
    "image": str,
    "imagePullPolicy": str,
    "resources": {"limits": MapOf(INT_OR_STRING), "requests": MapOf(INT_OR_STRING), "claims": ListOf(Mapping)},
    "extraArgs": ListOf(str),
    "podLabels": MapOf(str),
    "nodeSelector": MapOf(str),
    "tolerations": ListOf({"key": str, "operator": str, "value": str, "effect": str, "tolerationSeconds": Int()}),
}

POOL_SPEC = {
    "selector": {"matchLabels": MapOf(str)},
    "targetPorts": ListOf({"number": Required(PORT)}),
    "endpointPickerRef": {"name": str, "group": str, "kind": str, "port": {"number": Required(PORT)},
                          "failureMode": str},
    "appProtocol": str,
}


def _describe(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def problems(value: Any, shape: Any, where: str) -> list[str]:
    """Where `value` does not have `shape` (empty when it does); at most a few, each naming its path."""
    found: list[str] = []
    _check(value, shape, where, found)
    return found[:5]


def _check(value: Any, shape: Any, where: str, found: list[str]) -> None:
    if isinstance(shape, dict):
        if not isinstance(value, Mapping):
            found.append(f"{where}: expected a mapping, got {_describe(value)}")
            return
        for key, sub in shape.items():
            if isinstance(sub, Required):
                if value.get(key) is None:
                    found.append(f"{where}.{key}: required")
                else:
                    _check(value[key], sub.shape, f"{where}.{key}", found)
            elif value.get(key) is not None:
                _check(value[key], sub, f"{where}.{key}", found)
    elif isinstance(shape, ListOf):
        if not isinstance(value, list):
            found.append(f"{where}: expected a list, got {_describe(value)}")
            return
        for i, item in enumerate(value):
            if item is None:
                found.append(f"{where}[{i}]: expected a value, got null")
            else:
                _check(item, shape.item, f"{where}[{i}]", found)
    elif isinstance(shape, MapOf):
        if not isinstance(value, Mapping):
            found.append(f"{where}: expected a mapping, got {_describe(value)}")
            return
        for key, item in value.items():
            if not isinstance(key, str):
                found.append(f"{where}: keys must be strings, got {_describe(key)}")
            elif item is None:
                found.append(f"{where}.{key[:63]}: expected a value, got null")
            else:
                _check(item, shape.value, f"{where}.{key[:63]}", found)
    elif isinstance(shape, Int):
        if isinstance(value, bool) or not isinstance(value, int):
            found.append(f"{where}: expected an integer, got {_describe(value)}")
        elif not shape.minimum <= value <= shape.maximum:
            found.append(f"{where}: {value} is out of range [{shape.minimum}, {shape.maximum}]")
    elif isinstance(shape, Number):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            found.append(f"{where}: expected a number, got {_describe(value)}")
        elif not ((value > shape.minimum if shape.exclusive_minimum else value >= shape.minimum)
                  and value <= shape.maximum):  # also refuses NaN
            low = "(" if shape.exclusive_minimum else "["
            found.append(f"{where}: {value} is out of range {low}{shape.minimum}, {shape.maximum}]")
    elif shape == INT_OR_STRING:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            found.append(f"{where}: expected an integer or a string, got {_describe(value)}")
    elif not isinstance(value, shape) or (shape is not bool and isinstance(value, bool)):
        found.append(f"{where}: expected {_TYPE_NAMES.get(shape, shape.__name__)}, got {_describe(value)}")


def modelserver_problems(ms: dict) -> list[str]:
    return problems(ms.get("spec"), MODELSERVER_SPEC, "spec")


def pool_problems(pool: dict) -> list[str]:
    return problems(pool.get("spec"), POOL_SPEC, "spec")


def pool_ref_name(ms: dict) -> str | None:
    """spec.poolRef.name of a ModelServer of any shape; None when it is not a string."""
    spec = ms.get("spec")
    ref = spec.get("poolRef") if isinstance(spec, Mapping) else None
    name = ref.get("name") if isinstance(ref, Mapping) else None
    return name if isinstance(name, str) else None
