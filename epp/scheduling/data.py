"""What plugins hand each other through a scheduling cycle: data keys, and values per candidate endpoint.

A plugin declares, as class attributes, the keys it writes (`Plugin.produces`) and those it reads (`consumes`: it
cannot work without them; `consumes_optional`: it does without them when its profile has no producer). A producer
writes `cycle.put(self, KEY, value)`; a consumer reads `cycle.read(self, KEY)`. The framework links them when a
profile is built (SchedulingProfile.link): each key a plugin reads comes from one producer of its profile — the one
its config names (`Plugin.sources`), else the profile's only one — and a key it needs that nothing produces is a
configuration error. The cycle holds each producer's data apart (by its plugin name), so two producers of one key
in a profile serve the consumers that name them.

The keys the scheduler reads back for its caller (the director) are here too: a plugin declares them in
`produces` like any other, and the director asks the Scheduler, never a plugin.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from itertools import repeat

import numpy as np

from kvgate.epp.types import EndpointState

_address_of = operator.attrgetter("endpoint.address")


class DataKey:
    """Names one kind of data in a scheduling cycle; one object per kind (compared by identity, so that a cycle's
    lookups hash it at C speed). `choose`: how a config picks among several producers of it in one profile (said in
    the error when it did not)."""

    __slots__ = ("name", "choose")

    def __init__(self, name: str, choose: str = "") -> None:
        self.name = name
        self.choose = choose

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"DataKey({self.name!r})"


# Read back by the scheduler for the director (Scheduler.picked_uncached_tokens, Scheduler.objectives_unmeetable):
# the prompt tokens the picked endpoint must really prefill (the prompt less its cached prefix), written by a pick
# hook; the director records that, rather than the whole prompt, as the pick's unseen backlog (live_load.py).
PICKED_UNCACHED_TOKENS = DataKey("picked-uncached-prompt-tokens")
# The request states latency objectives and no endpoint is predicted to meet them, written while scoring: the
# director sheds such a request when it is sheddable (priority < 0), as llm-d's SLO scorer does.
OBJECTIVES_UNMEETABLE = DataKey("latency-objectives-unmeetable")
# Per candidate, for plugins that weigh where a request should go against what it costs there (the affinity
# filter's second home): its predicted TTFT in seconds (predicted-latency-scorer, from the engines' own models
# where they publish them), and the delay its uncached prefill there puts on the other requests, in
# request-seconds (prefill-interference-scorer). Both PerEndpoint, computed at the first read (Deferred).
PREDICTED_TTFT = DataKey("predicted-ttft-seconds", "keep one predicted-latency-scorer")
PREFILL_HARM = DataKey("prefill-harm-request-seconds", "keep one prefill-interference-scorer")


class Deferred:
    """A producer's data computed when a consumer first reads it (CycleState.read), at most once per cycle: for data
    that would cost more to compute in every cycle, for every candidate, than the few cycles that read it need."""

    __slots__ = ("compute",)

    def __init__(self, compute: Callable[[], object]) -> None:
        self.compute = compute


class PerEndpoint:
    """Values for a cycle's candidate endpoints, read for any list of them: the candidates themselves, a filtered
    list, the snapshot's copy, the one picked endpoint. An endpoint outside the candidates reads `missing`.
    Read-only: readers compute new arrays from what `of` returns."""

    __slots__ = ("endpoints", "values", "missing", "_positions", "_padded", "_last_list", "_last")

    def __init__(self, endpoints: list[EndpointState], values: np.ndarray, missing: float = 0.0) -> None:
        self.endpoints = endpoints
        self.values = values
        self.missing = missing
        self._positions: dict[str, int] | None = None  # address → position among the candidates
        self._padded: np.ndarray | None = None  # the values, then `missing`
        self._last_list: Sequence[EndpointState] | None = None  # of()'s last other list, and its answer
        self._last: np.ndarray | None = None

    def of(self, endpoints: Sequence[EndpointState]) -> np.ndarray:
        """The values aligned with `endpoints`."""
        if endpoints is self.endpoints:
            return self.values
        if endpoints is self._last_list:
            return self._last
        n = len(self.endpoints)
        if len(endpoints) == n and all(map(operator.is_, endpoints, self.endpoints)):
            out = self.values
        else:
            values, missing = self.values, self.missing
            if len(endpoints) * 16 <= n:  # a few of many (a filter's survivors, a pick hook's one): found by a scan
                out = np.array([values[i] if i < n else missing for i in map(self._position, endpoints)], dtype=float)
            else:
                if self._padded is None:
                    self._padded = np.append(values, missing)
                get = self._by_address().get
                out = self._padded[np.fromiter(map(get, map(_address_of, endpoints), repeat(n)), dtype=np.intp,
                                               count=len(endpoints))]
        self._last_list, self._last = endpoints, out
        return out

    def _position(self, endpoint: EndpointState) -> int:
        """`endpoint`'s position among the candidates (a C-level identity scan, cheaper than indexing a thousand
        addresses for one); another state object by its address; len(endpoints) where none has it."""
        try:
            return self.endpoints.index(endpoint)
        except ValueError:
            return self._by_address().get(endpoint.address, len(self.endpoints))

    def _by_address(self) -> dict[str, int]:
        if self._positions is None:
            self._positions = dict(zip(map(_address_of, self.endpoints), range(len(self.endpoints))))
        return self._positions
