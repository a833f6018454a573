"""prefix-cache-scorer: approximate prefix-cache affinity, as upstream's EPP does it (no engine tokenizer needed).

The prompt's UTF-8 bytes are cut into blocks of `blockSize` characters (a trailing partial block is ignored) and
hashed as a chain, so a block's hash names the whole prefix up to it:

    h_-1 = xxh3_64(target_model + cache_salt)              different models (or salts) never share a prefix
    h_i  = xxh3_64(block_i, seed=h_{i-1})                  i < maxPrefixBlocksToMatch

(The parent goes in as the seed rather than as 8 appended bytes: the same chaining, 2.5x cheaper in Python.)

Each endpoint has an LRU index (at most `lruCapacityPerServer` hashes) of the blocks of requests sent to it;
`pre_request` inserts the picked endpoint's blocks. The score is the cached fraction of the prompt:

    score(e) = (leading blocks h_0..h_k-1 all found in e's index) / (number of prompt blocks)

With `autoTune` (upstream's default) the block size follows the endpoints' KV block size: tokens × 4 chars.
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash

from kvgate.epp.scheduling.framework import Scorer
from kvgate.epp.scheduling.plugins._params import bool_param, check_keys, int_param
from kvgate.epp.types import EndpointState, LLMRequest

DEFAULT_BLOCK_SIZE = 64  # characters: 16 tokens × ~4 characters per token
DEFAULT_MAX_PREFIX_BLOCKS = 256
DEFAULT_LRU_CAPACITY_PER_SERVER = 31250  # upstream's sizing: ~500K cached tokens / 16 per block
CHARS_PER_TOKEN = 4
PENDING_LIMIT = 1024  # scored requests whose pick is not final yet (normally 0 or 1); oldest dropped beyond


def hash_prompt(prompt: str, model: str, cache_salt: str | None, block_size: int, max_blocks: int) -> list[int]:
    data = prompt.encode()
    usable = min(len(data) // block_size, max_blocks) * block_size
    parent = xxhash.xxh3_64_intdigest((model + (cache_salt or "")).encode())
    hashes = []
    h = xxhash.xxh3_64_intdigest
    for start in range(0, usable, block_size):
        parent = h(data[start:start + block_size], parent)
        hashes.append(parent)
    return hashes


class PrefixIndex:
    """block hash → endpoints holding it, with a bounded LRU of hashes per endpoint."""

    def __init__(self, capacity_per_server: int) -> None:
        self.capacity = capacity_per_server
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def add(self, hashes: list[int], address: str) -> None:
        lru = self._lru.get(address)
        if lru is None:
            lru = self._lru[address] = OrderedDict()
        for h in hashes:
            if h in lru:
                lru.move_to_end(h)
                continue
            lru[h] = None
            self._holders.setdefault(h, set()).add(address)
            if len(lru) > self.capacity:
                evicted, _ = lru.popitem(last=False)
                self._forget(evicted, address)

    def match(self, hashes: list[int]) -> dict[str, int]:
        """{address: number of leading hashes it holds}, only for addresses holding at least the first."""
        if not hashes or hashes[0] not in self._holders:
            return {}
        matched: dict[str, int] = {}
        alive = set(self._holders[hashes[0]])
        for i in range(1, len(hashes)):
            holders = self._holders.get(hashes[i])
            still = alive & holders if holders else set()
            if len(still) != len(alive):
                for address in alive - still:
                    matched[address] = i
                if not still:
                    return matched
            alive = still
        for address in alive:
            matched[address] = len(hashes)
        return matched

    def remove(self, address: str) -> None:
        for h in self._lru.pop(address, ()):
            self._forget(h, address)

    def _forget(self, h: int, address: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(address)
            if not holders:
                del self._holders[h]

    def size(self) -> int:
        return sum(len(lru) for lru in self._lru.values())

    def endpoints(self) -> list[str]:
        return list(self._lru)


class PrefixCacheScorer(Scorer):
    type_name = "prefix-cache-scorer"

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, max_prefix_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS,
                 lru_capacity_per_server: int = DEFAULT_LRU_CAPACITY_PER_SERVER, auto_tune: bool = True) -> None:
        super().__init__()
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.auto_tune = auto_tune
        self.index = PrefixIndex(lru_capacity_per_server)
        # request id → (hashes, matches) between score() and pre_request(): the pick reuses the scoring work.
        self._pending: OrderedDict[str, tuple[list[int], dict[str, int]]] = OrderedDict()
        self.hit_blocks = 0
        self.total_blocks = 0

    def block_size_for(self, endpoints: list[EndpointState]) -> int:
        if self.auto_tune:
            for e in endpoints:  # a pool's endpoints share one engine config
                if e.metrics.kv_block_size:
                    return e.metrics.kv_block_size * CHARS_PER_TOKEN
        return self.block_size

    def hashes(self, request: LLMRequest, endpoints: list[EndpointState]) -> list[int]:
        return hash_prompt(request.prompt, request.target_model, request.cache_salt,
                           self.block_size_for(endpoints), self.max_prefix_blocks)

    def score(self, request: LLMRequest, endpoints: list[EndpointState]) -> dict[str, float]:
        hashes = self.hashes(request, endpoints)
        matches = self.index.match(hashes)
        self._remember(request.request_id, hashes, matches)
        if not hashes:
            return {}
        total = len(hashes)
        return {address: n / total for address, n in matches.items()}

    def pre_request(self, request: LLMRequest, endpoint: EndpointState) -> None:
        pending = self._pending.pop(request.request_id, None)
        if pending is None:  # scored by another scheduler call path, or evicted: recompute
            hashes = self.hashes(request, [endpoint])
            matched = self.index.match(hashes).get(endpoint.address, 0)
        else:
            hashes, matches = pending
            matched = matches.get(endpoint.address, 0)
        self.hit_blocks += matched
        self.total_blocks += len(hashes)
        self.index.add(hashes, endpoint.address)

    def response_complete(self, request: LLMRequest, endpoint_address: str, prompt_tokens: int,
                          completion_tokens: int) -> None:
        self._pending.pop(request.request_id, None)

    def remove_endpoint(self, address: str) -> None:
        self.index.remove(address)

    def stats(self) -> dict[str, float]:
        """For the EPP's metrics: index entries, endpoints indexed, and the block hit ratio of final picks."""
        return {
            "index_size": self.index.size(),
            "indexed_endpoints": len(self.index.endpoints()),
            "hit_blocks": self.hit_blocks,
            "total_blocks": self.total_blocks,
            "hit_ratio": self.hit_blocks / self.total_blocks if self.total_blocks else 0.0,
        }

    def _remember(self, request_id: str, hashes: list[int], matches: dict[str, int]) -> None:
        self._pending[request_id] = (hashes, matches)
        self._pending.move_to_end(request_id)
        while len(self._pending) > PENDING_LIMIT:
            self._pending.popitem(last=False)


def factory(parameters: dict | None) -> PrefixCacheScorer:
    t = PrefixCacheScorer.type_name
    params = check_keys(parameters, {"blockSize", "blockSizeTokens", "maxPrefixBlocksToMatch",
                                     "maxPrefixTokensToMatch", "lruCapacityPerServer", "autoTune"}, t)
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
    )
