"""Per-request block tables over the block pool, with prefix-cache lookups and accounting.

With a sliding window on every layer (`sliding_window`: the largest of the layers' windows), a request's blocks that
lie wholly before its next query's window are read by no layer again: each allocation frees them, and the request's
block list keeps None in their place (positions stay block-aligned). Their ids stay in the request's block-table
row, where the attention reads them only under its window mask (a freed block that another request reuses holds
finite K/V, and what is masked contributes nothing). A freed block keeps its hash, so it stays a prefix-cache hit
until the pool hands it out again; a lookup needs the whole prefix from the first block, so once an early block of
a prompt is reused, later requests find no prefix of it. With any full-attention layer nothing is freed early."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.engine.block_pool import BlockPool, KVCacheBlock, hash_block_tokens, root_block_hash
from kvgate.engine.block_table import BlockTable
from kvgate.engine.kv_events import BlockStored
from kvgate.engine.request import Request


def _namespace(cache_salt: str | None, lora_request) -> tuple:
    """What roots a request's hash chain: its cache salt and adapter (blocks are never shared across adapters, nor
    with the base model; the id, unique for an engine's life, so a name re-added with new weights starts afresh)."""
    if lora_request is None:
        return (cache_salt,)
    return (cache_salt, f"lora:{lora_request.lora_int_id}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 max_blocks_per_request: int = 64, max_requests: int = 64, record_kv_events: bool = False,
                 sliding_window: int | None = None) -> None:
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching, record_kv_events)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # The same block ids as rows of one array (block_table.py), for the runner's step inputs; sized for the
        # expected requests and lengths (it grows past them).
        self.block_table = BlockTable(max_blocks_per_request, max_requests)
        self._num_cached_blocks: dict[str, int] = {}
        self._num_released: dict[str, int] = {}  # leading blocks freed as outside every layer's window
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def update_block_hashes(self, request: Request) -> list[bytes]:
        """Extend the request's chained hashes to cover all its full blocks."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        num_full = len(tokens) // bs
        parent = hashes[-1] if hashes else root_block_hash(_namespace(request.cache_salt, request.lora_request))
        for i in range(len(hashes), num_full):
            parent = hash_block_tokens(parent, tokens[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks; the last token is always left to compute. None for a request that
        asks for prompt logprobs (vLLM's rule): a cached block has no logits, so its prompt is computed whole (and
        its blocks are still cached for others)."""
        if not self.enable_caching:
            return [], 0
        hashes = self.update_block_hashes(request)
        if request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def probe_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None, lora_request=None
                     ) -> tuple[int, list[bytes]]:
        """What get_computed_blocks would find for a prompt arriving now, in tokens, without a request and without
        changing anything, and the block hashes it computed on the way (the request's first `block_hashes`, so that
        add_request need not compute them again): the engine's side asks it while the loop may be in a step
        (engine_loop.arrival_probe), each table lookup being one dict read. Hashes block by block and stops at the
        first miss, so a cold prompt costs one block's hash. Raises what hashing raises on ids that are not int64s
        (the caller's to catch)."""
        if not self.enable_caching:
            return 0, []
        bs, cached = self.block_size, self.pool.cached
        parent = root_block_hash(_namespace(cache_salt, lora_request))
        hashes: list[bytes] = []
        for i in range((len(token_ids) - 1) // bs):
            parent = hash_block_tokens(parent, token_ids[i * bs:(i + 1) * bs])
            hashes.append(parent)
            if parent not in cached:
                return (len(hashes) - 1) * bs, hashes
        return len(hashes) * bs, hashes

    def record_prefix_query(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_stats.queries += num_tokens
        self.prefix_stats.hits += num_hit_tokens

    def can_fit(self, request: Request, num_tokens: int) -> bool:
        return cdiv(num_tokens, self.block_size) <= self.pool.num_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens; None (and no change) when the pool is too full. Blocks outside
        every layer's window are freed first (with a sliding window)."""
        if self.sliding_window is not None:
            self._release_outside_window(request)
        total_tokens = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        # Blocks full of known tokens are hashed; one that an output placeholder completes (async scheduling) is
        # hashed by the request's next allocation, once the token is known.
        bs = self.block_size
        num_full = min(total_tokens, len(request.all_token_ids)) // bs
        blocks = self.req_blocks.get(request.request_id)
        if blocks is not None and not new_computed_blocks and total_tokens <= len(blocks) * bs \
                and (not self.enable_caching or num_full <= self._num_cached_blocks.get(request.request_id, 0)):
            return []  # most decode steps: the last block has room and fills no new block (nothing to hash)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_needed = cdiv(total_tokens, self.block_size) - len(blocks) - len(new_computed_blocks)
        # Cache hits sitting in the free queue stop being allocatable once we take them.
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_evictable_hits:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        first_new = len(blocks)
        if new_computed_blocks:
            self.pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self._num_cached_blocks[request.request_id] = len(blocks)
        new_blocks = self.pool.get_new_blocks(max(0, num_needed))
        blocks.extend(new_blocks)
        if len(blocks) > first_new:
            table = self.block_table
            table.write(table.row(request.request_id), first_new, [b.block_id for b in blocks[first_new:]])
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_full)
        return new_blocks

    def _release_outside_window(self, request: Request) -> None:
        """Free the request's blocks wholly before the window of its next query (at position num_computed_tokens,
        which sees keys from num_computed_tokens - window + 1 on)."""
        blocks = self.req_blocks.get(request.request_id)
        if not blocks:
            return
        first_needed = max(0, request.num_computed_tokens - self.sliding_window + 1) // self.block_size
        first_needed = min(first_needed, len(blocks))
        done = self._num_released.get(request.request_id, 0)
        if first_needed <= done:
            return
        released = blocks[done:first_needed]
        blocks[done:first_needed] = [None] * len(released)
        self._num_released[request.request_id] = first_needed
        self.pool.free_blocks(reversed(released))  # later blocks evicted first: earlier ones are shared prefixes

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_full: int) -> None:
        start = self._num_cached_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self.update_block_hashes(request)
        events = self.pool.kv_events
        run_start = None  # first block of the current run of hashes new to the table
        for i in range(start, num_full):
            # a block freed as outside the window before it was hashed (a window shorter than a block) is not cached
            stored = blocks[i] is not None and self.pool.cache_block(blocks[i], hashes[i])
            if events is None:
                continue
            if stored and run_start is None:
                run_start = i
            elif not stored and run_start is not None:
                events.append(self._stored_event(request, hashes, run_start, i))
                run_start = None
        if run_start is not None:
            events.append(self._stored_event(request, hashes, run_start, num_full))
        self._num_cached_blocks[request.request_id] = num_full

    def _stored_event(self, request: Request, hashes: list[bytes], first: int, end: int) -> BlockStored:
        """Blocks [first, end) of the request, one event (a run is contiguous, so one parent covers it)."""
        bs = self.block_size
        lora = request.lora_request
        return BlockStored(block_hashes=hashes[first:end], parent_block_hash=hashes[first - 1] if first else None,
                           token_ids=request.all_token_ids[first * bs : end * bs], block_size=bs,
                           cache_salt=request.cache_salt, first_block_index=first,
                           lora_id=lora.lora_int_id if lora else None, lora_name=lora.lora_name if lora else None)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the request's blocks past its first num_tokens positions (the slots of rejected draft tokens). They
        were never hashed: a block is cached only once full of the request's known tokens."""
        blocks = self.req_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        extra = [b for b in blocks[keep:] if b is not None]
        del blocks[keep:]
        self._num_released[request.request_id] = min(self._num_released.get(request.request_id, 0), keep)
        self.pool.free_blocks(reversed(extra))

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, None)
        self._num_cached_blocks.pop(request.request_id, None)
        self._num_released.pop(request.request_id, None)
        self.block_table.release(request.request_id)
        if blocks:
            # Tail blocks are the least likely to be shared: evict them first.
            self.pool.free_blocks(reversed([b for b in blocks if b is not None]))

    def get_block_ids(self, request_id: str) -> list[int | None]:
        """The request's block ids by position (None: freed as outside every layer's window)."""
        return [None if b is None else b.block_id for b in self.req_blocks.get(request_id, ())]

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (those freed as outside the window not counted)."""
        return sum(b is not None for b in self.req_blocks.get(request_id, ()))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
