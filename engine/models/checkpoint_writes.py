"""The write loop every model's load_weights shares: each checkpoint tensor into its place, every element of every
expected tensor written exactly once, and the checkpoint's faults as ModelLoadErrors naming the tensor."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from kvgate.common.errors import ModelLoadError

# name, checkpoint tensor -> None (a tensor the model skips), or (coverage key, the destination it fills or None for
# a tensor the model does not have, the part of the tensor that fills it)
Place = Callable[[str, torch.Tensor], "tuple[str, torch.Tensor | None, torch.Tensor] | None"]


def write_checkpoint(weights: Iterable[tuple[str, torch.Tensor]], place: Place, expected: dict[str, int],
                     owner: str, copy: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None) -> None:
    """Copy each tensor to place()'s destination (copy(name, dest, tensor) instead of dest.copy_ when given).
    expected: coverage key -> elements the checkpoint must write; owner names the model in the errors."""
    covered: dict[str, int] = {}
    for name, tensor in weights:
        placed = place(name, tensor)
        if placed is None:
            continue
        key, dest, tensor = placed
        if dest is None:
            raise ModelLoadError(f"checkpoint tensor {name!r} does not belong to {owner}")
        if dest.shape != tensor.shape:
            raise ModelLoadError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)}")
        if copy is None:
            dest.copy_(tensor)
        else:
            copy(name, dest, tensor)
        covered[key] = covered.get(key, 0) + tensor.numel()
    missing = sorted(k for k, size in expected.items() if covered.get(k, 0) != size)
    if missing:
        raise ModelLoadError(f"checkpoint is missing weights: {', '.join(missing[:5])}"
                             + (f" and {len(missing) - 5} more" if len(missing) > 5 else ""))
