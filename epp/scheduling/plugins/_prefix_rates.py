"""Each sticky prompt prefix's share of the recent requests: what the affinity filter's spill rule (spillShare) reads
to give a prefix whose traffic outgrows one endpoint more warm homes; and its rate (n_k / τ), what its second-home
rule (secondHome latency) weighs the wait a second home saves the prefix's next requests by.

    key(r)    = xxh3 of the prompt's first c characters, c = the affinity threshold's share of the prompt rounded
                down to a grid of eighth-octave steps (256 · 2^(i/8) characters): the prefix that makes a request
                warm where it is held, so requests share a key when one endpoint's cache makes them all warm (a
                tenant's system prompt under short user parts), and not when each is warm only for its own history
                (a conversation's turns, even under a system prompt the whole pool shares). The grid keeps the key
                stable while prompt lengths vary within ~9%. Prompts under 256 characters have no key.
    n_k(t)    = Σ over key k's requests i of exp(-(t - t_i) / τ)        τ = windowSeconds
    N(t)      = the same over every request
    share_k   = n_k / N  once N ≥ MIN_REQUESTS and a whole window has passed since the first request (before
                that: 0, so a pool's first requests spill nothing)

Why a whole window: the spill's fit test reads the group balance's footprints, which know only the groups picked so
far; a few seconds in, most replicas look empty, a copy fits everywhere, and the second home made then stays while
the other groups arrive and no longer fit beside it: every replica comes to serve more tenants than its cache holds
(`kvgate bench routing --workloads hot-tenant --per-request` lists each replica's tenants).

Bounded: at most `max_keys` keys, the least recently seen dropped first (its count with it).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable

import xxhash

MIN_KEY_CHARS = 256
GRID_STEPS_PER_OCTAVE = 8
MIN_REQUESTS = 64.0  # decayed requests in the window before any share counts
DEFAULT_MAX_KEYS = 4096  # ~150 bytes a key


def prefix_key(prompt: str, affinity_threshold: float) -> int | None:
    """The request's sticky-prefix key (see the module docstring); None for a prompt too short to have one."""
    target = affinity_threshold * len(prompt)
    if target < MIN_KEY_CHARS:
        return None
    steps = math.floor(GRID_STEPS_PER_OCTAVE * math.log2(target / MIN_KEY_CHARS) + 1e-9)
    cut = int(MIN_KEY_CHARS * 2.0 ** (steps / GRID_STEPS_PER_OCTAVE))
    return xxhash.xxh3_64_intdigest(prompt[:cut].encode("utf-8", "surrogatepass"))


class PrefixRates:
    """Exponentially decayed request counts per key and in all (lazy decay: each count is brought to `now` when it
    is read or added to)."""

    def __init__(self, window_s: float, clock: Callable[[], float], max_keys: int = DEFAULT_MAX_KEYS) -> None:
        self.window_s = window_s
        self.clock = clock
        self.max_keys = max_keys
        self._keys: OrderedDict[int, tuple[float, float]] = OrderedDict()  # key → (count, as of)
        self._total = (0.0, clock())
        self._first: float | None = None  # the first request's time

    def _decayed(self, entry: tuple[float, float], now: float) -> float:
        count, at = entry
        return count * math.exp(-max(now - at, 0.0) / self.window_s)

    def add(self, key: int | None) -> float:
        """Count one request (of `key`, or of none) now; the key's share after it."""
        now = self.clock()
        if self._first is None:
            self._first = now
        total = self._decayed(self._total, now) + 1.0
        self._total = (total, now)
        if key is None:
            return 0.0
        entry = self._keys.pop(key, None)
        count = (self._decayed(entry, now) if entry else 0.0) + 1.0
        self._keys[key] = (count, now)
        if len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        return count / total if total >= MIN_REQUESTS and now - self._first >= self.window_s else 0.0

    def settled(self) -> bool:
        """Whether shares count yet: MIN_REQUESTS decayed requests, and a whole window since the first."""
        now = self.clock()
        return (self._first is not None and now - self._first >= self.window_s
                and self._decayed(self._total, now) >= MIN_REQUESTS)

    def rate(self, key: int | None) -> float:
        """Key's requests per second, now: its decayed count over the window (≈ its arrival rate once a window has
        passed, less before: the first seconds count low). 0 for no key, or one not seen."""
        entry = self._keys.get(key) if key is not None else None
        return self._decayed(entry, self.clock()) / self.window_s if entry else 0.0

    def __len__(self) -> int:
        return len(self._keys)
