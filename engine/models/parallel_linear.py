"""Tensor-parallel layers (the scheme of vLLM's linear.py and vocab_parallel_embedding.py).

Each rank holds a slice of a layer's weight:
- column-parallel (QKVParallelLinear, MergedColumnParallelLinear): a slice of the output features; each rank's
  output is its slice of the activations, which the next row-parallel layer takes as its input as they are.
  QKV is sliced by heads: each rank has num_heads / N query heads and num_kv_heads / N KV heads, or, when there are
  fewer KV heads than ranks, the one KV head its query heads use (replicated over N / num_kv_heads ranks).
- row-parallel (RowParallelLinear: o_proj, down_proj): a slice of the input features; the ranks' partial products
  are summed by an all-reduce, then the bias (whole on every rank) is added once.
- vocab-parallel (VocabParallelEmbedding, ParallelLMHead): a slice of the vocabulary rows, ceil(V / N) per rank
  (the last rank's padded past V); the embedding looks up the ids in its slice and zeroes the others before an
  all-reduce, the LM head computes its slice of the logits and all-gathers them.

The factories return the plain torch module when the group has size 1, so a model without tensor parallelism is
built, loaded and run exactly as before. Each parallel layer has `shard_weight(param, dest, tensor, shard)`: the
model's load_weights hands it the whole checkpoint tensor and its destination and gets back this rank's slice of
both (a view of the memory-mapped file: nothing else of it is read).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvgate.common.errors import ModelLoadError
from kvgate.engine.distributed.group import TensorParallelGroup


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_evenly(total: int, tp: TensorParallelGroup, what: str) -> int:
    """total / N, or a ModelLoadError naming the config key when N does not divide it."""
    if total % tp.size:
        raise ModelLoadError(f"{what} ({total}) is not divisible by tensor_parallel_size {tp.size}")
    return total // tp.size


def attention_heads(num_heads: int, num_kv_heads: int, tp: TensorParallelGroup) -> tuple[int, int, int]:
    """(query heads, KV heads, first KV head) of this rank. KV heads are split when there are at least N of them,
    else replicated: rank r holds KV head r * num_kv_heads // N, the one its query heads attend with."""
    heads = split_evenly(num_heads, tp, "num_attention_heads")
    if num_kv_heads >= tp.size:
        kv = split_evenly(num_kv_heads, tp, "num_key_value_heads")
        return heads, kv, tp.rank * kv
    if tp.size % num_kv_heads:
        raise ModelLoadError(f"tensor_parallel_size {tp.size} is not a multiple of num_key_value_heads "
                             f"({num_kv_heads}), so the KV heads cannot be replicated evenly")
    return heads, 1, tp.rank * num_kv_heads // tp.size


class QKVParallelLinear(nn.Module):
    """The fused q/k/v projection, column-parallel by heads: [q heads | k heads | v heads] of this rank."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp, self.head_dim = tp, head_dim
        self.num_heads, self.num_kv_heads, self.kv_start = attention_heads(num_heads, num_kv_heads, tp)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.weight = nn.Parameter(torch.empty(out, hidden_size))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def shard_weight(self, param: str, dest: torch.Tensor, tensor: torch.Tensor, shard) -> tuple:
        d = self.head_dim
        if shard == "q":
            return dest, tensor.narrow(0, self.tp.rank * self.num_heads * d, self.num_heads * d)
        return dest, tensor.narrow(0, self.kv_start * d, self.num_kv_heads * d)


class MergedColumnParallelLinear(nn.Module):
    """Two projections of `size` outputs each fused (gate and up), each split column-parallel: [gate | up] rows of
    this rank."""

    def __init__(self, in_features: int, size: int, bias: bool, tp: TensorParallelGroup, what: str) -> None:
        super().__init__()
        self.tp = tp
        self.local_size = split_evenly(size, tp, what)
        self.weight = nn.Parameter(torch.empty(2 * self.local_size, in_features))
        self.bias = nn.Parameter(torch.empty(2 * self.local_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def shard_weight(self, param: str, dest: torch.Tensor, tensor: torch.Tensor, shard) -> tuple:
        return dest, tensor.narrow(0, self.tp.rank * self.local_size, self.local_size)


class RowParallelLinear(nn.Module):
    """This rank's slice of the input features; the partial outputs all-reduced, then the bias added."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup, what: str) -> None:
        super().__init__()
        self.tp = tp
        self.local_in = split_evenly(in_features, tp, what)
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def shard_weight(self, param: str, dest: torch.Tensor, tensor: torch.Tensor, shard) -> tuple:
        if param == "bias":
            return dest, tensor
        return dest, tensor.narrow(1, self.tp.rank * self.local_in, self.local_in)


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows [start, start + valid) of this rank, in a weight of ceil(V / N) rows (rows past `valid`
    are padding: never looked up, their logits cut off)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup) -> None:
        super().__init__()
        self.tp, self.vocab_size = tp, num_embeddings
        self.rows = cdiv(num_embeddings, tp.size)
        self.start = tp.rank * self.rows
        self.valid = max(0, min(self.rows, num_embeddings - self.start))
        self.weight = nn.Parameter(torch.empty(self.rows, embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.valid)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(x)

    def shard_weight(self, param: str, dest: torch.Tensor, tensor: torch.Tensor, shard) -> tuple:
        return dest[:self.valid], tensor.narrow(0, self.start, self.valid)

    def checkpoint_numel(self, param: str) -> int:
        """Elements of `param` the checkpoint writes (the padding rows are not in it)."""
        return self.valid * self.weight.shape[1]


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head over this rank's vocabulary rows: its logits all-gathered into [T, V] on every rank."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather_last_dim(F.linear(hidden, self.weight))
        return logits[..., :self.vocab_size]


# -- factories: the plain torch module at size 1 ------------------------------------------------------------------


def qkv_linear(hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
               tp: TensorParallelGroup) -> nn.Module:
    if tp.size == 1:
        return nn.Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias=bias)
    return QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, bias, tp)


def merged_column_linear(in_features: int, size: int, bias: bool, tp: TensorParallelGroup,
                         what: str) -> nn.Module:
    if tp.size == 1:
        return nn.Linear(in_features, 2 * size, bias=bias)
    return MergedColumnParallelLinear(in_features, size, bias, tp, what)


def row_linear(in_features: int, out_features: int, bias: bool, tp: TensorParallelGroup, what: str) -> nn.Module:
    if tp.size == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp, what)


def vocab_embedding(num_embeddings: int, embedding_dim: int, tp: TensorParallelGroup) -> nn.Module:
    if tp.size == 1:
        return nn.Embedding(num_embeddings, embedding_dim)
    return VocabParallelEmbedding(num_embeddings, embedding_dim, tp)


def lm_head(hidden_size: int, vocab_size: int, tp: TensorParallelGroup) -> nn.Module:
    if tp.size == 1:
        return nn.Linear(hidden_size, vocab_size, bias=False)
    return ParallelLMHead(vocab_size, hidden_size, tp)
