"""LoRA on the model's projections, for a batch that mixes adapters: one forward pass, base weights applied once.

Each projection keeps, per adapter slot, its adapters' A and B stacked: A [P*R, in] and B [out, P*R] for a fused
projection of P pieces (qkv_proj: q, k, v; gate_up_proj: gate, up), R = max_lora_rank, ranks below R zero-padded,
each piece's B block writing only its own output rows, the scaling folded into B. The runner says per step which
token rows use which slot (`LoRAState.groups`, rows grouped by slot), and each projection adds

    y[rows] += (x[rows] @ A[slot]^T) @ B[slot]^T          for every slot in the batch that targets it

— two small matmuls per slot (at most --max-loras), never a forward per adapter. Rows of base-model requests are
in no group and cost nothing; a batch without adapters costs one empty loop per projection.
"""

from __future__ import annotations

import torch
from torch import nn

from kvgate.common.errors import ConfigError
from kvgate.engine.lora.adapter import LoRAWeights


class LoRAState:
    """The current step's adapter rows, shared by every LoRA projection of one model."""

    def __init__(self) -> None:
        self.groups: list[tuple[int, torch.Tensor]] = []  # (slot, token row indices)


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, pieces: list[tuple[str, int, int]], state: LoRAState, max_loras: int,
                 max_rank: int) -> None:
        """`pieces`: (PEFT module name, first output row, rows) of each piece of the fused projection."""
        super().__init__()
        self.base = base
        self.pieces = pieces
        self.state = state
        self.max_rank = max_rank
        weight = base.weight
        width = len(pieces) * max_rank
        self.register_buffer("lora_a", torch.zeros(max_loras, width, weight.shape[1], dtype=weight.dtype,
                                                   device=weight.device), persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, weight.shape[0], width, dtype=weight.dtype,
                                                   device=weight.device), persistent=False)
        self.targeted: set[int] = set()  # slots whose adapter targets one of this projection's pieces

    def set_slot(self, slot: int, layer_weights: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one layer's weights of an adapter ({module name: (A, B)}) in `slot` ({}: empty it)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.targeted.discard(slot)
        for p, (name, start, rows) in enumerate(self.pieces):
            if name not in layer_weights:
                continue
            a, b = layer_weights[name]
            r, col = a.shape[0], p * self.max_rank
            self.lora_a[slot, col:col + r].copy_(a)
            self.lora_b[slot, start:start + rows, col:col + r].copy_(b)
            self.targeted.add(slot)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, rows in self.state.groups:
            if slot in self.targeted:
                xs = x.index_select(0, rows)
                y.index_add_(0, rows, (xs @ self.lora_a[slot].t()) @ self.lora_b[slot].t())
        return y


def add_lora_layers(model: nn.Module, max_loras: int, max_rank: int) -> tuple[LoRAState, list[dict[str, LoRALinear]]]:
    """Wrap every decoder layer's projections (after the base weights are loaded); returns the shared state and,
    per layer, {"qkv_proj" | "o_proj" | "gate_up_proj" | "down_proj": its LoRALinear}."""
    if not getattr(model, "supports_lora", True):
        raise ConfigError(f"LoRA is not supported for {getattr(model, 'architecture', type(model).__name__)} on the "
                          "transformers fallback: only the native families serve adapters")
    if any(not hasattr(layer.mlp, "gate_up_proj") for layer in model.model.layers):
        raise ConfigError(f"LoRA is not supported for {type(model).__name__}: its mixture-of-experts layers have "
                          "no single gate/up/down projection to adapt")
    state = LoRAState()
    layers = []
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
        hidden = attn.o_proj.weight.shape[0]
        wrapped = {
            "qkv_proj": LoRALinear(attn.qkv_proj, [("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)],
                                   state, max_loras, max_rank),
            "o_proj": LoRALinear(attn.o_proj, [("o_proj", 0, hidden)], state, max_loras, max_rank),
            "gate_up_proj": LoRALinear(mlp.gate_up_proj, [("gate_proj", 0, inter), ("up_proj", inter, inter)],
                                       state, max_loras, max_rank),
            "down_proj": LoRALinear(mlp.down_proj, [("down_proj", 0, hidden)], state, max_loras, max_rank),
        }
        attn.qkv_proj, attn.o_proj = wrapped["qkv_proj"], wrapped["o_proj"]
        mlp.gate_up_proj, mlp.down_proj = wrapped["gate_up_proj"], wrapped["down_proj"]
        layers.append(wrapped)
    return state, layers


def module_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each PEFT module name, for checking an adapter against this model."""
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    hidden = model.config.hidden_size
    q, kv, inter = attn.q_size, attn.kv_size, mlp.intermediate_size
    return {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def set_slot(layers: list[dict[str, LoRALinear]], slot: int, adapter: LoRAWeights | None) -> None:
    """Load `adapter` into `slot` of every projection (None: empty the slot)."""
    for i, wrapped in enumerate(layers):
        layer_weights = {} if adapter is None else {m: ab for (layer, m), ab in adapter.weights.items() if layer == i}
        for projection in wrapped.values():
            projection.set_slot(slot, layer_weights)
