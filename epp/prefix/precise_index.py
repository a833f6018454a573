"""The precise prefix index: which blocks each endpoint's engine caches, keyed by hashes the EPP computes itself.

Keys are token-id block chains (hashing.py `chain`, rooted at `root_hash` of the LoRA adapter and cache salt), so
any engine works whatever its own hash function (the events carry token ids; `EngineHashes` in epp/kv_events/ maps
the engine's hashes to these, for removals). A request's prompt, tokenized like the engine, hashes the same way
and an endpoint's match is its leading run of held blocks.

Two writers, one reader, all on the EPP's event loop (no locks): `apply` takes the subscriber thread's deltas
(posted to the loop), `hold`/`release` and `add_speculative` the scorer's picks (a block the engine will hold
once it prefills the request: it counts until the events confirm it, else while a request that will compute it
is held, then `speculative_ttl_s` seconds, so a burst to a fresh prefix sticks to one endpoint before the events
arrive), `match` serves the scorer. Holders of a block are an int bitset of endpoint ids (endpoint_ids.py): a
match is O(prompt blocks) dict lookups and bit operations.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvgate.epp.prefix.endpoint_ids import EndpointIds, bits, clear_holder

# Adapter names learned from events, the most recently seen kept: a request naming one that fell out hashes from
# the base model's root and matches nothing of the adapter's (a miss, never a wrong hit). vLLM serves at most
# --max-cpu-loras adapters per engine (tens); 4096 covers a pool of them, at ≤ 1 KiB a name (decode.py).
MAX_LORAS = 4096
_HELD = float("inf")  # a held speculative entry's expiry: none until released


@dataclass(slots=True)
class Delta:
    """What changed in one endpoint's cache (made by the subscriber thread, applied on the loop)."""

    address: str
    generation: int
    # ordered sets (a dict's keys: the subscriber nets out a block stored and removed in one batch in O(1));
    # any iterable of hashes works
    added: dict[int, None] = field(default_factory=dict)
    removed: dict[int, None] = field(default_factory=dict)
    cleared: bool = False  # before `added`: the endpoint's blocks are gone (restart, AllBlocksCleared, lost events)
    block_size: int | None = None
    loras: set[str] = field(default_factory=set)  # adapters named by the stored blocks


class PreciseIndex:
    """block hash → bitset of the endpoints whose engines announced it (confirmed) or will compute it
    (speculative: held by a request in flight, or within `speculative_ttl_s` of a pick or of a hold's end)."""

    def __init__(self, speculative_ttl_s: float = 2.0, max_speculative: int = 100_000, clock=time.monotonic,
                 max_loras: int = MAX_LORAS) -> None:
        self.speculative_ttl_s = speculative_ttl_s
        self.max_speculative = max_speculative
        self.clock = clock
        self._holders: dict[int, int] = {}
        self._blocks: dict[int, set[int]] = {}  # endpoint id → its confirmed blocks
        self.ids = EndpointIds()
        self._generation: dict[str, int] = {}  # address → the subscription generation whose deltas count
        self.block_sizes: dict[str, int] = {}  # address → its engine's block size (from the events)
        # adapters seen in events (a request naming one hashes from its root), oldest first, at most max_loras
        self.loras: OrderedDict[str, None] = OrderedDict()
        self.max_loras = max_loras
        # speculative: block → {endpoint id: expiry}; a FIFO of (expiry, block, id) for expiry, bounded
        self._spec: dict[int, dict[int, float]] = {}
        self._spec_fifo: deque[tuple[float, int, int]] = deque()
        # (block, endpoint id) → requests in flight that will compute it: held (expiry inf, not in the FIFO)
        self._holds: dict[tuple[int, int], int] = {}
        self.stale_deltas = 0

    # -- endpoints ------------------------------------------------------------------------------------------------

    def watch(self, address: str, generation: int) -> None:
        """Deltas for `address` count from `generation` on (a new subscription); older ones are dropped."""
        if self._generation.get(address) != generation:
            self._drop_blocks(address)
        self._generation[address] = generation

    def remove(self, address: str) -> None:
        """The endpoint left the pool: its blocks, speculative ones included, and its id go."""
        self._generation.pop(address, None)
        self.block_sizes.pop(address, None)
        eid = self.ids.release(address)
        if eid is None:
            return
        self._drop_blocks_of(eid)
        for holders in self._spec.values():
            holders.pop(eid, None)
        self._holds = {key: n for key, n in self._holds.items() if key[1] != eid}

    # -- confirmed blocks (events) --------------------------------------------------------------------------------

    def apply(self, delta: Delta) -> None:
        if self._generation.get(delta.address) != delta.generation:
            self.stale_deltas += 1  # the endpoint left (or was resubscribed) after the thread made this
            return
        if delta.cleared:
            self._drop_blocks(delta.address)
        if delta.block_size:
            self.block_sizes[delta.address] = delta.block_size
        if delta.loras:
            self._learn_loras(delta.loras)
        if not delta.added and not delta.removed:
            return
        eid = self.ids.assign(delta.address)
        bit = 1 << eid
        blocks = self._blocks.setdefault(eid, set())
        holders = self._holders
        for h in delta.removed:
            if h in blocks:
                blocks.discard(h)
                clear_holder(holders, h, bit)
        holds = self._holds
        for h in delta.added:
            if h not in blocks:
                blocks.add(h)
                holders[h] = holders.get(h, 0) | bit
            if holds and holds.pop((h, eid), None) is not None:
                self._unspec(h, eid)  # confirmed: the events decide from now on (a later eviction counts)

    def _learn_loras(self, names) -> None:
        loras = self.loras
        for name in names:
            loras[name] = None
            loras.move_to_end(name)
        while len(loras) > self.max_loras:
            loras.popitem(last=False)

    def _drop_blocks(self, address: str) -> None:
        eid = self.ids.get(address)
        if eid is not None:
            self._drop_blocks_of(eid)

    def _drop_blocks_of(self, eid: int) -> None:
        bit = 1 << eid
        holders = self._holders
        for h in self._blocks.pop(eid, ()):
            clear_holder(holders, h, bit)

    def blocks_of(self, address: str) -> set[int]:
        """The endpoint's confirmed blocks (a copy; for tests and debugging)."""
        eid = self.ids.get(address)
        return set(self._blocks.get(eid, ())) if eid is not None else set()

    def size(self) -> int:
        return sum(map(len, self._blocks.values()))

    # -- speculative blocks (picks) -------------------------------------------------------------------------------

    def add_speculative(self, hashes: list[int], address: str, since: float | None = None) -> None:
        """`address` will hold `hashes`: those not confirmed or held count `speculative_ttl_s` seconds from
        `since` (default now; never earlier than the last expiry given, so the FIFO stays in order)."""
        if self.speculative_ttl_s <= 0 or not hashes:
            return
        eid = self.ids.assign(address)
        now = self.clock()
        self._expire(now)
        expiry = (now if since is None else min(since, now)) + self.speculative_ttl_s
        if self._spec_fifo:
            expiry = max(expiry, self._spec_fifo[-1][0])
        if expiry <= now:
            return
        confirmed = self._blocks.get(eid, ())
        holds = self._holds
        for h in hashes:
            if h in confirmed or (h, eid) in holds:
                continue
            self._spec.setdefault(h, {})[eid] = expiry
            self._spec_fifo.append((expiry, h, eid))
        while len(self._spec_fifo) > self.max_speculative:  # bounded: the oldest go first
            self._expire_one()

    def hold(self, hashes: list[int], address: str) -> list[int]:
        """A request in flight to `address` will compute `hashes`: those it does not hold yet count until
        `release` (per block, a count of the requests holding it). Returns the hashes it held — what `release`
        needs to be given: the blocks `address` already holds are most of a hot prompt's, so releasing only the
        others keeps a response's end cheap."""
        if self.speculative_ttl_s <= 0 or not hashes:
            return []
        eid = self.ids.assign(address)
        confirmed = self._blocks.get(eid, ())
        holds, spec = self._holds, self._spec
        held = [h for h in hashes if h not in confirmed]
        for h in held:
            key = (h, eid)
            holds[key] = holds.get(key, 0) + 1
            spec.setdefault(h, {})[eid] = _HELD
        return held

    def release(self, hashes: list[int], address: str, since: float | None = None) -> None:
        """The request that `hold` was given ended at `since` (default now; its prefill done): its blocks count
        `speculative_ttl_s` seconds more, unless another request still holds them; by then the engine's events
        confirm or remove them."""
        eid = self.ids.get(address)
        if eid is None:
            return  # the endpoint left the pool meanwhile: remove() dropped its holds
        holds = self._holds
        done = []
        for h in hashes:
            key = (h, eid)
            n = holds.get(key)
            if n is None:
                continue
            if n > 1:
                holds[key] = n - 1
            else:
                del holds[key]
                done.append(h)
        for h in done:
            self._unspec(h, eid)
        self.add_speculative(done, address, since)

    def _unspec(self, h: int, eid: int) -> None:
        holders = self._spec.get(h)
        if holders is not None:
            holders.pop(eid, None)
            if not holders:
                del self._spec[h]

    def held_size(self) -> int:
        return len(self._holds)

    def _expire(self, now: float) -> None:
        fifo = self._spec_fifo
        while fifo and fifo[0][0] <= now:
            self._expire_one()

    def _expire_one(self) -> None:
        expiry, h, eid = self._spec_fifo.popleft()
        holders = self._spec.get(h)
        if holders is not None and holders.get(eid) == expiry:
            del holders[eid]
            if not holders:
                del self._spec[h]

    def speculative_size(self) -> int:
        return sum(map(len, self._spec.values()))

    # -- matching -------------------------------------------------------------------------------------------------

    def match(self, hashes: list[int]) -> dict[str, int]:
        """{address: leading blocks of `hashes` it holds (confirmed or speculative)}, addresses with ≥ 1 only."""
        if not hashes:
            return {}
        if self._spec:
            self._expire(self.clock())
        holders, spec = self._holders, self._spec
        alive = holders.get(hashes[0], 0) | _spec_mask(spec.get(hashes[0]))
        out: dict[str, int] = {}
        for i in range(1, len(hashes)):
            if not alive:
                break
            h = hashes[i]
            here = alive & (holders.get(h, 0) | _spec_mask(spec.get(h)))
            gone = alive & ~here
            if gone:
                self._settle(gone, i, out)
            alive = here
        if alive:
            self._settle(alive, len(hashes), out)
        return out

    def _settle(self, mask: int, blocks: int, out: dict[str, int]) -> None:
        addresses = self.ids.addresses
        for eid in bits(mask):
            address = addresses[eid]
            if address is not None:
                out[address] = blocks


def _spec_mask(holders: dict[int, float] | None) -> int:
    """The speculative holders of one block ({endpoint id: expiry}) as a bitset."""
    if not holders:
        return 0
    mask = 0
    for eid in holders:
        mask |= 1 << eid
    return mask
