"""Publishes the engine's KV-cache event batches over ZeroMQ, as vLLM's ZmqEventPublisher does on the wire.

The engine step only numbers a batch and puts it on a queue (`publish`, never blocking: a full queue drops the
batch, and the skipped sequence number tells subscribers they missed one). A step's batch bigger than
`max_batch_bytes` (an upper bound of its encoded size, kv_events.split_batch) is first cut into several batches,
each with a number of its own. A background thread owns both sockets: it encodes each batch
(kv_events.encode_batch), sends it on the PUB socket as the multipart message

    [topic, sequence number (8 bytes, big-endian), msgpack payload]

and keeps the last `buffer_steps` payloads (and at most `max_buffer_bytes`). A subscriber that sees a gap asks
the ROUTER socket (`replay_endpoint`) for the batches from a sequence number on: it sends [b"", start (8 bytes,
big-endian)] from a DEALER (or a REQ), and gets one [b"", seq, payload] per buffered batch from there, then
[b"", -1 (8 bytes, signed), b""] to mark the end.

What a peer of the sockets can cost (who may connect at all is the NetworkPolicy's job, README):
  - live batches never wait behind replays: each round of the thread sends every queued live batch first, then
    at most `_REPLAY_SLICE` replay messages and reads at most `_REQUESTS_PER_ROUND` requests;
  - one replay answer is at most `max_replay_batches` batches and `max_replay_bytes` bytes: the oldest from the
    start asked for, so the subscriber can apply them in order and ask again from where it stopped (vLLM sends
    the whole buffer; a cut-short answer looks the same on the wire, only shorter);
  - replay requests are rate-limited per peer (ROUTER identity; `replay_requests_per_s`) and over all peers
    (`replay_requests_per_s_total`), bursts of 5 s worth; at most `_MAX_PENDING_ANSWERS` answers wait. A request
    over a limit gets the end marker alone (the subscriber knows at once that the gap stays, instead of waiting
    for a timeout); a malformed one is dropped; a request bigger than `_MAX_REQUEST_BYTES` disconnects its peer
    (ZMQ_MAXMSGSIZE);
  - a subscriber that never reads holds at most `subscriber_hwm` messages queued (ZeroMQ drops the rest for it,
    and it sees a gap): the PUB socket's SNDHWM is `hwm` cut to `max_subscriber_bytes` / the largest message, so
    memory is bounded by subscribers x max_subscriber_bytes (messages are shared between subscribers' queues);
    a replay peer that does not read holds at most two answers (the ROUTER's SNDHWM), the rest is dropped — two,
    not one: ZeroMQ gives the ROUTER its send credit back only as the peer's I/O thread reports what was read, so
    under CPU load a peer that read one answer whole still counted against the next, which then lost batches in
    its middle (tests/engine/test_kv_events_limits.py::test_one_replay_request_gets_at_most_the_bound_oldest_first,
    1 run in 6 with both cores busy).

Sockets: the PUB endpoint is bound when it holds `*` or `::` or is ipc:// or inproc:// (`tcp://*:5557` listens
on all interfaces), and connected to otherwise (a collector that binds, llm-d's centralized mode); vLLM's rule.
The replay endpoint is always bound. Both are closed on `shutdown()`, without lingering.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvgate.common.errors import ConfigError
from kvgate.engine.kv_events import KVEventBatch, KVEventsConfig, encode_batch, split_batch

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# How long the thread waits on an empty queue before it looks at the replay socket again: a replay request
# waits at most this long; an idle engine wakes the thread this often.
_POLL_S = 0.05
_SHUTDOWN_S = 2.0
# Replay work per round of the thread, between two looks at the live queue: a live batch waits behind at most
# this many replay sends (~µs each) and request reads.
_REPLAY_SLICE = 32
_REQUESTS_PER_ROUND = 64
_MAX_PENDING_ANSWERS = 16
_MAX_PEERS = 1024  # rate-limit state kept for this many replay peers (least recently seen forgotten first)
_MAX_REQUEST_BYTES = 64  # a replay request's frames are 0 and 8 bytes; a subscription is 1 byte + the topic
_MAX_SUBSCRIPTION_EXTRA = 1024


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(slots=True)
class _TokenBucket:
    rate: float
    burst: int
    tokens: float = 0.0
    stamp: float = 0.0

    def has_one(self, now: float) -> bool:
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.tokens >= 1


@dataclass(slots=True)
class _Answer:
    client: bytes
    batches: deque[tuple[int, bytes]] = field(default_factory=deque)


class ZmqKVEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque()  # bounded by buffer_steps and max_buffer_bytes
        self._buffer_bytes = 0
        self._answers: deque[_Answer] = deque()
        self._peers: OrderedDict[bytes, _TokenBucket] = OrderedDict()
        self._all_peers = _TokenBucket(config.replay_requests_per_s_total, config.replay_burst_total,
                                       config.replay_burst_total, time.monotonic())
        self._next_seq = 0
        self.last_sent_seq = -1  # the thread's progress (tests wait on it)
        self.num_dropped = 0
        self.num_blocks_too_big = 0  # blocks whose event alone exceeds max_batch_bytes: not published
        self.stats = {"replay_requests": 0, "replays_answered": 0, "replays_refused": 0, "replay_batches": 0,
                      "malformed_replay_requests": 0}
        self._ctx = zmq.Context()
        # Sockets are made and bound here, so a bad or busy address fails the engine's start with a clear
        # error, and from then on are used only by the publisher thread (zmq sockets are not thread-safe).
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.subscriber_hwm)
            self._pub.setsockopt(zmq.MAXMSGSIZE, len(self._topic) + _MAX_SUBSCRIPTION_EXTRA)
            self._pub.setsockopt(zmq.LINGER, 0)
            if "[" in config.endpoint:
                self._pub.setsockopt(zmq.IPV6, 1)
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (config.max_replay_batches + 1))  # two answers a peer
                self._replay.setsockopt(zmq.MAXMSGSIZE, _MAX_REQUEST_BYTES)
                if "[" in config.replay_endpoint:
                    self._replay.setsockopt(zmq.IPV6, 1)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(f"--kv-events-config: cannot open {config.endpoint}"
                              f"{' / ' + config.replay_endpoint if config.replay_endpoint else ''}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="kvgate-kv-events", daemon=True)
        self._thread.start()
        log.info("KV-cache events: PUB %s %s (HWM %d messages), replay %s, topic %r",
                 "bound to" if _binds(config.endpoint) else "connected to", config.endpoint,
                 config.subscriber_hwm, config.replay_endpoint or "off", config.topic)

    # -- the engine's side --------------------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch gets (= batches published so far, dropped ones included)."""
        return self._next_seq

    def publish(self, batch: KVEventBatch) -> None:
        """Number the batch (cut to max_batch_bytes first) and queue it; never blocks the step."""
        parts, too_big = split_batch(batch, self.config.max_batch_bytes)
        if too_big:
            self.num_blocks_too_big += too_big
            log.warning("KV-cache events: %d block(s) left out: one block's event exceeds max_batch_bytes %d "
                        "(a long cache_salt or adapter name)", too_big, self.config.max_batch_bytes)
        for part in parts:
            seq = self._next_seq
            self._next_seq += 1
            try:
                self._queue.put_nowait((seq, part))
            except queue.Full:
                self.num_dropped += 1
                if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                    log.warning("KV-cache events: the publisher fell behind; %d batches dropped", self.num_dropped)

    def shutdown(self) -> None:
        """Send what is queued (bounded wait), then close the sockets."""
        if self._thread.is_alive():
            try:
                self._queue.put(None, timeout=_SHUTDOWN_S)
            except queue.Full:
                pass
            self._thread.join(_SHUTDOWN_S)
        if not self._thread.is_alive():
            self._close_sockets()

    def buffered(self) -> list[tuple[int, bytes]]:
        """(seq, payload) of what the replay buffer holds now, oldest first (diagnostics and tests)."""
        return list(self._buffer)

    # -- the publisher thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            while True:  # live first: everything queued now goes out before any replay work
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    return
                self._send_live(*item)
            if self._replay is not None:
                self._take_replay_requests()
                self._send_replay_slice()
                if self._answers:
                    continue
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            self._send_live(*item)

    def _send_live(self, seq: int, batch: KVEventBatch) -> None:
        try:
            payload = encode_batch(batch, self.data_parallel_rank)
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            self._buffer_bytes += len(payload)
            while len(self._buffer) > self.config.buffer_steps or self._buffer_bytes > self.config.max_buffer_bytes:
                self._buffer_bytes -= len(self._buffer.popleft()[1])
        except Exception:  # noqa: BLE001 - one bad batch must not end the stream
            log.exception("KV-cache events: publishing batch %d failed", seq)
        self.last_sent_seq = seq

    def _take_replay_requests(self) -> None:
        import zmq

        for _ in range(_REQUESTS_PER_ROUND):
            try:
                frames = self._replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self.stats["malformed_replay_requests"] += 1
                continue
            self.stats["replay_requests"] += 1
            client, start = frames[0], int.from_bytes(frames[2], "big")
            if not self._admit(client):
                self.stats["replays_refused"] += 1
                if self.stats["replays_refused"] in (1, 100) or self.stats["replays_refused"] % 10_000 == 0:
                    log.warning("KV-cache events: %d replay requests refused (over the rate or too many at once)",
                                self.stats["replays_refused"])
                self._send_replay(client, END_OF_REPLAY, b"")
                continue
            answer, size = _Answer(client), 0
            for seq, payload in self._buffer:  # oldest first: a prefix the subscriber can apply in order
                if seq < start:
                    continue
                if len(answer.batches) == self.config.max_replay_batches \
                        or size + len(payload) > self.config.max_replay_bytes:
                    break
                answer.batches.append((seq, payload))
                size += len(payload)
            self._answers.append(answer)

    def _admit(self, client: bytes) -> bool:
        """Whether a replay request of `client` is within the limits; takes its tokens if so."""
        if len(self._answers) >= _MAX_PENDING_ANSWERS:
            return False
        now = time.monotonic()
        peer = self._peers.pop(client, None)
        if peer is None:
            peer = _TokenBucket(self.config.replay_requests_per_s, self.config.replay_burst_per_peer,
                                self.config.replay_burst_per_peer, now)
        self._peers[client] = peer  # most recently seen last
        while len(self._peers) > _MAX_PEERS:
            self._peers.popitem(last=False)
        if not (peer.has_one(now) and self._all_peers.has_one(now)):
            return False
        peer.tokens -= 1
        self._all_peers.tokens -= 1
        return True

    def _send_replay_slice(self) -> None:
        budget = _REPLAY_SLICE
        while budget and self._answers:
            answer = self._answers[0]
            if answer.batches:
                seq, payload = answer.batches.popleft()
                self._send_replay(answer.client, seq.to_bytes(8, "big"), payload)
                self.stats["replay_batches"] += 1
            else:
                self._send_replay(answer.client, END_OF_REPLAY, b"")
                self._answers.popleft()
                self.stats["replays_answered"] += 1
            budget -= 1

    def _send_replay(self, client: bytes, seq_bytes: bytes, payload: bytes) -> None:
        import zmq

        try:  # a ROUTER never blocks: a peer that went away, or does not read, loses the message
            self._replay.send_multipart((client, b"", seq_bytes, payload), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.debug("KV-cache events: replay to a client failed: %s", exc)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()


def kv_events_enabled(config: KVEventsConfig | None) -> bool:
    """Whether KV-cache events are published (publisher "zmq"): only then does the block pool record them."""
    return config is not None and config.enabled


def create_publisher(config: KVEventsConfig | None) -> ZmqKVEventPublisher | None:
    """A publisher when events are on (kv_events_enabled); None otherwise."""
    return ZmqKVEventPublisher(config) if kv_events_enabled(config) else None
