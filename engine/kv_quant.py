"""The quantized KV cache (`--kv-cache-dtype int8|fp8|fp8_e4m3|fp8_e5m2`): one byte a value, plus a float32
scale per token and KV head.

A token's K (and its V) of one KV head is stored as round(x / s) with s = amax(|x|) over head_dim / qmax (127
for int8, 448 for e4m3, 57344 for e5m2), and s beside it; attention reads x ~= value * s. Scales are per token
and head because a slot is written once, when its token is computed, and never rewritten afterwards (prefix
caching shares full blocks as they are): a per-block or per-tensor scale would have to be known before the
block's later tokens exist. It is also finer than vLLM's per-tensor scales, so no calibration is needed.

Layout per layer: data [2 (K, V), Hkv, num_slots, D] (int8, or uint8 holding fp8 bits: CPU torch cannot
index_copy fp8) and scales [2, Hkv, num_slots] float32. The torch path (attention.py) quantizes with the
functions here; the Triton path (triton_attention.py) quantizes in its store kernel with the same arithmetic
(bit-identical under the interpreter) and dequantizes inside the attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float32
# amax below this (an all-zero head vector) would give a zero scale and 0/0 on quantizing.
MIN_AMAX = 1e-12


@dataclass(frozen=True)
class KVQuant:
    name: str  # canonical: int8, fp8_e4m3 or fp8_e5m2 ("fp8" is vLLM's alias of fp8_e4m3)
    value_dtype: torch.dtype  # what a stored byte means
    storage_dtype: torch.dtype  # what the cache tensor is allocated as
    qmax: float
    # fp8 only, for the Triton store kernel's rounding: mantissa bits and the smallest normal exponent
    mantissa_bits: int = 0
    min_exponent: int = 0


_SPECS = {
    "int8": KVQuant("int8", torch.int8, torch.int8, 127.0),
    "fp8_e4m3": KVQuant("fp8_e4m3", torch.float8_e4m3fn, torch.uint8, 448.0, 3, -6),
    "fp8_e5m2": KVQuant("fp8_e5m2", torch.float8_e5m2, torch.uint8, 57344.0, 2, -14),
}
_SPECS["fp8"] = _SPECS["fp8_e4m3"]


def kv_quant_spec(kv_cache_dtype: str) -> KVQuant | None:
    """A value of config.KV_CACHE_DTYPES -> its quantization; None for auto (the cache in the model's dtype)."""
    if kv_cache_dtype == "auto":
        return None
    return _SPECS[kv_cache_dtype]


def kv_bytes_per_token_head(head_dim: int, model_elem_size: int, spec: KVQuant | None) -> int:
    """Bytes one token's K (or V) of one KV head takes in the cache, its scale included."""
    if spec is None:
        return head_dim * model_elem_size
    return head_dim + SCALE_DTYPE.itemsize


def kv_bytes_per_block(model, num_layers: int, block_size: int, dtype: torch.dtype, spec: KVQuant | None) -> int:
    """K and V of every layer of `model` (its num_kv_heads, head_dim) for one block, a quantized cache's scales
    included: what a block costs the target model's cache and a draft model's alike."""
    per_head = kv_bytes_per_token_head(model.head_dim, torch.empty((), dtype=dtype).element_size(), spec)
    return 2 * num_layers * block_size * model.num_kv_heads * per_head


def allocate_kv_caches(model, num_layers: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                       spec: KVQuant | None, device: torch.device) -> list:
    """One cache per layer, [2, Hkv, num_blocks * block_size, D]: in the model's dtype (spec None) or quantized."""
    shape = (2, model.num_kv_heads, num_blocks * block_size, model.head_dim)
    if spec is None:
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    return [QuantizedKVCache.allocate(shape, spec, device) for _ in range(num_layers)]


def quantize(x: torch.Tensor, spec: KVQuant) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] in spec.storage_dtype, scales [...] float32)."""
    xf = x.float()
    scale = xf.abs().amax(-1).clamp_min(MIN_AMAX) / spec.qmax
    y = (xf / scale[..., None]).clamp(-spec.qmax, spec.qmax)
    if spec.value_dtype == torch.int8:
        return torch.round(y).to(torch.int8), scale
    return y.to(spec.value_dtype).view(spec.storage_dtype), scale


def dequantize(values: torch.Tensor, scales: torch.Tensor, spec: KVQuant, dtype: torch.dtype) -> torch.Tensor:
    """(values [..., D], scales [...]) -> [..., D] in dtype."""
    return (values.view(spec.value_dtype).float() * scales[..., None]).to(dtype)


@dataclass
class QuantizedKVCache:
    """One layer's quantized K/V; models pass it to meta.attend as they pass a plain cache tensor."""

    data: torch.Tensor  # [2, Hkv, num_slots, D] spec.storage_dtype
    scales: torch.Tensor  # [2, Hkv, num_slots] float32
    spec: KVQuant

    @classmethod
    def allocate(cls, shape: tuple[int, int, int, int], spec: KVQuant, device: torch.device) -> QuantizedKVCache:
        return cls(torch.zeros(shape, dtype=spec.storage_dtype, device=device),
                   torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device), spec)

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def values(self) -> torch.Tensor:
        """The data as its value dtype (int8 or fp8), as the Triton kernels load it."""
        return self.data.view(self.spec.value_dtype)

    def store(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> tuple[torch.Tensor,
                                                                                             torch.Tensor]:
        """k, v [T, Hkv, D] -> their slots; returns them dequantized (what a later read of the cache gives), so a
        prefill attending to its own fresh K/V sees the same values as a decode reading them back."""
        out = []
        for i, x in enumerate((k, v)):
            values, scales = quantize(x, self.spec)
            self.data[i].index_copy_(1, slot_mapping, values.transpose(0, 1))
            self.scales[i].index_copy_(1, slot_mapping, scales.transpose(0, 1))
            out.append(dequantize(values, scales, self.spec, x.dtype))
        return out[0], out[1]

    def gather(self, i: int, rows: torch.Tensor, block_size: int, dtype: torch.dtype) -> torch.Tensor:
        """K (i=0) or V (i=1) of the (head, block) rows of attention.block_rows(), dequantized:
        [Hkv, blocks * block_size, D]."""
        hkv, num_slots, d = self.data.shape[1:]
        n = hkv * num_slots // block_size
        values = self.data[i].view(n, block_size * d).index_select(0, rows).view(hkv, -1, d)
        scales = self.scales[i].view(n, block_size).index_select(0, rows).view(hkv, -1)
        return dequantize(values, scales, self.spec, dtype)
