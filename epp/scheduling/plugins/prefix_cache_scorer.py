"""prefix-cache-scorer: approximate prefix-cache affinity, as upstream's EPP does it (no engine tokenizer needed).

The prompt's UTF-8 bytes are cut into blocks of `blockSize` characters and hashed as a chain rooted at the target
model and cache salt (epp/prefix/hashing.py). Each endpoint has an LRU index of the blocks of requests sent to it
(epp/prefix/approx_index.py); `pre_request` inserts the picked endpoint's blocks. The score is the cached
fraction of the prompt:

    score(e) = (leading blocks h_0..h_k-1 all found in e's index) / (number of prompt blocks)

With `autoTune` (upstream's default) the block size follows the endpoints' KV block size (tokens × 4 chars), and
an endpoint's index holds as many blocks as its engine's KV cache (`vllm:cache_config_info` num_gpu_blocks ×
block_size tokens, in index blocks); otherwise, or when the engine does not report it, `lruCapacityPerServer`.
The whole index is also held under `indexMaxBytes` (flag `kvgate epp --prefix-index-max-bytes`): past it, the
least recently used entries of the whole index go first, whichever endpoint holds them.

The scoring work (hashes, matches) stays in the cycle state for `pre_request`, which adds the picked endpoint's
blocks without hashing the prompt again. It also produces the cycle's prefix match (PREFIX_MATCH, scheduling/prefix_match.py)
for load-aware plugins, from the same match:

    prompt_tokens      = UTF-8 bytes / CHARS_PER_TOKEN                                  (an estimate)
    cached(e)          = min(matched blocks(e) × block characters / CHARS_PER_TOKEN, prompt_tokens)
"""

from __future__ import annotations

from itertools import repeat
from operator import attrgetter

import numpy as np

from kvgate.epp.prefix.approx_index import DEFAULT_INDEX_MAX_BYTES, MIN_INDEX_BYTES, PrefixIndex, Runs
from kvgate.epp.prefix.endpoint_ids import mask_to_bools
from kvgate.epp.prefix.hashing import PromptHasher
from kvgate.epp.scheduling.framework import CycleState, PluginContext, Scorer
from kvgate.epp.scheduling.plugins._params import bool_param, check_keys, int_param
from kvgate.epp.scheduling.prefix_match import PREFIX_MATCH, PrefixMatch
from kvgate.epp.types import EndpointState, LLMRequest

_address_of = attrgetter("endpoint.address")

DEFAULT_BLOCK_SIZE = 64  # characters: 16 tokens × ~4 characters per token
DEFAULT_MAX_PREFIX_BLOCKS = 256
DEFAULT_LRU_CAPACITY_PER_SERVER = 31250  # upstream's sizing: ~500K cached tokens / 16 per block
CHARS_PER_TOKEN = 4
MAX_PEER_CAPACITY = 1 << 31  # a peer's per-endpoint LRU capacity past this is not an engine's (peer_pick drops it)


class PrefixCacheScorer(Scorer):
    type_name = "prefix-cache-scorer"
    stats_group = "prefix_index"
    produces = (PREFIX_MATCH,)  # from the same match as its score

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, max_prefix_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS,
                 lru_capacity_per_server: int = DEFAULT_LRU_CAPACITY_PER_SERVER, auto_tune: bool = True,
                 index_max_bytes: int = DEFAULT_INDEX_MAX_BYTES) -> None:
        super().__init__()
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.auto_tune = auto_tune
        self.index = PrefixIndex(lru_capacity_per_server, index_max_bytes)
        self.hasher = PromptHasher()
        self.hit_blocks = 0
        self.total_blocks = 0

    def block_size_for(self, endpoints: list[EndpointState]) -> int:
        if self.auto_tune:
            for e in endpoints:  # a pool's endpoints share one engine config
                if e.metrics.kv_block_size:
                    return e.metrics.kv_block_size * CHARS_PER_TOKEN
        return self.block_size

    def capacity_for(self, endpoint: EndpointState) -> int:
        """Index blocks `endpoint` can hold: its engine's KV cache in tokens / tokens per index block."""
        tokens = endpoint.metrics.kv_cache_tokens
        if self.auto_tune and tokens:
            return max(1, tokens * CHARS_PER_TOKEN // self.block_size_for([endpoint]))
        return self.index.capacity

    def hashes(self, request: LLMRequest, endpoints: list[EndpointState]) -> list[int]:
        return self.hasher.hashes(request.prompt, request.target_model, request.cache_salt,
                                  self.block_size_for(endpoints), self.max_prefix_blocks)

    def _match(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None
               ) -> tuple[list[int], Runs, np.ndarray | None]:
        """(hashes, runs, cached fraction by index id + a last 0 slot; None when no run), once per cycle: the
        scorer, the prefix match it produces and the pick hook share one hashing and one match."""
        found = cycle.get(self) if cycle is not None else None
        if found is not None:
            return found
        hashes = self.hashes(request, endpoints)
        runs = self.index.match_runs(hashes)
        by_id = None
        if runs:
            count = self.index.id_count
            by_id = np.zeros(count + 1)  # the last slot: endpoints the index does not know (score 0)
            total = len(hashes)
            for mask, n in runs:
                by_id[:count][mask_to_bools(mask, count)] = n / total
        found = (hashes, runs, by_id)
        if cycle is not None:
            cycle[self] = found
        return found

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> np.ndarray:
        _, _, by_id = self._match(request, endpoints, cycle)
        if by_id is None:
            return np.zeros(len(endpoints))
        # (no id can be newer than the match here: the index only grows in pick hooks, after scoring)
        return by_id[self._snapshot_ids(cycle, endpoints)]

    # -- the prefix match (scheduling/prefix_match.py): what load-aware plugins weigh a hit with ----------

    def produce(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState) -> None:
        cycle.put(self, PREFIX_MATCH, PrefixMatch.over(self.prompt_tokens(request, cycle), endpoints,
                                                       self.cached_tokens(request, endpoints, cycle)))

    def prompt_tokens(self, request: LLMRequest, cycle: CycleState | None = None) -> int:
        """The prompt's length in tokens, estimated as this scorer counts them: UTF-8 bytes / CHARS_PER_TOKEN."""
        return max(1, len(request.prompt.encode()) // CHARS_PER_TOKEN)

    def cached_tokens(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
                      ) -> np.ndarray:
        """Estimated prompt tokens each endpoint holds: its matched blocks × block characters / CHARS_PER_TOKEN
        (≤ prompt_tokens: blocks are whole blocks of the prompt's bytes)."""
        hashes, _, by_id = self._match(request, endpoints, cycle)
        if by_id is None:
            return np.zeros(len(endpoints))
        ids = self._snapshot_ids(cycle, endpoints)
        if ids.size and ids.max() >= by_id.size:  # an id given out after the match (a new endpoint) holds none
            ids = np.minimum(ids, by_id.size - 1)
        blocks = np.rint(by_id[ids] * len(hashes))  # the fraction back to whole blocks
        return np.minimum(blocks * self.block_size_for(endpoints) // CHARS_PER_TOKEN, self.prompt_tokens(request))

    def _snapshot_ids(self, cycle: CycleState | None, endpoints: list[EndpointState]) -> np.ndarray:
        """_ids_by_position, cached in the cycle's snapshot until the index's ids change (one entry, replaced)."""
        snap = cycle.snapshot if cycle is not None else None
        if snap is None or snap.endpoints is not endpoints:
            return self._ids_by_position(endpoints)
        epoch = self.index.id_epoch
        cached = snap.memo.get(self)
        if cached is None or cached[0] != epoch:
            cached = snap.memo[self] = (epoch, self._ids_by_position(endpoints))
        return cached[1]

    def _ids_by_position(self, endpoints: list[EndpointState]) -> np.ndarray:
        """Position in `endpoints` → index id (id_count: unknown to the index)."""
        unknown = repeat(self.index.id_count)
        return np.fromiter(map(self.index.ids.by_address.get, map(_address_of, endpoints), unknown), dtype=np.intp,
                           count=len(endpoints))

    def pre_request(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None) -> None:
        scored = cycle.get(self) if cycle is not None else None
        if scored is None:  # scheduled without a cycle state (or this scorer did not run): recompute
            hashes = self.hashes(request, [endpoint])
            runs = self.index.match_runs(hashes)
        else:
            hashes, runs, _ = scored
        eid = self.index.id_of(endpoint.address)
        matched = next((n for mask, n in runs if mask >> eid & 1), 0) if eid is not None else 0
        self.hit_blocks += matched
        self.total_blocks += len(hashes)
        self.index.add(hashes, endpoint.address, self.capacity_for(endpoint))

    # Active-active (epp/peer_sync.py): a peer's pick teaches this replica's index as its own does, so that
    # replicas learn one history — the divergence for which upstream warns against active-active with this scorer.
    def share_pick(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None
                   ) -> list[int] | None:
        scored = cycle.get(self) if cycle is not None else None
        hashes = scored[0] if scored is not None else self.hashes(request, [endpoint])
        return [self.capacity_for(endpoint), *hashes] if hashes else None

    def peer_pick(self, pick_id: str, address: str, shared: list[int]) -> None:
        if len(shared) >= 2 and 1 <= shared[0] <= MAX_PEER_CAPACITY:
            self.index.add(shared[1:], address, shared[0])

    def remove_endpoint(self, address: str) -> None:
        self.index.remove(address)

    def start(self, ctx: PluginContext) -> None:
        if ctx.prefix_index_max_bytes is not None:  # `kvgate epp --prefix-index-max-bytes` overrides indexMaxBytes
            self.index.set_max_bytes(ctx.prefix_index_max_bytes)

    def stats(self) -> dict[str, float]:
        """For the EPP's metrics: index entries and budget, endpoints indexed, final picks' blocks (hit and all)."""
        return {
            "index_size": self.index.size(),
            "index_max_entries": self.index.max_entries,
            "index_evictions": self.index.evictions,
            "indexed_endpoints": len(self.index.endpoints()),
            "hit_blocks": self.hit_blocks,
            "total_blocks": self.total_blocks,
        }

    def hit_ratio(self) -> float:
        """Blocks of final picks' prompts found on the picked endpoint / blocks looked up."""
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


def factory(parameters: dict | None) -> PrefixCacheScorer:
    t = PrefixCacheScorer.type_name
    params = check_keys(parameters, {"blockSize", "blockSizeTokens", "maxPrefixBlocksToMatch",
                                     "maxPrefixTokensToMatch", "lruCapacityPerServer", "autoTune",
                                     "indexMaxBytes"}, t)
    block_size = int_param(params, "blockSize", DEFAULT_BLOCK_SIZE, t, minimum=1)
    if "blockSizeTokens" in params:  # upstream's newer, token-denominated spelling wins when both are given
        block_size = int_param(params, "blockSizeTokens", 16, t, minimum=1) * CHARS_PER_TOKEN
    max_blocks = int_param(params, "maxPrefixBlocksToMatch", DEFAULT_MAX_PREFIX_BLOCKS, t, minimum=1)
    max_tokens = int_param(params, "maxPrefixTokensToMatch", 0, t)
    if max_tokens > 0:
        max_blocks = max(1, max_tokens * CHARS_PER_TOKEN // block_size)
    explicit_size = "blockSize" in params or "blockSizeTokens" in params
    return PrefixCacheScorer(
        block_size=block_size,
        max_prefix_blocks=max_blocks,
        lru_capacity_per_server=int_param(params, "lruCapacityPerServer", DEFAULT_LRU_CAPACITY_PER_SERVER, t,
                                          minimum=1),
        # An explicit block size means the operator chose it: do not override it from metrics unless asked.
        auto_tune=bool_param(params, "autoTune", not explicit_size, t),
        index_max_bytes=int_param(params, "indexMaxBytes", DEFAULT_INDEX_MAX_BYTES, t, minimum=MIN_INDEX_BYTES),
    )
