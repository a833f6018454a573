"""CUDA graphs of the whole forward pass, captured at start for a set of padded step sizes.

A step's forward runs as one graph replay instead of hundreds of kernel launches (28 layers x a dozen kernels
for a 0.5B model). Two kinds of graph per size, because the attention kernel's tile depends on it
(triton_attention.query_tile): decode-only steps (one token per sequence, sizes up to max_num_seqs) and mixed steps
(decodes with prefill chunks, sizes up to max_cudagraph_capture_size). The Triton attention kernel's grid depends
only on the padded token and sequence counts, so one graph serves every mix of sequences of its size. A step
pads its tokens to the next captured size (steps larger than the largest run eagerly: their kernels are big
enough for launches not to matter). Graphs share one memory pool, captured largest first as PyTorch advises.

Everything the graph reads lives in the runner's persistent buffers (step_inputs.py), written before each replay.
LoRA batches run eagerly (their per-adapter row groups change shape every step); sampling, logprobs and
structured-output masks run after the forward pass, outside the graph, so they need no fallback.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)

# vLLM captures up to 512 tokens; a step of 256 decodes that admits two prompts of a few hundred tokens is past
# that, and such steps are every few steps at steady state, so mixed graphs go to 1024 tokens by default.
DEFAULT_MAX_CAPTURE_SIZE = 1024


def decode_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes of decode graphs: 1, 2, 4, 8, then every 8 up to max_num_seqs (padding wastes at most 7 rows)."""
    sizes = [s for s in (1, 2, 4) if s < max_num_seqs] + list(range(8, max_num_seqs + 1, 8))
    if not sizes or sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


def mixed_sizes(max_tokens: int) -> list[int]:
    """Token counts of mixed graphs: every 64 up to 512, then every 128."""
    sizes = list(range(64, min(max_tokens, 512) + 1, 64)) + list(range(640, max_tokens + 1, 128))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sizes


def pick_size(sizes: list[int], n: int) -> int | None:
    """The smallest captured size holding n rows, or None."""
    for s in sizes:
        if s >= n:
            return s
    return None


class GraphSet:
    """Captured forwards keyed by (padded tokens, decode_only); see the module doc."""

    def __init__(self, max_num_seqs: int, max_capture_size: int) -> None:
        self.decode = decode_sizes(max_num_seqs)
        self.mixed = mixed_sizes(max_capture_size) if max_capture_size > 0 else []
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def size_for(self, num_tokens: int, decode_only: bool) -> int | None:
        return pick_size(self.decode if decode_only else self.mixed, num_tokens)

    def capture(self, fill: Callable[[int, bool], None], forward: Callable[[int, bool], torch.Tensor],
                device: torch.device) -> None:
        """fill(padded_tokens, decode_only) writes a step of padding into the runner's static buffers (host to
        device copies: not allowed while capturing); forward(padded_tokens, decode_only) runs the model on them."""
        t0 = time.perf_counter()
        # Cached free blocks released on both sides, so the difference is what the graphs hold (a bench run after
        # another engine, as `kvgate bench engine --compare-sync` makes, printed -0.49 GiB without this).
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(device)[0]
        pool = torch.cuda.graph_pool_handle()
        keys = [(n, False) for n in self.mixed] + [(n, True) for n in self.decode]
        for key in sorted(keys, key=lambda k: -k[0]):
            fill(*key)
            forward(*key)  # compiles the Triton kernels for this tile and warms the allocator
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = forward(*key)
            self.graphs[key] = (graph, out)
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - t0
        torch.cuda.empty_cache()
        self.capture_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        log.info("CUDA graphs: captured %d (decode batch sizes %d-%d, mixed steps %s tokens) in %.1f s, %.2f GiB",
                 len(self.graphs), self.decode[0], self.decode[-1],
                 f"{self.mixed[0]}-{self.mixed[-1]}" if self.mixed else "none", self.capture_seconds,
                 self.capture_bytes / 2**30)

    def replay(self, padded_tokens: int, decode_only: bool) -> torch.Tensor:
        graph, out = self.graphs[(padded_tokens, decode_only)]
        graph.replay()
        return out
