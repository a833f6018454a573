"""One endpoint's map from the engine's block hashes to the EPP's own, turning decoded events into index `Delta`s.

The engine names blocks by its hashes; the index keys them by hashes the EPP computes from the tokens
(prefix/hashing.py), so a prompt can be matched without the engine. A BlockStored names its parent by the engine's
hash: the map finds the parent's EPP hash to continue the chain from. A BlockRemoved names engine hashes only:
the map finds what to remove from the index.

Memory: the map costs about `BYTES_PER_BLOCK` per cached block (both dicts, measured with tracemalloc by
tests/epp/test_precise_index.py::test_bytes_per_block_covers_what_both_sides_hold, which prints it); past the
`BlockBudget` shared by all endpoints, stored blocks are not indexed (counted in `blocks_over_budget`): the index
then under-reports, which routes like a miss, never to a block that is gone.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from kvgate.epp.kv_events.decode import Cleared, Event, Removed, Stored
from kvgate.epp.prefix.hashing import chain, root_hash
from kvgate.epp.prefix.precise_index import Delta

# Removed blocks still known as parents, per endpoint: a child stored just after its parent's cached copy was
# evicted (another request's copy of the parent was still in use) is still keyed. Outside the budget: 256 ×
# ~150 B per endpoint, 38 MB at 1000 endpoints.
RECENTLY_REMOVED = 256
BYTES_PER_BLOCK = 250


class BlockBudget:
    """How many blocks all endpoints' maps hold together, and how many they may."""

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit  # None: unbounded
        self.used = 0

    def full(self) -> bool:
        return self.limit is not None and self.used >= self.limit


class EngineHashes:
    """One endpoint's engine hash → EPP hash, with counts of engine hashes per EPP hash: several engine blocks
    can share one EPP hash, which leaves the index only with the last of them (set semantics)."""

    def __init__(self, budget: BlockBudget | None = None, stats: Counter | dict | None = None) -> None:
        self.ours: dict[object, int] = {}
        self.count: dict[int, int] = {}
        self.recent: OrderedDict[object, int] = OrderedDict()  # removed ones, for parent lookups
        self.budget = budget if budget is not None else BlockBudget()
        # blocks_stored, blocks_removed, blocks_over_budget, orphan_blocks: the subscriber's shared counters
        self.stats = stats if stats is not None else Counter()

    def parent(self, engine_hash) -> int | None:
        h = self.ours.get(engine_hash)
        return h if h is not None else self.recent.get(engine_hash)

    def clear(self) -> None:
        """Forget every block (their budget goes back to the other endpoints)."""
        self.budget.used -= len(self.ours)
        self.ours.clear()
        self.count.clear()
        self.recent.clear()

    def apply(self, events: list[Event], address: str, generation: int, out: list[Delta]) -> None:
        """Append to `out` what one batch's events change in the index: one Delta, or one more after each
        AllBlocksCleared (a cleared Delta drops what came before it)."""
        delta = Delta(address, generation)
        for event in events:
            if isinstance(event, Stored):
                self.store(event, delta)
            elif isinstance(event, Removed):
                self.remove(event.block_hashes, delta)
            elif isinstance(event, Cleared):
                self.clear()
                out.append(delta)
                delta = Delta(address, generation, cleared=True)
        out.append(delta)

    def store(self, event: Stored, delta: Delta) -> None:
        if event.parent_block_hash is None:
            parent = root_hash(event.lora_name, event.cache_salt)
        else:
            parent = self.parent(event.parent_block_hash)
            if parent is None:  # its parent was never seen: the chain cannot be keyed (missed history)
                self.stats["orphan_blocks"] += len(event.block_hashes)
                return
        delta.block_size = event.block_size
        if event.lora_name:
            delta.loras.add(event.lora_name)
        ours = chain(event.token_ids, event.block_size, parent)
        for engine_hash, h in zip(event.block_hashes, ours):
            if engine_hash in self.ours:
                continue
            if self.budget.full():
                self.stats["blocks_over_budget"] += 1
                continue
            self.ours[engine_hash] = h
            self.budget.used += 1
            self.stats["blocks_stored"] += 1
            n = self.count.get(h, 0)
            self.count[h] = n + 1
            if not n:
                if delta.removed.pop(h, 0) is not None:  # not removed then stored again in this batch
                    delta.added[h] = None

    def remove(self, engine_hashes: list, delta: Delta) -> None:
        for engine_hash in engine_hashes:
            ours = self.ours.pop(engine_hash, None)
            if ours is None:
                continue
            self.budget.used -= 1
            self.stats["blocks_removed"] += 1
            self.recent[engine_hash] = ours
            if len(self.recent) > RECENTLY_REMOVED:
                self.recent.popitem(last=False)
            left = self.count[ours] - 1
            if left:
                self.count[ours] = left
            else:
                del self.count[ours]
                if delta.added.pop(ours, 0) is not None:  # not stored then removed in this batch
                    delta.removed[ours] = None
