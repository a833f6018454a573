"""The ZeroMQ sockets of one endpoint's KV events (vLLM's transport, engine/kv_event_publisher.py): a SUB socket
with its connection monitor, and a replay DEALER to the engine's ROUTER, all registered with the worker's poller.

  - SUB: connected to the event address, subscribed to the topic; receive HWM `RCVHWM` messages; ZeroMQ
    reconnects by itself, backing off from 100 ms to `RECONNECT_MAX_S`;
  - the monitor (a PAIR socket) reports the SUB's connections and disconnections: the subscriber reads a
    reconnection as a possibly restarted engine;
  - replay DEALER: [b"", start] → [b"", seq, payload]... [b"", -1 (`END_OF_REPLAY`), b""].
Every socket takes frames of at most `max_message_bytes` (ZMQ_MAXMSGSIZE): ZeroMQ drops a connection that sends
a bigger one, and does not reconnect after such a protocol error, so the subscriber replaces the socket
(`reopen_sub`, `reopen_replay`).
"""

from __future__ import annotations

import logging

import zmq

from kvgate.epp.kv_events.sources import EventSource

log = logging.getLogger("kvgate.epp.kv_events.subscriber")  # the logger these lines always had

RCVHWM = 10_000  # batches queued per SUB socket before ZeroMQ drops (then a gap, then a replay)
RECONNECT_MAX_S = 5.0
END_OF_REPLAY = (1 << 64) - 1  # -1 as a signed 8-byte number, read unsigned


class EndpointSockets:
    """One endpoint's SUB, monitor and (when it has one) replay sockets, registered with `poller`."""

    def __init__(self, ctx: zmq.Context, poller: zmq.Poller, source: EventSource, max_message_bytes: int) -> None:
        self._ctx, self._poller, self.source = ctx, poller, source
        self.max_message_bytes = max_message_bytes
        self.sub, self.monitor = self._open_sub()
        try:
            self.replay = self._socket(zmq.DEALER, source.replay_endpoint) if source.replay_endpoint else None
        except Exception:
            self._close_sub()
            raise
        log.info("KV events of %s: SUB %s, replay %s", source.address, source.endpoint,
                 source.replay_endpoint or "off")
        for sock in (self.sub, self.monitor, self.replay):
            if sock is not None:
                poller.register(sock, zmq.POLLIN)

    def reopen_sub(self) -> None:
        """A new SUB socket (and monitor): ZeroMQ reconnects by itself after a network error, but not after a
        protocol error, and a frame over MAXMSGSIZE is one: the connection would stay down."""
        self._poller.unregister(self.sub)
        self._poller.unregister(self.monitor)
        self._close_sub()
        self.sub, self.monitor = self._open_sub()
        self._poller.register(self.sub, zmq.POLLIN)
        self._poller.register(self.monitor, zmq.POLLIN)

    def reopen_replay(self) -> None:
        """A new DEALER (late answers to the old one are gone with it): a DEALER dropped for a frame over
        MAXMSGSIZE never reconnects by itself."""
        if self.replay is None:
            return
        self._poller.unregister(self.replay)
        self.replay.close(linger=0)
        self.replay = self._socket(zmq.DEALER, self.source.replay_endpoint)
        self._poller.register(self.replay, zmq.POLLIN)

    def ask_replay(self, start: int) -> bool:
        """Ask for the batches from `start` on; False when the request cannot be queued now (never blocks the
        thread on one endpoint's replay socket)."""
        try:
            self.replay.send_multipart([b"", start.to_bytes(8, "big")], zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def unregister(self) -> None:
        for sock in (self.sub, self.monitor, self.replay):
            if sock is not None:
                self._poller.unregister(sock)

    def close(self) -> None:
        self._close_sub()
        if self.replay is not None:
            self.replay.close(linger=0)

    def _close_sub(self) -> None:
        self.sub.disable_monitor()
        self.monitor.close(linger=0)
        self.sub.close(linger=0)

    def _open_sub(self):
        sub, monitor = self._socket(zmq.SUB, self.source.endpoint, connect=False), None
        try:
            sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
            # the monitor first: a connection made before it exists would never be reported
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sub.connect(self.source.endpoint)
            return sub, monitor
        except Exception:
            if monitor is not None:
                sub.disable_monitor()
                monitor.close(linger=0)
            sub.close(linger=0)
            raise

    def _socket(self, kind, endpoint: str, connect: bool = True):
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)  # a bigger frame: ZeroMQ drops the connection
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(RECONNECT_MAX_S * 1000))
        if "[" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        if connect:
            sock.connect(endpoint)
        return sock
