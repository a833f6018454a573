"""Block-hash chains: how a prompt becomes the keys of the prefix indexes (one chain per prompt, one key per block).

A block's hash is seeded with its parent's, so it names the whole prefix up to and including it; two prompts share
a key exactly when they share every block up to it. Both chains are rooted at what makes a cache namespace (model
or LoRA adapter, cache salt), so different namespaces never share a prefix.

Character blocks, for the approximate prefix-cache-scorer (no tokenizer: blocks of the prompt's UTF-8 bytes, a
trailing partial block ignored):

    h_-1 = xxh3_64(target_model + cache_salt)
    h_i  = xxh3_64(block_i, seed=h_{i-1})                  i < maxPrefixBlocksToMatch

(The parent goes in as the seed rather than as 8 appended bytes: the same chaining, 2.5x cheaper in Python.)

Token-id blocks, for the precise-prefix-cache-scorer and the KV events (engine block size; any engine works
whatever its own hash function, since the events carry token ids):

    root = xxh3_64("lora\\0salt")      h_i = xxh3_64(token ids of block i as int64 bytes, seed = h_{i-1})
"""

from __future__ import annotations

from array import array
from collections import OrderedDict

import xxhash

_h = xxhash.xxh3_64_intdigest

# -- token-id blocks (precise index, KV events) -------------------------------------------------------------------


def root_hash(lora_name: str | None, cache_salt: str | None) -> int:
    salt = "\x01" if cache_salt is None else "\x00" + cache_salt  # None and "" are different namespaces
    return _h(f"{lora_name or ''}\x00{salt}".encode())


def chain(token_ids, block_size: int, parent: int, max_blocks: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (at most max_blocks), continuing from `parent`."""
    data = array("q", token_ids).tobytes()
    step = 8 * block_size
    count = len(token_ids) // block_size
    if max_blocks is not None:
        count = min(count, max_blocks)
    out = []
    for start in range(0, count * step, step):
        parent = _h(data[start:start + step], parent)
        out.append(parent)
    return out


# -- character blocks (approximate index) -------------------------------------------------------------------------


def hash_prompt(prompt: str, model: str, cache_salt: str | None, block_size: int, max_blocks: int) -> list[int]:
    return _chain_bytes(prompt.encode(), 0, _prompt_root(model, cache_salt), block_size, max_blocks, [])


def _prompt_root(model: str, cache_salt: str | None) -> int:
    return _h((model + (cache_salt or "")).encode())


def _chain_bytes(data: bytes, start_block: int, parent: int, block_size: int, max_blocks: int, hashes: list[int]
                 ) -> list[int]:
    """Appends the chained hashes of data's full blocks from `start_block` on (parent: the previous hash)."""
    usable = min(len(data) // block_size, max_blocks) * block_size
    h = _h
    for start in range(start_block * block_size, usable, block_size):
        parent = h(data[start:start + block_size], parent)
        hashes.append(parent)
    return hashes


class PromptHasher:
    """hash_prompt with a memo of recent prompts: a prompt starting like one hashed before (a shared system
    prompt) reuses that chain for the blocks the two have in common, found by byte comparison (exact), and
    hashes only the rest (the caller must not change the list it gets): with a shared prefix longer than the
    question, most of a request's hashing is skipped (`kvgate bench epp --parts scheduling`, whose
    prefix-cache-scorer p50 includes it).

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
            hashes = _chain_bytes(data, 0, _prompt_root(model, cache_salt), block_size, max_blocks, [])
        else:
            old, old_hashes = known
            same = _common_blocks(data, old, block_size, min(len(data), len(old)) // block_size)
            hashes = _chain_bytes(data, same, old_hashes[same - 1], block_size, max_blocks, old_hashes[:same])
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
