"""The pool's KV events into one precise index: which endpoints are subscribed, from which source, since when.

The precise prefix scorer owns an EventFeed: `start(deliver)` starts the subscriber thread (subscriber.py), whose
deltas `deliver` hands to the scheduler's thread, where they are applied to the index; `set_sources` subscribes new
or changed sources (each subscription a new generation the index watches, so deltas of an older one are dropped);
`remove` forgets an endpoint that left the pool; `stop` ends the thread.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvgate.epp.kv_events.sources import EventSource
from kvgate.epp.prefix.precise_index import Delta, PreciseIndex


class EventFeed:
    def __init__(self, index: PreciseIndex) -> None:
        self.index = index
        self.subscriber = None  # the KVEventSubscriber, while started
        self.sources: dict[str, EventSource] = {}  # address → its source, while subscribed

    def start(self, deliver: Callable, index_max_bytes: int) -> None:
        """`deliver(fn, deltas)` must run fn(deltas) on the scheduler's thread (the EPP's call_soon_threadsafe)."""
        from kvgate.epp.kv_events.subscriber import KVEventSubscriber

        if self.subscriber is None:
            self.subscriber = KVEventSubscriber(lambda deltas: deliver(self.apply, deltas), index_max_bytes)

    def apply(self, deltas: list[Delta]) -> None:
        for delta in deltas:
            self.index.apply(delta)

    def set_sources(self, sources: Iterable[EventSource]) -> None:
        """The pool's event sources now; new or changed ones are subscribed (endpoints that left: `remove`)."""
        if self.subscriber is None:
            return
        for source in sources:
            if self.sources.get(source.address) != source:
                generation = self.subscriber.next_generation()
                self.index.watch(source.address, generation)
                self.subscriber.subscribe(source, generation)
                self.sources[source.address] = source

    def remove(self, address: str) -> None:
        if self.sources.pop(address, None) is not None and self.subscriber is not None:
            self.subscriber.unsubscribe(address)

    def stop(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
            self.subscriber = None

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {"subscribed_endpoints": len(self.sources)}
        if self.subscriber is not None:
            out.update(self.subscriber.stats)
        return out
