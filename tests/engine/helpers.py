"""Builders for the scheduler's unit tests: a scheduler over its own KV cache, requests with only the fields a
test cares about, and one step of the engine loop with every sampled token the same."""

from __future__ import annotations

from kvgate.engine.kv_cache_manager import KVCacheManager
from kvgate.engine.request import Request
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.scheduler import Scheduler


def scheduler(num_blocks: int = 64, block_size: int = 4, *, caching: bool = True, max_num_seqs: int = 8,
              max_num_batched_tokens: int = 32, **kw) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(kv, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, **kw)


def request(rid: str, tokens, *, priority: int = 0, max_tokens: int = 100, **sampling) -> Request:
    """tokens: the prompt's ids, or a count of ids of the request's own (rids of other lengths share none)."""
    if isinstance(tokens, int):
        tokens = range(1000 * len(rid), 1000 * len(rid) + tokens)
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, **sampling), priority=priority,
                   max_model_len=256)


def sampled(out, token: int) -> dict[str, int]:
    """The engine's output for a scheduler step: `token` for every request that samples in it."""
    return {x.request.request_id: token for x in out.scheduled if x.samples}


def step(s: Scheduler, token: int = 7):
    """Schedule one step and feed its output straight back (synchronous scheduling)."""
    out = s.schedule()
    s.update_from_output(out, sampled(out, token))
    return out
