"""The KV-event subscriber: one background thread, a ZeroMQ SUB socket per endpoint, deltas to the index.

Why a thread and not an asyncio task on the EPP's loop: a batch holding one 1k-token prompt's BlockStored (63
blocks of 16) costs ~19 µs to msgpack-decode and ~28 µs to hash; applying its delta to the index ~10 µs
(best of 300, shared 2-core box). The thread keeps the first two (~80% of the work) and ZeroMQ's blocking
poll off the loop that answers Envoy; the GIL still shares the CPU, but in 5 ms slices rather than inside a
decision, and sockets get one owner thread as ZeroMQ wants. The thread only makes `Delta`s (the blocks' EPP
hashes, computed here); `deliver` hands them to the loop (`loop.call_soon_threadsafe`), where the index is
changed by one writer, so the scorer reads it without locks.

Per endpoint (vLLM's transport, engine/kv_event_publisher.py):
  - a SUB socket connected to its event address, subscribed to the topic; receive HWM `RCVHWM` messages; ZeroMQ
    reconnects by itself, backing off from 100 ms to `RECONNECT_MAX_S`;
  - the 8-byte big-endian sequence number of every batch: the next one applies; one further on is a gap — the
    replay socket (a DEALER to the engine's ROUTER; [b"", start] → [b"", seq, payload]... [b"", -1, b""]) is
    asked for the missing range while live batches wait (at most `MAX_HELD` of them); if the replay answers
    within `REPLAY_TIMEOUT_S` and covers the gap, the index stays exact; otherwise (no replay socket, the batches
    fell out of its buffer, no answer) the endpoint's blocks are dropped and rebuilt from the events that follow;
  - a sequence number at or below the last one applied means the engine restarted (its numbering begins at 0):
    its blocks are dropped, as on AllBlocksCleared. A restarted engine can also have published past the old
    number before the EPP reconnects, so a reconnection (ZeroMQ's socket monitor: connected again after a
    disconnect) drops the endpoint's blocks too, and the history is read again as for a first batch (below):
    a network blip costs a rebuild from the replay buffer, never a stale index;
  - on connecting (and on the first batch seen, when it is not seq 0) the history is asked for from 0, when a
    replay socket exists: an EPP that starts after its engines learns what they hold at once, idle engines
    included; a buffer that no longer reaches back to 0 gives what it still holds.
An endpoint leaving the pool (`set_endpoints`) has its socket closed and its mapping dropped; the index side is
told through a new generation (index.PreciseIndex.watch/remove).

Memory: the engine-hash → EPP-hash mapping costs about `BYTES_PER_BLOCK` per cached block (both dicts, measured
with tracemalloc in the test); past `max_bytes` over all endpoints, stored blocks are not indexed (counted in
`blocks_over_budget`): the index then under-reports, which routes like a miss, never to a block that is gone.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvgate.epp.kv_events.decode import BadPayload, Cleared, Removed, Stored, decode_batch
from kvgate.epp.kv_events.index import Delta, chain, root_hash

log = logging.getLogger(__name__)

RCVHWM = 10_000  # batches queued per SUB socket before ZeroMQ drops (then a gap, then a replay)
RECONNECT_MAX_S = 5.0
REPLAY_TIMEOUT_S = 2.0
MAX_HELD = 1000  # live (or replayed) batches held per endpoint while a replay is under way
POLL_MS = 50  # how often the thread looks at its command queue
# Removed blocks still known as parents, per endpoint: a child stored just after its parent's cached copy was
# evicted (another request's copy of the parent was still in use) is still keyed. Outside the budget: 256 ×
# ~150 B per endpoint, 38 MB at 1000 endpoints.
RECENTLY_REMOVED = 256
BYTES_PER_BLOCK = 250
DEFAULT_MAX_BYTES = 256 * 1024 * 1024
OPEN_END = 1 << 63  # a replay asked for on connecting: no live batch bounds it
END_OF_REPLAY = (1 << 64) - 1  # -1 as a signed 8-byte number, read unsigned


@dataclass(frozen=True)
class EventSource:
    """Where an endpoint publishes its events."""

    address: str  # the endpoint ("ip:port"), the index's key
    endpoint: str  # tcp://ip:port of its PUB socket
    replay_endpoint: str | None = None
    topic: str = ""

    def with_topic(self, topic: str) -> "EventSource":
        return EventSource(self.address, self.endpoint, self.replay_endpoint, topic)


class EngineHashes:
    """One endpoint's engine hash → EPP hash, with counts of engine hashes per EPP hash (set semantics below)."""

    def __init__(self) -> None:
        self.ours: dict[object, int] = {}
        self.count: dict[int, int] = {}
        self.recent: OrderedDict[object, int] = OrderedDict()  # removed ones, for parent lookups

    def parent(self, engine_hash) -> int | None:
        h = self.ours.get(engine_hash)
        return h if h is not None else self.recent.get(engine_hash)

    def clear(self) -> None:
        self.ours.clear()
        self.count.clear()
        self.recent.clear()


@dataclass
class _Stream:
    source: EventSource
    generation: int
    sub: object
    replay: object | None = None
    hashes: EngineHashes = field(default_factory=EngineHashes)
    last_seq: int | None = None
    delivered_seq: int | None = None  # last_seq once its deltas were handed to `deliver`
    replay_until: int | None = None  # seq of the live batch that showed the gap (replay covers up to it)
    replay_deadline: float = 0.0
    replayed: dict[int, bytes] = field(default_factory=dict)
    held: list[tuple[int, bytes]] = field(default_factory=list)
    monitor: object | None = None  # PAIR socket of ZeroMQ's monitor of `sub`: connects and disconnects
    disconnected: bool = False


class KVEventSubscriber:
    def __init__(self, deliver, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        import zmq

        self._zmq = zmq
        self.deliver = deliver  # called from the thread with a list of Deltas
        self.max_blocks = max(1, max_bytes // BYTES_PER_BLOCK)
        self._ctx = zmq.Context()
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._generation = 0
        self._blocks = 0
        self.stats = {"batches": 0, "gaps": 0, "replays_ok": 0, "replays_failed": 0, "restarts": 0,
                      "reconnects": 0, "bad_payloads": 0, "blocks_stored": 0, "blocks_removed": 0,
                      "blocks_over_budget": 0, "orphan_blocks": 0}
        self._thread = threading.Thread(target=self._run, name="kvgate-epp-kv-events", daemon=True)
        self._stop = threading.Event()
        self._thread.start()

    # -- the loop's side ------------------------------------------------------------------------------------------

    def next_generation(self) -> int:
        self._generation += 1
        return self._generation

    def subscribe(self, source: EventSource, generation: int) -> None:
        self._commands.put(("subscribe", source, generation))

    def unsubscribe(self, address: str) -> None:
        self._commands.put(("unsubscribe", address, 0))

    def last_seq(self, address: str) -> int | None:
        """The sequence number of the last batch whose deltas were delivered for `address` (read from another
        thread: a hint, for tests and metrics)."""
        stream = self._streams.get(address)
        return stream.delivered_seq if stream is not None else None

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout)

    # -- the thread -----------------------------------------------------------------------------------------------

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        try:
            while not self._stop.is_set():
                self._take_commands(poller)
                ready = dict(poller.poll(POLL_MS))
                out: list[Delta] = []
                for stream in list(self._streams.values()):
                    if stream.monitor is not None and stream.monitor in ready:
                        self._drain_monitor(stream, out)
                    if stream.sub in ready:
                        self._drain_sub(stream, out)
                    if stream.replay is not None and stream.replay in ready:
                        self._drain_replay(stream, out)
                    if stream.replay_until is not None and time.monotonic() > stream.replay_deadline:
                        self._replay_failed(stream, out, "no answer")
                if out:
                    self.deliver(out)
                for stream in self._streams.values():
                    stream.delivered_seq = stream.last_seq
        except Exception:  # noqa: BLE001 - the thread must not die silently
            log.exception("KV-event subscriber stopped")
        finally:
            for stream in self._streams.values():
                self._close(stream)
            self._ctx.term()

    def _take_commands(self, poller) -> None:
        while True:
            try:
                kind, arg, generation = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "unsubscribe":
                self._drop_stream(arg, poller)
            else:
                self._drop_stream(arg.address, poller)
                stream = self._open(arg, generation)
                self._streams[arg.address] = stream
                poller.register(stream.sub, self._zmq.POLLIN)
                poller.register(stream.monitor, self._zmq.POLLIN)
                if stream.replay is not None:
                    poller.register(stream.replay, self._zmq.POLLIN)

    def _socket(self, kind, endpoint: str):
        zmq = self._zmq
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, int(RECONNECT_MAX_S * 1000))
        if "[" in endpoint:
            sock.setsockopt(zmq.IPV6, 1)
        sock.connect(endpoint)
        return sock

    def _drop_stream(self, address: str, poller) -> None:
        """Forget `address`'s stream (its blocks' count, its sockets), if it has one."""
        stream = self._streams.pop(address, None)
        if stream is None:
            return
        self._blocks -= len(stream.hashes.ours)
        poller.unregister(stream.sub)
        poller.unregister(stream.monitor)
        if stream.replay is not None:
            poller.unregister(stream.replay)
        self._close(stream)

    def _open(self, source: EventSource, generation: int) -> _Stream:
        zmq = self._zmq
        sub = self._socket(zmq.SUB, source.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        replay = self._socket(zmq.DEALER, source.replay_endpoint) if source.replay_endpoint else None
        log.info("KV events of %s: SUB %s, replay %s", source.address, source.endpoint,
                 source.replay_endpoint or "off")
        return _Stream(source, generation, sub, replay, monitor=monitor)

    @staticmethod
    def _close(stream: _Stream) -> None:
        if stream.monitor is not None:
            stream.sub.disable_monitor()
            stream.monitor.close(linger=0)
        stream.sub.close(linger=0)
        if stream.replay is not None:
            stream.replay.close(linger=0)

    def _drain_monitor(self, stream: _Stream, out: list[Delta]) -> None:
        from zmq.utils.monitor import recv_monitor_message

        zmq = self._zmq
        for _ in range(100):
            try:
                event = recv_monitor_message(stream.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                stream.disconnected = True
            elif event == zmq.EVENT_CONNECTED and stream.disconnected:
                stream.disconnected = False
                self.stats["reconnects"] += 1
                log.info("KV events of %s: reconnected; its blocks are dropped and read again from the engine",
                         stream.source.address)
                stream.replay_until, stream.replayed, stream.held = None, {}, []
                self._reset(stream, out)
            if event == zmq.EVENT_CONNECTED and stream.last_seq is None and stream.replay is not None \
                    and stream.replay_until is None:
                # learn what the engine holds now, not at its next event (an idle engine may send none)
                self._ask_replay(stream, 0, OPEN_END, [])

    def _drain_sub(self, stream: _Stream, out: list[Delta]) -> None:
        zmq = self._zmq
        for _ in range(1000):  # bounded per round, so one busy engine cannot starve the others
            try:
                frames = stream.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                self.stats["bad_payloads"] += 1
                continue
            self._on_live(stream, int.from_bytes(frames[1], "big"), frames[2], out)

    def _on_live(self, stream: _Stream, seq: int, payload: bytes, out: list[Delta]) -> None:
        if stream.replay_until is not None:  # a replay is under way: hold live batches (bounded)
            if len(stream.held) < MAX_HELD:
                stream.held.append((seq, payload))
            else:
                self._replay_failed(stream, out, "too many batches held")
                self._on_live(stream, seq, payload, out)
            return
        last = stream.last_seq
        if last is not None and seq <= last:  # numbering went back: a new engine behind the address
            self.stats["restarts"] += 1
            log.info("KV events of %s: sequence %d after %d, the engine restarted: its blocks are dropped",
                     stream.source.address, seq, last)
            self._reset(stream, out)
            last = None
        expected = 0 if last is None else last + 1
        if seq > expected and stream.replay is not None:
            self.stats["gaps"] += 1
            self._ask_replay(stream, expected, seq, [(seq, payload)])
            return
        if seq > expected and last is not None:  # a gap nobody can fill
            self.stats["gaps"] += 1
            self.stats["replays_failed"] += 1
            self._reset(stream, out)
        self._apply(stream, seq, payload, out)

    def _drain_replay(self, stream: _Stream, out: list[Delta]) -> None:
        zmq = self._zmq
        for _ in range(100_000):
            try:
                frames = stream.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if stream.replay_until is None or len(frames) != 3 or len(frames[1]) != 8:
                continue  # a late answer to a replay already given up on
            seq = int.from_bytes(frames[1], "big")
            if seq != END_OF_REPLAY:
                if len(stream.replayed) < MAX_HELD:
                    stream.replayed[seq] = frames[2]
                continue
            self._finish_replay(stream, out)
            return

    def _finish_replay(self, stream: _Stream, out: list[Delta]) -> None:
        first_time = stream.last_seq is None
        replayed, held, upto = stream.replayed, stream.held, stream.replay_until
        if upto == OPEN_END:  # asked on connecting: whatever the buffer holds
            upto = max(replayed, default=-1) + 1
        start = 0 if first_time else stream.last_seq + 1
        if first_time and start not in replayed:  # history older than the buffer: learn what is left
            start = min(replayed, default=upto)
        needed = range(start, upto)
        if all(s in replayed for s in needed):
            self.stats["replays_ok"] += 1
        elif first_time:  # a hole in what came back: apply the run from the oldest, the rest is a gap again
            end = start
            while end in replayed and end < upto:
                end += 1
            needed = range(start, end)
        else:
            self._replay_failed(stream, out, "the replay buffer no longer holds the missing batches")
            return
        stream.replay_until, stream.replayed, stream.held = None, {}, []
        for s in needed:
            self._apply(stream, s, replayed[s], out)
        for s, payload in held:
            if stream.last_seq is not None and s <= stream.last_seq and s in replayed:
                continue  # published while the replay was answered: already applied from it
            self._on_live(stream, s, payload, out)

    def _ask_replay(self, stream: _Stream, start: int, upto: int, held: list[tuple[int, bytes]]) -> None:
        """Ask the replay socket for batches from `start` on, holding `held` live batches until the answer;
        `upto`: the first live batch (OPEN_END: none yet, everything the buffer holds is wanted)."""
        stream.replay_until = upto
        stream.replay_deadline = time.monotonic() + REPLAY_TIMEOUT_S
        stream.replayed = {}
        stream.held = held
        stream.replay.send_multipart([b"", start.to_bytes(8, "big")])

    def _replay_failed(self, stream: _Stream, out: list[Delta], why: str) -> None:
        self.stats["replays_failed"] += 1
        log.warning("KV events of %s: cannot fill a gap (%s): its blocks are dropped and rebuilt from new events",
                    stream.source.address, why)
        held = stream.held
        stream.replay_until, stream.replayed, stream.held = None, {}, []
        self._reset(stream, out)
        stream.last_seq = None
        for i, (s, payload) in enumerate(held):
            if i == 0:
                stream.last_seq = s - 1  # accept the held run as it is, from its first batch
            self._on_live(stream, s, payload, out)

    def _reset(self, stream: _Stream, out: list[Delta]) -> None:
        self._blocks -= len(stream.hashes.ours)
        stream.hashes.clear()
        stream.last_seq = None
        out.append(Delta(stream.source.address, stream.generation, cleared=True))

    def _apply(self, stream: _Stream, seq: int, payload: bytes, out: list[Delta]) -> None:
        stream.last_seq = seq
        self.stats["batches"] += 1
        try:
            events = decode_batch(payload)
        except BadPayload as exc:
            self.stats["bad_payloads"] += 1
            log.warning("KV events of %s: batch %d skipped: %s", stream.source.address, seq, exc)
            return
        table = stream.hashes
        delta = Delta(stream.source.address, stream.generation)
        for event in events:
            if isinstance(event, Stored):
                self._stored(table, event, delta)
            elif isinstance(event, Removed):
                for engine_hash in event.block_hashes:
                    ours = table.ours.pop(engine_hash, None)
                    if ours is None:
                        continue
                    self._blocks -= 1
                    self.stats["blocks_removed"] += 1
                    table.recent[engine_hash] = ours
                    if len(table.recent) > RECENTLY_REMOVED:
                        table.recent.popitem(last=False)
                    left = table.count[ours] - 1
                    if left:
                        table.count[ours] = left
                    else:
                        del table.count[ours]
                        if ours in delta.added:  # stored then removed within one batch: never there
                            delta.added.remove(ours)
                        else:
                            delta.removed.append(ours)
            elif isinstance(event, Cleared):
                self._blocks -= len(table.ours)
                table.clear()
                out.append(delta)
                delta = Delta(stream.source.address, stream.generation, cleared=True)
        out.append(delta)

    def _stored(self, table: EngineHashes, event: Stored, delta: Delta) -> None:
        if event.parent_block_hash is None:
            parent = root_hash(event.lora_name, event.cache_salt)
        else:
            parent = table.parent(event.parent_block_hash)
            if parent is None:  # its parent was never seen: the chain cannot be keyed (missed history)
                self.stats["orphan_blocks"] += len(event.block_hashes)
                return
        delta.block_size = event.block_size
        if event.lora_name and event.lora_name not in delta.loras:
            delta.loras.append(event.lora_name)
        ours = chain(event.token_ids, event.block_size, parent)
        for engine_hash, h in zip(event.block_hashes, ours):
            if engine_hash in table.ours:
                continue
            if self._blocks >= self.max_blocks:
                self.stats["blocks_over_budget"] += 1
                continue
            table.ours[engine_hash] = h
            self._blocks += 1
            self.stats["blocks_stored"] += 1
            n = table.count.get(h, 0)
            table.count[h] = n + 1
            if not n:
                if h in delta.removed:  # removed then stored again within one batch: still there
                    delta.removed.remove(h)
                else:
                    delta.added.append(h)


def event_source(endpoint, port: int | None, replay_port: int | None, topic: str) -> EventSource | None:
    """Where `endpoint` (an epp.types.Endpoint) publishes: its pod's kvgate.dev/kv-events-* annotations, else
    the flags' ports, on the endpoint's IP; None when neither names a port (or an annotation is not a port)."""
    from kvgate.epp.protocol import (KV_EVENTS_PORT_ANNOTATION, KV_EVENTS_REPLAY_PORT_ANNOTATION,
                                     KV_EVENTS_TOPIC_ANNOTATION)

    notes = endpoint.annotations
    try:
        if KV_EVENTS_PORT_ANNOTATION in notes:
            port = _port(notes[KV_EVENTS_PORT_ANNOTATION])
        if KV_EVENTS_REPLAY_PORT_ANNOTATION in notes:
            replay_port = _port(notes[KV_EVENTS_REPLAY_PORT_ANNOTATION])
    except ValueError as exc:
        log.warning("endpoint %s: %s; no KV events from it", endpoint.address, exc)
        return None
    if port is None:
        return None
    host = endpoint.address.rsplit(":", 1)[0]  # "ip" or "[v6]"
    topic = notes.get(KV_EVENTS_TOPIC_ANNOTATION, topic)
    return EventSource(endpoint.address, f"tcp://{host}:{port}",
                       f"tcp://{host}:{replay_port}" if replay_port else None, topic)


def parse_event_endpoint(text: str) -> EventSource:
    """`ENDPOINT=PUB[,REPLAY]` (`kvgate epp --kv-events-endpoint`), e.g. 127.0.0.2:8000=tcp://[::1]:5557 — where one
    endpoint publishes when it is not at its own IP (engines sharing a host); ValueError naming the problem."""
    from kvgate.epp.datastore import parse_endpoint

    address, sep, sockets = text.partition("=")
    if not sep:
        raise ValueError(f"{text!r} is not ENDPOINT=PUB[,REPLAY]")
    parse_endpoint(address.strip())
    parts = [p.strip() for p in sockets.split(",")]
    if len(parts) > 2 or not all(re.fullmatch(r"tcp://(\[[0-9A-Fa-f:.]+\]|[0-9.]+|[A-Za-z0-9.-]+):\d{1,5}", p)
                                 for p in parts):
        raise ValueError(f"{text!r}: expected one or two tcp://HOST:PORT sockets after '='")
    return EventSource(address.strip(), parts[0], parts[1] if len(parts) == 2 else None)


def _port(text: str) -> int:
    if not text.strip().isdigit() or not 0 < int(text) < 65536:
        raise ValueError(f"KV-events port annotation {text!r} is not a port number")
    return int(text)
