"""Llama (and the shared decoder stack that Mistral, Qwen2, Qwen3 and the MoE families reuse)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
from torch import nn

from kvgate.common.errors import ModelLoadError
from kvgate.engine.models.checkpoint_writes import write_checkpoint
from kvgate.engine.distributed import group as tp_group
from kvgate.engine.models.layer_windows import layer_windows
from kvgate.engine.models.layers import Attention, GatedMLP, RMSNorm
from kvgate.engine.models.parallel_linear import lm_head, vocab_embedding

# checkpoint name piece -> (our fused parameter piece, shard id)
STACKED_PARAMS = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]

# "<prefix>.experts.<expert id>.<projection>.weight": one expert's tensor of a sparse layer's FusedMoE
_EXPERT_TENSOR = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<piece>\w+)\.weight$")


def dense_mlp(config, layer_idx: int) -> nn.Module:
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                    bias=getattr(config, "mlp_bias", False))


class DecoderLayer(nn.Module):
    def __init__(self, config, max_positions: int, qkv_bias: bool, qk_norm: bool, mlp: nn.Module,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(config, max_positions, qkv_bias=qkv_bias, qk_norm=qk_norm,
                                   sliding_window=sliding_window)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, x, kv_cache, meta):
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config, max_positions: int, qkv_bias: bool, qk_norm: bool,
                 make_mlp: Callable[[object, int], nn.Module], windows: list[int | None]) -> None:
        """make_mlp(config, layer index): the layer's MLP (dense, or a sparse MoE block); windows: each layer's
        sliding window (None: full attention)."""
        super().__init__()
        self.embed_tokens = vocab_embedding(config.vocab_size, config.hidden_size, tp_group.current())
        self.layers = nn.ModuleList(
            DecoderLayer(config, max_positions, qkv_bias, qk_norm, make_mlp(config, i), windows[i])
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta):
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(positions, x, kv_cache, meta)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False
    # checkpoint name piece -> ours, applied before any other mapping (Mixtral's block_sparse_moe -> mlp)
    checkpoint_renames: tuple[tuple[str, str], ...] = ()
    # expert tensor's projection name -> (FusedMoE parameter, shard: 0 gate rows / 1 up rows / None all of it)
    expert_params: dict[str, tuple[str, int | None]] = {}

    @staticmethod
    def make_mlp(config, layer_idx: int) -> nn.Module:
        return dense_mlp(config, layer_idx)

    def __init__(self, config, max_positions: int) -> None:
        super().__init__()
        self.config = config
        # each layer's window (layer_windows.py); a window of max_positions or more is full attention
        self.layer_windows = layer_windows(config, max_positions)
        self.model = DecoderModel(config, max_positions, self.qkv_bias, self.qk_norm, self.make_mlp,
                                  self.layer_windows)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = lm_head(config.hidden_size, config.vocab_size, tp_group.current())
        self.tie_weights()
        attn = self.model.layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim

    def tie_weights(self) -> None:
        """Share the embedding with the LM head (again after the module was moved off the meta device)."""
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # -- weights ----------------------------------------------------------------------------------

    def _shard_slice(self, param: torch.Tensor, shard) -> slice:
        if isinstance(shard, int):  # gate/up halves (of a dense MLP's gate_up_proj or an expert's w13 rows)
            size = param.shape[-2] // 2
            return slice(shard * size, (shard + 1) * size)
        attn = self.model.layers[0].self_attn
        q, kv = attn.q_size, attn.kv_size
        return {"q": slice(0, q), "k": slice(q, q + kv), "v": slice(q + kv, q + 2 * kv)}[shard]

    def _destination(self, name: str, tensor: torch.Tensor, params: dict[str, nn.Parameter],
                     sharded: dict[str, nn.Module]) -> tuple[str, torch.Tensor | None, torch.Tensor]:
        """(coverage key, the parameter slice it fills, the part of the tensor that fills it) of checkpoint tensor
        `name`: its parameter, its rows of a fused one (qkv_proj, gate_up_proj), or its expert's slice of a
        FusedMoE's stacked weight; None for a tensor the model does not have. sharded: the tensor-parallel modules
        by name (parallel_linear.py; empty without tensor parallelism), whose shard_weight cuts this rank's slice of
        the tensor and of its destination."""
        for piece, ours in self.checkpoint_renames:
            name = name.replace(piece, ours)
        expert = _EXPERT_TENSOR.match(name)
        if expert and expert["piece"] in self.expert_params:
            fused, shard = self.expert_params[expert["piece"]]
            target, index = f"{expert['prefix']}.{fused}", int(expert["expert"])
            param = params.get(target)
            if param is not None and index < param.shape[0]:
                dest = param.data[index]
                rows = slice(None) if shard is None else self._shard_slice(dest, shard)
                dest, tensor = _rank_slice(sharded, target, dest[rows], tensor, shard)
                return _expert_key(target, index), dest, tensor
            return target, None, tensor
        for fused, piece, shard in STACKED_PARAMS:
            if f".{piece}." in name:
                target = name.replace(piece, fused)
                param = params.get(target)
                if param is None:
                    return target, None, tensor
                dest, tensor = _rank_slice(sharded, target, param.data[self._shard_slice(param, shard)], tensor, shard)
                return target, dest, tensor
        param = params.get(name)
        if param is None:
            return name, None, tensor
        dest, tensor = _rank_slice(sharded, name, param.data, tensor, None)
        return name, dest, tensor

    def _expected_coverage(self, params: dict[str, nn.Parameter]) -> dict[str, int]:
        """Coverage key -> elements the checkpoint must write: one key per parameter, one per expert of a
        FusedMoE's stacked weights (so a missing expert is named)."""
        stacked = {fused for fused, _ in self.expert_params.values()}
        expected = {}
        for name, p in params.items():
            if name.rsplit(".", 1)[-1] in stacked:
                expected |= {_expert_key(name, e): p[e].numel() for e in range(p.shape[0])}
            else:
                prefix, _, short = name.rpartition(".")
                module = self.get_submodule(prefix) if prefix else self
                counted = getattr(module, "checkpoint_numel", None)  # a vocab-parallel layer's padding is not read
                expected[name] = p.numel() if counted is None else counted(short)
        if self.tie_word_embeddings:
            expected.pop("lm_head.weight", None)
        return expected

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                     copy: Callable[[str, torch.Tensor, torch.Tensor], None] | None = None) -> None:
        """Write checkpoint tensors (HF names, any dtype) into the parameters: each one lands in its parameter,
        or its rows of a fused one, with one copy (dtype conversion included). copy(name, dest, tensor), when
        given, does that copy instead of dest.copy_(tensor) (engine/loader.py's may queue it on a thread pool)."""
        params = dict(self.named_parameters())
        sharded = {name: m for name, m in self.named_modules() if hasattr(m, "shard_weight")}
        tied_head = self.tie_word_embeddings

        def place(name: str, tensor: torch.Tensor):
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and tied_head):
                return None
            return self._destination(name, tensor, params, sharded)

        # every element of every parameter written exactly once
        write_checkpoint(weights, place, self._expected_coverage(params), type(self).__name__, copy)


def _rank_slice(sharded: dict[str, nn.Module], param_name: str, dest: torch.Tensor, tensor: torch.Tensor,
                shard) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of (dest, tensor) when the parameter's module is tensor-parallel, else both as they are."""
    prefix, _, short = param_name.rpartition(".")
    module = sharded.get(prefix)
    return (dest, tensor) if module is None else module.shard_weight(short, dest, tensor, shard)


def _expert_key(param_name: str, expert: int) -> str:
    return f"{param_name}[expert {expert}]"
