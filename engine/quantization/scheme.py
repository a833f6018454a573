"""What every quantized-linear format has in common: the scheme interface the weight stream uses, and the checks
of tensors a scheme reads (shape, dtype, finite positive scales), each failure a one-line ModelLoadError naming the
tensor."""

from __future__ import annotations

import torch

from kvgate.common.errors import ModelLoadError


# Output rows dequantized at a time: the temporaries of a dequantization (unpacked ints, expanded scales) are
# about this many elements, whatever the weight's size; the dense weight itself is allocated once.
CHUNK_ELEMENTS = 1 << 22


class LinearScheme:
    """How one quantized linear is stored: the tensors it reads (checkpoint name suffixes after the module's
    prefix), their checks, and its dense weight. A subclass sets `required` and `optional`, and implements
    dense_shape (shapes and dtypes only: it also runs on the meta device, where no value exists), _prepare (the
    checks of values, once) and _rows (the dense rows [start, stop), start a multiple of row_align())."""

    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    # suffixes read and dropped (activation scales of W8A8 schemes: the CPU path computes in the model dtype)
    dropped: tuple[str, ...] = ()
    # suffixes of the format this engine does not read: a module with one is a load error naming it
    refused: tuple[str, ...] = ()
    bits: int = 0

    def describe(self) -> str:
        """bits, group/block size and strategy, for the start line."""
        raise NotImplementedError

    def dense_shape(self, prefix: str, tensors: dict[str, torch.Tensor]) -> tuple[int, ...]:
        """The dense weight's shape ([out, in]), after checking every tensor's shape and dtype."""
        raise NotImplementedError

    def dequantize(self, prefix: str, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The dense weight in `dtype`, after the shape, dtype and value checks, computed in float32 a chunk of
        output rows at a time (CHUNK_ELEMENTS)."""
        n, k = self.dense_shape(prefix, tensors)
        state = self._prepare(prefix, tensors)
        dense = torch.empty((n, k), dtype=dtype)
        align = self.row_align()
        step = max(align, CHUNK_ELEMENTS // k // align * align)
        for start in range(0, n, step):
            stop = min(n, start + step)
            dense[start:stop] = self._rows(prefix, tensors, state, start, stop)
        return dense

    def to_kernel_layout(self, prefix: str, tensors: dict[str, torch.Tensor]):
        """The weight in the GPU kernels' layout (kernel_layout.KernelWeight), after the same checks as
        dequantize; kernel_layout.NoKernelLayout where it has none (the module is then dequantized)."""
        from kvgate.engine.quantization.kernel_layout import NoKernelLayout

        raise NoKernelLayout(f"no kernel layout for {self.describe()}")

    def row_align(self) -> int:
        """Output rows that share a packed word or a scale block: chunks start at multiples of it."""
        return 1

    def _prepare(self, prefix: str, tensors: dict[str, torch.Tensor]) -> dict:
        """The checks of values (scales, indices) and what every chunk uses."""
        raise NotImplementedError

    def _rows(self, prefix: str, tensors: dict[str, torch.Tensor], state: dict, start: int,
              stop: int) -> torch.Tensor:
        """Dense rows [start, stop) in float32."""
        raise NotImplementedError


def tensor_name(prefix: str, suffix: str) -> str:
    return f"{prefix}.{suffix}"


def check_dtype(prefix: str, suffix: str, tensor: torch.Tensor, allowed: tuple[torch.dtype, ...]) -> None:
    if tensor.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise ModelLoadError(f"quantized tensor {tensor_name(prefix, suffix)!r} has dtype "
                             f"{str(tensor.dtype).removeprefix('torch.')}, expected {names}")


def check_shape(prefix: str, suffix: str, tensor: torch.Tensor, expected: tuple[int, ...], why: str = "") -> None:
    if tuple(tensor.shape) != tuple(expected):
        raise ModelLoadError(f"quantized tensor {tensor_name(prefix, suffix)!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(expected)}" + (f" ({why})" if why else ""))


def check_2d(prefix: str, suffix: str, tensor: torch.Tensor) -> tuple[int, int]:
    if tensor.dim() != 2 or 0 in tensor.shape:
        raise ModelLoadError(f"quantized tensor {tensor_name(prefix, suffix)!r} has shape {tuple(tensor.shape)}, "
                             "expected a non-empty matrix")
    return tensor.shape[0], tensor.shape[1]


def check_scales(prefix: str, suffix: str, scale: torch.Tensor) -> torch.Tensor:
    """The scales as float32, each finite and > 0 (no writer of these formats stores a zero, negative or
    non-finite scale: their quantizers clamp the range away from zero)."""
    if scale.numel() == 0:
        raise ModelLoadError(f"quantized tensor {tensor_name(prefix, suffix)!r} is empty (shape "
                             f"{tuple(scale.shape)})")
    values = scale.float()
    bad = ~(torch.isfinite(values) & (values > 0))
    if bool(bad.any()):
        first = values[bad].flatten()[0].item()
        raise ModelLoadError(f"quantized tensor {tensor_name(prefix, suffix)!r} has {int(bad.sum())} scale(s) that "
                             f"are not finite and > 0 (e.g. {first})")
    return values


def check_bits(key: str, bits, allowed: tuple[int, ...] = (4, 8)) -> int:
    if not (isinstance(bits, int) and not isinstance(bits, bool) and bits in allowed):
        raise ModelLoadError(f"quantization_config.{key} is {bits!r}: supported {', '.join(map(str, allowed))}")
    return bits


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, count: int) -> torch.Tensor:
    """The `bits`-bit unsigned fields of int32 words, element i of the packed dim at word i // (32 / bits), bits
    [bits * (i % (32 / bits)), ...) (little-end first): the order GPTQ and compressed-tensors write; `count`
    elements along `dim` (the rest of the last word is padding). Returned as int32 in [0, 2**bits)."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    words = packed.to(torch.int32).movedim(dim, -1)
    fields = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    fields = fields.flatten(-2)[..., :count]
    return fields.movedim(-1, dim)


def packed_count(count: int, bits: int) -> int:
    """int32 words that hold `count` fields of `bits` bits."""
    return -(-count * bits // 32)
