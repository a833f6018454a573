"""Layers shared by the decoder-only model families (numerics follow HF transformers' implementations)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from kvgate.engine.distributed import group as tp_group
from kvgate.engine.models.parallel_linear import attention_heads, merged_column_linear, qkv_linear, row_linear

# kvgate.engine.triton_ops, imported by use_fused_kernels: only the GPU path imports triton (on CPU its kernels run
# under the interpreter, which must be chosen before triton is first imported)
triton_ops = None


def use_fused_kernels(model: nn.Module) -> None:
    """Switch the model's norms, RoPE and MLP activations to triton_ops.py's fused kernels and its MoE experts to
    triton_moe.py's (the GPU path)."""
    global triton_ops
    from kvgate.engine import triton_ops as ops
    from kvgate.engine.models.moe import FusedMoE
    from kvgate.engine.triton_moe import triton_experts

    triton_ops = ops
    for module in model.modules():
        if isinstance(module, (RMSNorm, RotaryEmbedding, GatedMLP)):
            module.fused = True
        elif isinstance(module, FusedMoE):
            module.experts_fn = triton_experts


class RMSNorm(nn.Module):
    fused = False  # triton_ops.rms_norm instead of the torch ops (use_fused_kernels)

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return triton_ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_parameters(config) -> dict:
    """RoPE settings from either transformers v5 (`rope_parameters`) or v4 (`rope_theta` + `rope_scaling`)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding(nn.Module):
    """Neox-style RoPE with a cos/sin table over all positions; scaled variants use transformers' own init."""

    fused = False  # triton_ops.rope (use_fused_kernels)

    def __init__(self, config, head_dim: int, max_positions: int) -> None:
        super().__init__()
        params = rope_parameters(config)
        rope_type = params["rope_type"]
        with torch.device("cpu"):  # real tables even while the model is built on the meta device
            inv_freq, scaling = self._inv_freq_and_scaling(config, params, rope_type, head_dim)
        self.rotary_dim = inv_freq.shape[0] * 2
        self._inv_freq, self._scaling, self._max_positions = inv_freq.float(), scaling, max_positions
        with torch.device("cpu"):
            self.reset_buffers(torch.device("cpu"))

    @staticmethod
    def _inv_freq_and_scaling(config, params: dict, rope_type: str, head_dim: int):
        if rope_type == "default":
            dim = int(head_dim * params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)))
            inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            scaling = 1.0
        elif rope_type == "dynamic":
            raise NotImplementedError("dynamic NTK RoPE scaling is not supported (its frequencies depend on length)")
        elif rope_type in ROPE_INIT_FUNCTIONS:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
        else:
            raise NotImplementedError(f"unknown RoPE type {rope_type!r}")
        return inv_freq, scaling

    def reset_buffers(self, device: torch.device) -> None:
        """(Re)build the cos/sin tables; needed after the model was created on the meta device."""
        positions = torch.arange(self._max_positions, dtype=torch.int64, device=device).float()
        freqs = positions[:, None] * self._inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * self._scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * self._scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D]."""
        if self.fused:
            return triton_ops.rope(positions, q, k, self.cos, self.sin, self.rotary_dim)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return _apply_rope(q, cos, sin, self.rotary_dim), _apply_rope(k, cos, sin, self.rotary_dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


class Attention(nn.Module):
    """GQA self-attention with a fused qkv projection, optional qkv bias (Qwen2), q/k norm (Qwen3) and an optional
    sliding window (its layer's, which the step's metadata masks by). Under tensor
    parallelism (distributed/group.py's current group) num_heads and num_kv_heads are this rank's heads."""

    def __init__(self, config, max_positions: int, qkv_bias: bool = False, qk_norm: bool = False,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.sliding_window = sliding_window  # this layer's: the most recent keys a query sees (None: all)
        tp = tp_group.current()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        self.num_heads, self.num_kv_heads, _ = attention_heads(total_heads, total_kv_heads, tp)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        bias = qkv_bias or getattr(config, "attention_bias", False)
        self.qkv_proj = qkv_linear(config.hidden_size, self.head_dim, total_heads, total_kv_heads, bias, tp)
        self.o_proj = row_linear(total_heads * self.head_dim, config.hidden_size,
                                 getattr(config, "attention_bias", False), tp, "num_attention_heads * head_dim")
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, max_positions)
        if qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, positions, x, kv_cache, meta) -> torch.Tensor:
        """meta: the step's attention metadata (attention.py's SDPA path or triton_attention.py's kernels)."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary_emb(positions, q, k)
        o = meta.attend(q, k, v, kv_cache, self.scale, self.sliding_window)
        return self.o_proj(o.reshape(-1, self.q_size))


class GatedMLP(nn.Module):
    """SwiGLU: down(act(gate(x)) * up(x)) with gate and up fused (under tensor parallelism: this rank's slice of the
    intermediate features, the down projection all-reduced)."""

    fused = False  # triton_ops.silu_and_mul (use_fused_kernels)

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        if hidden_act not in ("silu", "swish"):
            raise NotImplementedError(f"MLP activation {hidden_act!r} is not supported")
        tp = tp_group.current()
        self.gate_up_proj = merged_column_linear(hidden_size, intermediate_size, bias, tp, "intermediate_size")
        self.down_proj = row_linear(intermediate_size, hidden_size, bias, tp, "intermediate_size")
        self.intermediate_size = intermediate_size // tp.size  # this rank's (split_evenly checked it divides)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.down_proj(triton_ops.silu_and_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
