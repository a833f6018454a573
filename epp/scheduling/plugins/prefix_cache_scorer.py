"""prefix-cache-scorer: approximate prefix-cache affinity, as upstream's EPP does it (no engine tokenizer needed).

The prompt's UTF-8 bytes are cut into blocks of `blockSize` characters (a trailing partial block is ignored) and
hashed as a chain, so a block's hash names the whole prefix up to it:

    h_-1 = xxh3_64(target_model + cache_salt)              different models (or salts) never share a prefix
    h_i  = xxh3_64(block_i, seed=h_{i-1})                  i < maxPrefixBlocksToMatch

(The parent goes in as the seed rather than as 8 appended bytes: the same chaining, 2.5x cheaper in Python.)

Each endpoint has an LRU index of the blocks of requests sent to it; `pre_request` inserts the picked endpoint's
blocks. The score is the cached fraction of the prompt:

    score(e) = (leading blocks h_0..h_k-1 all found in e's index) / (number of prompt blocks)

With `autoTune` (upstream's default) the block size follows the endpoints' KV block size (tokens × 4 chars), and
an endpoint's index holds as many blocks as its engine's KV cache (`vllm:cache_config_info` num_gpu_blocks ×
block_size tokens, in index blocks); otherwise, or when the engine does not report it, `lruCapacityPerServer`.
The whole index is also held under `indexMaxBytes` (flag `kvgate epp --prefix-index-max-bytes`): past it, the
least recently used entries of the whole index go first, whichever endpoint holds them.

Bounded work per request. The index keeps every endpoint's blocks prefix-closed (an endpoint that holds h_i holds
h_0..h_i-1): `add` touches a prompt's blocks deepest first, so a parent is always used more recently than its
children and every LRU eviction takes a leaf. Then an endpoint's match is the deepest block it holds, and
`match_runs` walks the prompt from its deepest block up, stopping once every holder of h_0 is placed: O(prompt
blocks) dict lookups and bitset operations (holders are int bitsets of endpoint ids) — a prefix all of 1000
endpoints hold costs one bitset, not 1000 × blocks set work (`kvgate bench epp` prints a match-time grid over
endpoints × blocks that shows it). The scoring work (hashes, matches) stays in the cycle state for
`pre_request`, which adds the picked endpoint's blocks without hashing the prompt again.

It is also a PrefixMatchSource (scheduling/prefix_match.py) for load-aware plugins, from the same cycle's match:

    prompt_tokens      = UTF-8 bytes / CHARS_PER_TOKEN                                  (an estimate)
    cached_tokens(e)   = min(matched blocks(e) × block characters / CHARS_PER_TOKEN, prompt_tokens)
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from itertools import repeat
from operator import attrgetter

import numpy as np
import xxhash

from kvgate.epp.scheduling.framework import CycleState, Scorer
from kvgate.epp.scheduling.plugins._params import bool_param, check_keys, int_param
from kvgate.epp.types import EndpointState, LLMRequest

_address_of = attrgetter("endpoint.address")

DEFAULT_BLOCK_SIZE = 64  # characters: 16 tokens × ~4 characters per token
DEFAULT_MAX_PREFIX_BLOCKS = 256
DEFAULT_LRU_CAPACITY_PER_SERVER = 31250  # upstream's sizing: ~500K cached tokens / 16 per block
CHARS_PER_TOKEN = 4
# The whole index's memory budget: 256 MiB holds ~0.55M (endpoint, block) entries at 1000 endpoints and ~0.85M
# at 10: 28 engines' worth of upstream's 31250 blocks each (a 16-token block: ~14M prompt tokens remembered).
DEFAULT_INDEX_MAX_BYTES = 256 * 1024 * 1024
MIN_INDEX_BYTES = 64 * 1024
# Bytes one index entry (endpoint, block) costs at most: BYTES_PER_ENTRY + ids / 6, since a block's holder
# bitset grows with the endpoint ids in use. Measured with tracemalloc after 3 rounds of churn under the budget,
# every block held by one endpoint (the worst case), including the hash ints and the dicts' spare slots:
# 237 B/entry at 100 endpoints, 413 at 1000, 726 at 3000 (all sharing blocks: ~130 at 1000).
# tests/epp/test_prefix_index.py holds 1000 endpoints to the budget with tracemalloc.
BYTES_PER_ENTRY = 300


def hash_prompt(prompt: str, model: str, cache_salt: str | None, block_size: int, max_blocks: int) -> list[int]:
    return _chain(prompt.encode(), 0, _root(model, cache_salt), block_size, max_blocks, [])


def _root(model: str, cache_salt: str | None) -> int:
    return xxhash.xxh3_64_intdigest((model + (cache_salt or "")).encode())


def _chain(data: bytes, start_block: int, parent: int, block_size: int, max_blocks: int, hashes: list[int]
           ) -> list[int]:
    """Appends the chained hashes of data's full blocks from `start_block` on (parent: the previous hash)."""
    usable = min(len(data) // block_size, max_blocks) * block_size
    h = xxhash.xxh3_64_intdigest
    for start in range(start_block * block_size, usable, block_size):
        parent = h(data[start:start + block_size], parent)
        hashes.append(parent)
    return hashes


class PromptHasher:
    """hash_prompt with a memo of recent prompts: a prompt starting like one hashed before (a shared system
    prompt) reuses that chain for the blocks the two have in common, found by byte comparison (exact), and
    hashes only the rest (the caller must not change the list it gets). A 4 KB shared prefix + 0.5-2 KB of
    question: 13.5 µs → 7.9 µs per request.

    Keyed by the first block's bytes (with model, salt and block size); `capacity` prompts of at most
    max_blocks × block_size bytes are kept (64 × 16 KB by default)."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self._recent: OrderedDict[tuple, tuple[bytes, list[int]]] = OrderedDict()

    def hashes(self, prompt: str, model: str, cache_salt: str | None, block_size: int, max_blocks: int
               ) -> list[int]:
        data = prompt.encode()[: block_size * max_blocks]
        if len(data) < block_size:
            return []
        key = (model, cache_salt, block_size, data[:block_size])
        known = self._recent.get(key)
        if known is None:
            hashes = _chain(data, 0, _root(model, cache_salt), block_size, max_blocks, [])
        else:
            old, old_hashes = known
            same = _common_blocks(data, old, block_size, min(len(data), len(old)) // block_size)
            hashes = _chain(data, same, old_hashes[same - 1], block_size, max_blocks, old_hashes[:same])
            self._recent.move_to_end(key)
        self._recent[key] = (data, hashes)
        if len(self._recent) > self.capacity:
            self._recent.popitem(last=False)
        return hashes


def _common_blocks(a: bytes, b: bytes, block_size: int, most: int) -> int:
    """How many leading blocks a and b share (≥ 1: the caller matched the first), by binary search on slices."""
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        end = mid * block_size
        if a[:end] == b[:end]:
            lo = mid
        else:
            hi = mid - 1
    return lo


Runs = list[tuple[int, int]]  # (bitmask of endpoint ids, matched blocks), deepest first, each id in one run


class PrefixIndex:
    """block hash → bitmask of the endpoints holding it; per endpoint an LRU {hash: last use}; a global budget.

    Endpoints are small integer ids inside the index (reused after removal; `id_epoch` changes whenever the
    id ↔ address mapping does). A block's holders are one Python int used as a bitset: union and difference
    over 1000 endpoints are a few machine words, a prefix all of them hold costs ~150 bytes (a set would cost
    ~32 KB), and a match turns into a score array with np.unpackbits instead of per-endpoint Python work.
    """

    def __init__(self, capacity_per_server: int, max_bytes: int = DEFAULT_INDEX_MAX_BYTES) -> None:
        self.capacity = capacity_per_server
        self.set_max_bytes(max_bytes)
        self._holders: dict[int, int] = {}
        self._lru: dict[int, OrderedDict[int, int]] = {}  # id → {hash: add tick}, least recently used first
        self._ids: dict[str, int] = {}
        self._addresses: list[str | None] = []  # id → address
        self._free_ids: list[int] = []
        self.id_epoch = 0
        self._entries = 0
        self._tick = 0
        # (a lower bound of the endpoint's oldest tick, id, its LRU): the global LRU victim is at the top.
        self._heap: list[tuple[int, int, OrderedDict[int, int]]] = []
        self.evictions = 0  # entries dropped to keep the whole index under max_bytes

    def set_max_bytes(self, max_bytes: int) -> None:
        if max_bytes < MIN_INDEX_BYTES:
            raise ValueError(f"prefix index budget must be at least {MIN_INDEX_BYTES} bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._resize_budget()

    def _resize_budget(self) -> None:
        ids = len(getattr(self, "_addresses", ()))
        self.max_entries = self.max_bytes // (BYTES_PER_ENTRY + (ids + 64) // 6)  # ids until the next resize
        if getattr(self, "_entries", 0) > self.max_entries:
            self._evict_oldest(self._entries - self.max_entries)

    @property
    def id_count(self) -> int:
        """One more than the largest endpoint id in use: the length of id-indexed arrays."""
        return len(self._addresses)

    def id_of(self, address: str) -> int | None:
        return self._ids.get(address)

    def add(self, hashes: list[int], address: str, capacity: int | None = None) -> None:
        """`address` now caches `hashes` (a prompt's chain); its LRU keeps at most `capacity` (default: the
        index's per-server capacity) blocks; then the whole index is trimmed to its budget."""
        eid = self._ids.get(address)
        if eid is None:
            eid = self._new_id(address)
        lru = self._lru.get(eid)
        if lru is None:
            lru = self._lru[eid] = OrderedDict()
            heapq.heappush(self._heap, (self._tick + 1, eid, lru))
        holders = self._holders
        bit = 1 << eid
        # One tick per add, shared by its entries (no int object per entry); the order within an add is the
        # LRU's own order.
        tick = self._tick = self._tick + 1
        added = 0
        to_end = lru.move_to_end
        for h in reversed(hashes):  # deepest first: a parent ends up more recent than all its children
            if h in lru:
                lru[h] = tick
                to_end(h)
            else:
                lru[h] = tick
                holders[h] = holders.get(h, 0) | bit
                added += 1
        self._entries += added
        limit = capacity or self.capacity
        while len(lru) > limit:
            evicted, _ = lru.popitem(last=False)
            self._forget(evicted, bit)
            self._entries -= 1
        if self._entries > self.max_entries:
            self._evict_oldest(self._entries - self.max_entries)

    def match_runs(self, hashes: list[int]) -> Runs:
        """Which endpoints hold how many leading blocks of `hashes`, as (id bitmask, blocks), deepest first."""
        holders = self._holders
        first = holders.get(hashes[0], 0) if hashes else 0
        if not first:
            return []
        runs: Runs = []
        seen = 0
        for i in range(len(hashes) - 1, -1, -1):
            held_by = holders.get(hashes[i])
            if held_by is None:
                continue
            new = held_by & ~seen
            if new:
                runs.append((new, i + 1))
                seen |= new
                if seen == first:  # every holder of h_0 placed: a hot prefix ends here, after one bitset
                    break
        return runs

    def match(self, hashes: list[int]) -> dict[str, int]:
        """{address: number of leading hashes it holds}, only for addresses holding at least the first."""
        return {self._addresses[eid]: n for mask, n in self.match_runs(hashes) for eid in _bits(mask)}

    def remove(self, address: str) -> None:
        eid = self._ids.pop(address, None)
        if eid is None:
            return
        bit = 1 << eid
        for h in self._lru.pop(eid, ()):
            self._forget(h, bit)
            self._entries -= 1
        self._addresses[eid] = None
        self._free_ids.append(eid)
        self.id_epoch += 1

    def size(self) -> int:
        return self._entries

    def endpoints(self) -> list[str]:
        return [self._addresses[eid] for eid in self._lru]

    def _new_id(self, address: str) -> int:
        if self._free_ids:
            eid = self._free_ids.pop()
            self._addresses[eid] = address
        else:
            eid = len(self._addresses)
            self._addresses.append(address)
        self._ids[address] = eid
        self.id_epoch += 1
        if eid % 64 == 0:  # the holder bitsets grow with the ids: entries now cost a little more
            self._resize_budget()
        return eid

    def _evict_oldest(self, count: int) -> None:
        """Drop the `count` least recently used entries of the whole index (an endpoint's oldest entries are
        leaves, see above). The entries of one add share a tick: they go together, one heap step per add."""
        heap = self._heap
        while count > 0 and heap:
            bound, eid, lru = heap[0]
            if self._lru.get(eid) is not lru:  # the endpoint was removed (its id may be reused)
                heapq.heappop(heap)
                continue
            tick = next(iter(lru.values()))
            if tick != bound:  # touched or trimmed since: requeue at its real age
                heapq.heapreplace(heap, (tick, eid, lru))
                continue
            bit = 1 << eid
            while count > 0 and lru:
                oldest, t = next(iter(lru.items()))
                if t != tick:  # the next add's entries wait for their turn on the heap
                    break
                del lru[oldest]
                self._forget(oldest, bit)
                self._entries -= 1
                self.evictions += 1
                count -= 1
            if lru:
                heapq.heapreplace(heap, (next(iter(lru.values())), eid, lru))
            else:
                heapq.heappop(heap)
                del self._lru[eid]

    def _forget(self, h: int, bit: int) -> None:
        held_by = self._holders.get(h, 0) & ~bit
        if held_by:
            self._holders[h] = held_by
        else:
            self._holders.pop(h, None)


def _bits(mask: int):
    """The set bit positions of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def mask_to_bools(mask: int, length: int) -> np.ndarray:
    """Bit i of `mask` → element i of a bool array of `length` (≥ mask.bit_length())."""
    raw = np.frombuffer(mask.to_bytes((length + 7) // 8, "little"), dtype=np.uint8)
    return np.unpackbits(raw, count=length, bitorder="little").view(bool)


class PrefixCacheScorer(Scorer):
    type_name = "prefix-cache-scorer"

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
        m = endpoint.metrics
        if self.auto_tune and m.num_kv_blocks and m.kv_block_size:
            tokens = m.num_kv_blocks * m.kv_block_size
            return max(1, tokens * CHARS_PER_TOKEN // self.block_size_for([endpoint]))
        return self.index.capacity

    def hashes(self, request: LLMRequest, endpoints: list[EndpointState]) -> list[int]:
        return self.hasher.hashes(request.prompt, request.target_model, request.cache_salt,
                                  self.block_size_for(endpoints), self.max_prefix_blocks)

    def _match(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None
               ) -> tuple[list[int], Runs, np.ndarray | None]:
        """(hashes, runs, cached fraction by index id + a last 0 slot; None when no run), once per cycle: the
        scorer, the PrefixMatchSource calls and the pick hook share one hashing and one match."""
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

    # -- PrefixMatchSource (scheduling/prefix_match.py): what load-aware plugins weigh a hit with ----------

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
        return np.fromiter(map(self.index._ids.get, map(_address_of, endpoints), unknown), dtype=np.intp,
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

    def remove_endpoint(self, address: str) -> None:
        self.index.remove(address)

    def stats(self) -> dict[str, float]:
        """For the EPP's metrics: index entries and budget, endpoints indexed, block hit ratio of final picks."""
        return {
            "index_size": self.index.size(),
            "index_max_entries": self.index.max_entries,
            "index_evictions": self.index.evictions,
            "indexed_endpoints": len(self.index.endpoints()),
            "hit_blocks": self.hit_blocks,
            "total_blocks": self.total_blocks,
            "hit_ratio": self.hit_blocks / self.total_blocks if self.total_blocks else 0.0,
        }


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
