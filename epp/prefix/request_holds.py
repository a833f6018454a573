"""The precise scorer's picks in flight: each request holds the blocks it will compute until its response ends.

The engine announces blocks only once it has prefilled them, and a burst to a fresh prefix must not spread over
the pool meanwhile, so a pick holds the prompt's blocks on its endpoint (PreciseIndex.hold). A block counts until
the engine's events announce it (from then on they decide), else while the request is in flight (at most
`max_hold_s`) and the index's `speculative_ttl_s` after its response ends:

    held until  the block's BlockStored,  or  min(pick + max_hold_s, response end) + speculative_ttl_s

A fixed TTL from the pick is not enough under load: a request can wait in the engine's queue longer than the
TTL before its prefill, its entries then expire before the events come, the prefix looks cold, the queue scorer
spreads it, and precise falls behind approximate (whose history never forgets); `kvgate bench routing --workloads
multi-tenant --rates 24 --configs precise,approximate` shows it with llm-d's precise weights.
"""

from __future__ import annotations

from collections import OrderedDict

from kvgate.epp.prefix.precise_index import PreciseIndex


class RequestHolds:
    """request id → (picked at, the block hashes it holds, the endpoint), in pick order; at most the index's
    `max_speculative` blocks held (the oldest requests released first). Time is the index's clock."""

    def __init__(self, index: PreciseIndex, max_hold_s: float) -> None:
        self.index = index
        self.max_hold_s = max_hold_s
        self._held: OrderedDict[str, tuple[float, list[int], str]] = OrderedDict()
        self.blocks = 0  # held blocks, all requests together

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, request_id: str, hashes: list[int], address: str) -> None:
        """The request was picked for `address` (picked again, a retry: the new pick replaces the old hold)."""
        held = self.index.hold(hashes, address)  # only the blocks it does not have yet: what is released later
        old = self._held.pop(request_id, None)
        if old is not None:
            self._release(old)
        self._held[request_id] = (self.index.clock(), held, address)
        self.blocks += len(held)
        self.sweep()

    def end(self, request_id: str) -> None:
        """The response ended (prefilled by now: the events confirm or remove its blocks within the TTL)."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self._release(held)

    def forget_endpoint(self, address: str) -> None:
        """The endpoint left the pool (PreciseIndex.remove already dropped the index's side)."""
        for rid in [rid for rid, (_, _, a) in self._held.items() if a == address]:
            self.blocks -= len(self._held.pop(rid)[1])

    def sweep(self) -> None:
        """Holds end at max_hold_s, and the oldest go first past the index's max_speculative held blocks."""
        held = self._held
        if not held:
            return
        oldest = self.index.clock() - self.max_hold_s
        while held:
            picked_at = next(iter(held.values()))[0]
            if picked_at <= oldest:  # the hold ran out at pick + max_hold_s
                self._release(held.popitem(last=False)[1], picked_at + self.max_hold_s)
            elif self.blocks > self.index.max_speculative:
                self._release(held.popitem(last=False)[1])
            else:
                break

    def _release(self, held: tuple[float, list[int], str], ended_at: float | None = None) -> None:
        self.blocks -= len(held[1])
        self.index.release(held[1], held[2], ended_at)
