"""The pool of fixed-size KV blocks: refcounts, a lazy-LRU free queue and the prefix-cache hash table.

A freed block keeps its hash and stays findable by it until the pool hands it out again, so a finished
request's prefix remains a cache hit for as long as memory allows (vLLM V1's design).

With KV-cache events on (`kv_events` a list), the pool records every change to its hash table in order: a hash
entering it (the manager records the `BlockStored`, it knows the tokens), a hash leaving it when its block is
handed out again (`BlockRemoved`), and a reset (`AllBlocksCleared`). The engine takes the records once per step.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence

import xxhash

from kvgate.engine.kv_events import AllBlocksCleared, BlockRemoved, KVCacheEvent


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


def root_block_hash(extra_keys: Sequence[str | None]) -> bytes:
    """Parent hash of a request's first block; extra keys (cache_salt, adapter) separate cache namespaces."""
    h = xxhash.xxh3_128(b"kvgate-kv-root")
    for key in extra_keys:
        data = b"" if key is None else key.encode()
        h.update(struct.pack("<q", len(data) if key is not None else -1))
        h.update(data)
    return h.digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained block hash: 128-bit xxh3 over the parent's hash and this block's token ids."""
    h = xxhash.xxh3_128(parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order: O(1) pop from the front, remove and append."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinels
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise RuntimeError("no free KV blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        assert block.prev_free is not None and block.next_free is not None, "block is not in the free queue"
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool, record_kv_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError("the KV block pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.kv_events: list[KVCacheEvent] | None = [] if record_kv_events else None  # recorded since taken

    def take_kv_events(self) -> list[KVCacheEvent]:
        events = self.kv_events
        if not events:
            return []
        self.kv_events = []
        return events

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def usage(self) -> float:
        """Fraction of blocks held by requests (free blocks that still cache a prefix count as free)."""
        return 1.0 - self.free_queue.num_free / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, count: int) -> list[KVCacheBlock]:
        if count > self.free_queue.num_free:
            raise RuntimeError(f"asked for {count} KV blocks, {self.free_queue.num_free} free")
        blocks = []
        evicted: list[bytes] = []
        for _ in range(count):
            block = self.free_queue.popleft()
            if self._evict(block):
                evicted.append(block.block_hash)
            block.block_hash = None
            block.ref_cnt = 1
            blocks.append(block)
        if evicted and self.kv_events is not None:
            self.kv_events.append(BlockRemoved(evicted))
        return blocks

    def _evict(self, block: KVCacheBlock) -> bool:
        """Drop the block's hash from the table if the block is its cached copy; True if it was."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
            return True
        return False

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the queue's tail in the given order (first evicted first)."""
        for block in ordered_blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"double free of {block}"
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Give a full block its hash; True if the hash is new to the table (an event-worthy store)."""
        if block.block_hash is not None:
            return False
        block.block_hash = block_hash
        # If another request computed the same block concurrently, the first copy stays the cached one.
        return self.cached.setdefault(block_hash, block) is block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no request holds blocks."""
        if self.free_queue.num_free != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        return True
