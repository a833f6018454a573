"""Publishes the engine's KV-cache event batches over ZeroMQ, as vLLM's ZmqEventPublisher does on the wire.

The engine step only numbers a batch and puts it on a queue (`publish`, never blocking: a full queue drops the
batch, and the skipped sequence number tells subscribers they missed one). A background thread owns both sockets:
it encodes each batch (kv_events.encode_batch), sends it on the PUB socket as the multipart message

    [topic, sequence number (8 bytes, big-endian), msgpack payload]

and keeps the last `buffer_steps` payloads. A subscriber that sees a gap asks the ROUTER socket
(`replay_endpoint`) for everything from a sequence number on: it sends [b"", start (8 bytes, big-endian)] from a
DEALER (or a REQ), and gets one [b"", seq, payload] per buffered batch from there, then [b"", -1 (8 bytes,
signed), b""] to mark the end.

Sockets: the PUB endpoint is bound when it holds `*` or `::` or is ipc:// or inproc:// (`tcp://*:5557` listens
on all interfaces), and connected to otherwise (a collector that binds, llm-d's centralized mode); vLLM's rule.
The replay endpoint is always bound. Both are closed on `shutdown()`, without lingering.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque

from kvgate.engine.errors import ConfigError
from kvgate.engine.kv_events import KVEventBatch, KVEventsConfig, encode_batch

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# How long the thread waits on an empty queue before it looks at the replay socket again: a replay request
# waits at most this long; an idle engine wakes the thread this often.
_POLL_S = 0.05
_SHUTDOWN_S = 2.0


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKVEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self.config = config
        self.data_parallel_rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[int, KVEventBatch] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self.num_dropped = 0
        self._ctx = zmq.Context()
        # Sockets are made and bound here, so a bad or busy address fails the engine's start with a clear
        # error, and from then on are used only by the publisher thread (zmq sockets are not thread-safe).
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
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
                if "[" in config.replay_endpoint:
                    self._replay.setsockopt(zmq.IPV6, 1)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ConfigError(f"--kv-events-config: cannot open {config.endpoint}"
                              f"{' / ' + config.replay_endpoint if config.replay_endpoint else ''}: {exc}") from None
        self._thread = threading.Thread(target=self._run, name="kvgate-kv-events", daemon=True)
        self._thread.start()
        log.info("KV-cache events: PUB %s %s, replay %s, topic %r", "bound to" if _binds(config.endpoint)
                 else "connected to", config.endpoint, config.replay_endpoint or "off", config.topic)

    # -- the engine's side --------------------------------------------------------------------------------------

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch gets (= batches published so far, dropped ones included)."""
        return self._next_seq

    def publish(self, batch: KVEventBatch) -> None:
        """Number the batch and queue it; never blocks the step."""
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, batch))
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

    # -- the publisher thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                self._serve_replays()
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, batch = item
            try:
                payload = encode_batch(batch, self.data_parallel_rank)
                seq_bytes = seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq_bytes, payload))
                self._buffer.append((seq, payload))
            except Exception:  # noqa: BLE001 - one bad batch must not end the stream
                log.exception("KV-cache events: publishing batch %d failed", seq)

    def _serve_replays(self) -> None:
        import zmq

        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("KV-cache events: ignoring a malformed replay request (%d frames)", len(frames))
                continue
            client, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            try:
                for seq, payload in self._buffer:
                    if seq >= start:
                        self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
                self._replay.send_multipart((client, b"", END_OF_REPLAY, b""))
            except zmq.ZMQError as exc:  # the client went away mid-reply
                log.warning("KV-cache events: replay to a client failed: %s", exc)

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()


def create_publisher(config: KVEventsConfig | None) -> ZmqKVEventPublisher | None:
    """A publisher when events are on (publisher "zmq"); None otherwise (the pool then records nothing)."""
    if config is None or not config.enabled:
        return None
    return ZmqKVEventPublisher(config)
