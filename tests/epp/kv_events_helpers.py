"""Test helpers for the EPP's KV-event subscriber: an event publisher speaking vLLM's wire format (both
encodings, chosen sequence numbers, a replay socket whose buffer the test controls), and a scorer whose index
deltas the test applies on its own thread."""

from __future__ import annotations

import queue
import time

import msgpack
import zmq

from kvgate.epp.kv_events.sources import EventSource
from kvgate.epp.scheduling.framework import PluginContext
from kvgate.epp.scheduling.plugins.precise_prefix_cache_scorer import PrecisePrefixCacheScorer
from kvgate.common.processes import free_port


def stored(hashes, parent, tokens, block_size, encoding="map", salt=None):
    if encoding == "map":
        return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
                "block_size": block_size, "lora_id": None, "medium": "GPU", "lora_name": None,
                "extra_keys": [[salt] if salt is not None and i == 0 else None for i in range(len(hashes))]}
    return ["BlockStored", hashes, parent, tokens, block_size, None, "GPU"]  # vLLM ≤ 2025: positional


def removed(hashes, encoding="map"):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"} if encoding == "map" \
        else ["BlockRemoved", hashes, "GPU"]


def cleared(encoding="map"):
    return {"type": "AllBlocksCleared"} if encoding == "map" else ["AllBlocksCleared"]


def batch(events, encoding="map") -> bytes:
    body = {"ts": time.time(), "events": events, "data_parallel_rank": 0} if encoding == "map" \
        else [time.time(), events, 0]
    return msgpack.packb(body, use_bin_type=True)


class Publisher:
    """XPUB (so the test knows when the subscriber has joined) + ROUTER replay, on loopback."""

    def __init__(self, ctx: zmq.Context, topic: bytes = b"kv", replay: bool = True) -> None:
        self.topic = topic
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.port = free_port("127.0.0.1")
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.router = None
        self.replay_port = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            self.replay_port = free_port("127.0.0.1")
            self.router.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.buffer: dict[int, bytes] = {}  # what the replay socket can give back
        self.replay_requests: list[int] = []

    def source(self, address: str) -> EventSource:
        return EventSource(address, f"tcp://127.0.0.1:{self.port}",
                           f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None, self.topic.decode())

    def wait_subscribed(self, timeout: float = 5.0) -> None:
        assert self.pub.poll(int(timeout * 1000)), "the subscriber never subscribed"
        assert self.pub.recv()[0] == 1

    def send(self, seq: int, payload: bytes, buffer: bool = True, publish: bool = True) -> None:
        if buffer:
            self.buffer[seq] = payload
        if publish:
            self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def serve_replays(self) -> None:
        while self.router is not None and self.router.poll(0):
            client, _, start = self.router.recv_multipart()
            start = int.from_bytes(start, "big")
            self.replay_requests.append(start)
            for seq in sorted(self.buffer):
                if seq >= start:
                    self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), self.buffer[seq]])
            self.router.send_multipart([client, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)


class Harness:
    """A precise scorer with its subscriber thread; deltas are applied when the test pumps."""

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("speculative_ttl_s", 0.0)
        self.scorer = PrecisePrefixCacheScorer(**kwargs)
        self.deltas: queue.Queue = queue.Queue()
        self.scorer.start(PluginContext(deliver=lambda fn, deltas: self.deltas.put((fn, deltas))))
        self.index = self.scorer.index
        self.publishers: list[Publisher] = []

    def subscribe(self, address: str, publisher: Publisher) -> None:
        self.publishers.append(publisher)
        self.scorer.set_sources([publisher.source(address)])
        publisher.wait_subscribed()

    def pump(self, until, timeout: float = 5.0) -> None:
        """Apply deltas (and answer replays) until `until()` holds; AssertionError after `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            for p in self.publishers:
                p.serve_replays()
            try:
                fn, deltas = self.deltas.get(timeout=0.01)
                fn(deltas)
            except queue.Empty:
                pass
            if until():
                return
            assert time.monotonic() < deadline, f"not reached in {timeout} s; stats {self.scorer.subscriber.stats}"

    def applied(self, address: str, seq: int) -> bool:
        return self.scorer.subscriber.last_seq(address) == seq and self.deltas.empty()

    def close(self) -> None:
        self.scorer.stop()
        for p in self.publishers:
            p.close()
