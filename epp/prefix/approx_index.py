"""The approximate prefix index: which prompt blocks were sent to which endpoint, under a memory budget.

block hash → bitset of the endpoint ids holding it (endpoint_ids.py); per endpoint an LRU {hash: add tick} of at
most its capacity (the prefix-cache-scorer sizes it from the engine's KV cache); the whole index held under
`max_bytes`: past it the least recently used entries go first, whichever endpoint holds them.

Bounded work per request. Every endpoint's blocks stay prefix-closed (an endpoint that holds h_i holds h_0..h_i-1):
`add` touches a prompt's blocks deepest first, so a parent is always used more recently than its children and
every LRU eviction takes a leaf. Then an endpoint's match is the deepest block it holds, and `match_runs` walks
the prompt from its deepest block up, stopping once every holder of h_0 is placed: O(prompt blocks) dict lookups
and bitset operations — a prefix all of 1000 endpoints hold costs one bitset, not 1000 × blocks set work
(`kvgate bench epp` prints a match-time grid over endpoints × blocks that shows it).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from kvgate.epp.prefix.endpoint_ids import EndpointIds, bits, clear_holder

# The whole index's memory budget: 256 MiB holds ~0.55M (endpoint, block) entries at 1000 endpoints and ~0.85M
# at 10: 28 engines' worth of upstream's 31250 blocks each (a 16-token block: ~14M prompt tokens remembered).
DEFAULT_INDEX_MAX_BYTES = 256 * 1024 * 1024
MIN_INDEX_BYTES = 64 * 1024
# Bytes one index entry (endpoint, block) costs at most: BYTES_PER_ENTRY + ids / 6, since a block's holder
# bitset grows with the endpoint ids in use; it covers the hash ints and the dicts' spare slots after churn under
# the budget, every block held by one endpoint (the worst case). tests/epp/test_prefix_index.py holds 1000
# endpoints to the budget with tracemalloc.
BYTES_PER_ENTRY = 300

Runs = list[tuple[int, int]]  # (bitmask of endpoint ids, matched blocks), deepest first, each id in one run


class PrefixIndex:
    """block hash → bitmask of the endpoints holding it; per endpoint an LRU {hash: last use}; a global budget.

    Endpoint ids are reused after removal; `id_epoch` changes whenever the id ↔ address mapping does."""

    def __init__(self, capacity_per_server: int, max_bytes: int = DEFAULT_INDEX_MAX_BYTES) -> None:
        self.capacity = capacity_per_server
        self.ids = EndpointIds()
        self._holders: dict[int, int] = {}
        self._lru: dict[int, OrderedDict[int, int]] = {}  # id → {hash: add tick}, least recently used first
        self._entries = 0
        self._tick = 0
        # (a lower bound of the endpoint's oldest tick, id, its LRU): the global LRU victim is at the top.
        self._heap: list[tuple[int, int, OrderedDict[int, int]]] = []
        self.evictions = 0  # entries dropped to keep the whole index under max_bytes
        self.set_max_bytes(max_bytes)

    def set_max_bytes(self, max_bytes: int) -> None:
        if max_bytes < MIN_INDEX_BYTES:
            raise ValueError(f"prefix index budget must be at least {MIN_INDEX_BYTES} bytes, got {max_bytes}")
        self.max_bytes = max_bytes
        self._resize_budget()

    def _resize_budget(self) -> None:
        # the entry cost of the ids up to the next multiple of 64 (resized again when an id reaches it)
        self.max_entries = self.max_bytes // (BYTES_PER_ENTRY + (self.ids.count + 64) // 6)
        if self._entries > self.max_entries:
            self._evict_oldest(self._entries - self.max_entries)

    @property
    def id_count(self) -> int:
        """One more than the largest endpoint id in use: the length of id-indexed arrays."""
        return self.ids.count

    @property
    def id_epoch(self) -> int:
        return self.ids.epoch

    def id_of(self, address: str) -> int | None:
        return self.ids.get(address)

    def add(self, hashes: list[int], address: str, capacity: int | None = None) -> None:
        """`address` now caches `hashes` (a prompt's chain); its LRU keeps at most `capacity` (default: the
        index's per-server capacity) blocks; then the whole index is trimmed to its budget."""
        eid = self.ids.get(address)
        if eid is None:
            eid = self.ids.assign(address)
            if eid % 64 == 0:  # the holder bitsets grow with the ids: entries now cost a little more
                self._resize_budget()
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
            clear_holder(holders, evicted, bit)
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
        addresses = self.ids.addresses
        return {addresses[eid]: n for mask, n in self.match_runs(hashes) for eid in bits(mask)}

    def remove(self, address: str) -> None:
        eid = self.ids.get(address)
        if eid is None:
            return
        bit = 1 << eid
        for h in self._lru.pop(eid, ()):
            clear_holder(self._holders, h, bit)
            self._entries -= 1
        self.ids.release(address)

    def size(self) -> int:
        return self._entries

    def endpoints(self) -> list[str]:
        return [self.ids.addresses[eid] for eid in self._lru]

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
                clear_holder(self._holders, oldest, bit)
                self._entries -= 1
                self.evictions += 1
                count -= 1
            if lru:
                heapq.heapreplace(heap, (next(iter(lru.values())), eid, lru))
            else:
                heapq.heappop(heap)
                del self._lru[eid]
