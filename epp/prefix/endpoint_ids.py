"""Endpoint ids and the int bitsets over them: how both prefix indexes name the endpoints holding a block.

An index gives each endpoint address a small integer id (reused after removal), so a block's holders are one
Python int used as a bitset: union and difference over 1000 endpoints are a few machine words, a prefix all of
them hold costs ~150 bytes (a set would cost ~32 KB), and a match turns into a score array with np.unpackbits
(`mask_to_bools`) instead of per-endpoint Python work.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np


class EndpointIds:
    """address ↔ id, freed ids reused (the last freed first); `epoch` changes whenever the mapping does, so a
    cached position → id array knows when it is stale."""

    __slots__ = ("by_address", "addresses", "_free", "epoch")

    def __init__(self) -> None:
        self.by_address: dict[str, int] = {}
        self.addresses: list[str | None] = []  # id → address (None: free)
        self._free: list[int] = []
        self.epoch = 0

    @property
    def count(self) -> int:
        """One more than the largest id ever given: the length of id-indexed arrays."""
        return len(self.addresses)

    def get(self, address: str) -> int | None:
        return self.by_address.get(address)

    def assign(self, address: str) -> int:
        """`address`'s id, a new one (a freed one first) if it has none."""
        eid = self.by_address.get(address)
        if eid is not None:
            return eid
        if self._free:
            eid = self._free.pop()
            self.addresses[eid] = address
        else:
            eid = len(self.addresses)
            self.addresses.append(address)
        self.by_address[address] = eid
        self.epoch += 1
        return eid

    def release(self, address: str) -> int | None:
        """Free `address`'s id (the caller has cleared its bit everywhere); the id it had, None if it had none."""
        eid = self.by_address.pop(address, None)
        if eid is not None:
            self.addresses[eid] = None
            self._free.append(eid)
            self.epoch += 1
        return eid


def bits(mask: int) -> Iterator[int]:
    """The set bit positions of `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def mask_to_bools(mask: int, length: int) -> np.ndarray:
    """Bit i of `mask` → element i of a bool array of `length` (≥ mask.bit_length())."""
    raw = np.frombuffer(mask.to_bytes((length + 7) // 8, "little"), dtype=np.uint8)
    return np.unpackbits(raw, count=length, bitorder="little").view(bool)


def clear_holder(holders: dict[int, int], block: int, bit: int) -> None:
    """`block` is no longer held by the endpoint of `bit`; a block nobody holds leaves `holders`."""
    rest = holders.get(block, 0) & ~bit
    if rest:
        holders[block] = rest
    else:
        holders.pop(block, None)
