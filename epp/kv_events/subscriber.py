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
    reconnects by itself, backing off from 100 ms to `RECONNECT_MAX_S` (after a disconnection the SUB socket is
    replaced by a new one: ZeroMQ does not reconnect after a protocol error, such as a frame over ZMQ_MAXMSGSIZE);
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

Hostile or broken publishers (the events come off the network; counted in stats["error"], exported as
kvgate_epp_kv_events_total{event="error"}):
  - every field of every event is checked (decode.py lists the bounds); a bad batch (or a message that is not
    [topic, 8-byte seq, payload]) drops that endpoint's blocks, which are rebuilt from the batches that follow:
    the batch's content is unknown (it may have removed blocks), and none of it is applied, so the index is
    never half a batch ahead. Other endpoints never notice;
  - any other exception while handling one endpoint's message does the same (its replay state goes too);
  - SUB and DEALER sockets take frames of at most `max_message_bytes` (ZMQ_MAXMSGSIZE, default
    `MAX_MESSAGE_BYTES`); ZeroMQ drops a connection that sends a bigger one, a new socket connects again, and
    the reconnection is handled as any other (blocks dropped, history replayed); a replay socket that does not
    answer in time is replaced too;
  - live batches held while a replay is under way, and the replay's answer, are bounded per endpoint by count
    (`MAX_HELD`) and by bytes (`max_held_bytes` each, default `MAX_HELD_BYTES`): past either, the replay gives up
    as when it cannot fill the gap;
  - the work runs in a worker thread under a supervisor thread: a worker that dies anyway (an exception outside
    any one message: the `deliver` callback failing, ZeroMQ) is started again after a back-off (0.1 s doubling
    to `RESTART_MAX_S`), every endpoint's blocks dropped and resubscribed, so their history is replayed
    (stats["thread_restarts"]);
  - warnings about one endpoint are logged at most every `WARN_EVERY_S` seconds (the rest counted), so a
    flood of bad batches cannot flood the log.
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
# ZMQ_MAXMSGSIZE of the SUB and DEALER sockets. An engine sends one batch per step: BlockStored for the blocks the
# step filled (≤ max_num_batched_tokens tokens) and BlockRemoved for those it evicted to make room. Encoded
# (engine/kv_events.py encode_batch, measured in tests/epp/test_kv_events_hostile.py) a batch costs 6.2 bytes per
# token at block size 16 with 5-byte token ids (vocabularies over 65536), 24 at block size 1, plus ~200 bytes
# per request: 16 MiB holds a 2.7M-token step at block size 16 (700k at block size 1), far over any real step
# (vLLM's default max_num_batched_tokens is 2048-16384; kvgate's 2048). Not bounded in bytes: ZeroMQ's queue of
# up to RCVHWM such messages per socket (the NetworkPolicy that admits only the EPP is the control there).
MAX_MESSAGE_BYTES = 16 << 20
# Bytes of live batches held per endpoint while a replay is under way, and (separately) of the replay's answer:
# a replay of the engine's whole buffer (10000 steps of ~12 KB at kvgate's defaults) fits.
MAX_HELD_BYTES = 64 << 20
RESTART_MIN_S = 0.1
RESTART_MAX_S = 5.0
WARN_EVERY_S = 10.0
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
    held_bytes: int = 0
    replayed_bytes: int = 0
    monitor: object | None = None  # PAIR socket of ZeroMQ's monitor of `sub`: connects and disconnects
    disconnected: bool = False
    warned_at: float = -WARN_EVERY_S
    unlogged: int = 0  # warnings not logged since the last one (rate limit)


class KVEventSubscriber:
    def __init__(self, deliver, max_bytes: int = DEFAULT_MAX_BYTES, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_held_bytes: int = MAX_HELD_BYTES) -> None:
        import zmq

        if max_message_bytes < 1 or max_held_bytes < max_message_bytes:
            raise ValueError(f"max_held_bytes ({max_held_bytes}) must hold one message of max_message_bytes "
                             f"({max_message_bytes} ≥ 1)")
        self._zmq = zmq
        self.deliver = deliver  # called from the thread with a list of Deltas
        self.max_blocks = max(1, max_bytes // BYTES_PER_BLOCK)
        self.max_message_bytes = max_message_bytes
        self.max_held_bytes = max_held_bytes
        self._ctx = zmq.Context()
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._generation = 0
        self._blocks = 0
        # every key is here from the start: the metrics thread copies the dict while the worker counts
        self.stats = {"batches": 0, "gaps": 0, "replays_ok": 0, "replays_failed": 0, "restarts": 0,
                      "reconnects": 0, "bad_payloads": 0, "blocks_stored": 0, "blocks_removed": 0,
                      "blocks_over_budget": 0, "orphan_blocks": 0, "error": 0, "thread_restarts": 0}
        self._thread = threading.Thread(target=self._supervise, name="kvgate-epp-kv-events", daemon=True)
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

    def _supervise(self) -> None:
        """Run the worker; start it again when it dies (not on close), after a back-off that doubles while it
        keeps dying within a minute."""
        delay, resume = RESTART_MIN_S, []
        try:
            while not self._stop.is_set():
                worker = threading.Thread(target=self._run, args=(resume,), name="kvgate-epp-kv-events-worker",
                                          daemon=True)
                started = time.monotonic()
                worker.start()
                worker.join()
                if self._stop.is_set():
                    return
                self.stats["thread_restarts"] += 1
                self.stats["error"] += 1
                resume = [(s.source, s.generation) for s in self._streams.values()]
                self._streams = {}  # the dead worker closed their sockets; a new dict: last_seq() reads it
                self._blocks = 0
                delay = RESTART_MIN_S if time.monotonic() - started > 60 else min(2 * delay, RESTART_MAX_S)
                log.error("KV-event subscriber thread died; restarting it in %.1f s, its %d endpoints' blocks are "
                          "dropped and read again", delay, len(resume))
                self._stop.wait(delay)
        finally:
            self._ctx.term()

    def _run(self, resume: list[tuple[EventSource, int]]) -> None:
        """The worker: `resume` holds the subscriptions of a worker that died (their index entries are dropped,
        their history asked for again as on a first connection)."""
        poller = self._poller = self._zmq.Poller()
        try:
            out: list[Delta] = []
            for source, generation in resume:
                self._add_stream(source, generation)
                out.append(Delta(source.address, generation, cleared=True))
            while not self._stop.is_set():
                self._take_commands()
                ready = dict(poller.poll(POLL_MS))
                for stream in list(self._streams.values()):
                    try:
                        self._service(stream, ready, out)
                    except Exception as exc:  # noqa: BLE001 - one endpoint's trouble stays its own
                        self._quarantine(stream, out, exc)
                if out:
                    self.deliver(out)
                    out = []
                for stream in self._streams.values():
                    stream.delivered_seq = stream.last_seq
        except Exception:  # noqa: BLE001 - logged here; the supervisor counts it and starts another worker
            log.exception("KV-event subscriber thread died")
        finally:
            for stream in self._streams.values():
                self._close(stream)

    def _service(self, stream: _Stream, ready: dict, out: list[Delta]) -> None:
        if stream.monitor is not None and stream.monitor in ready:
            self._drain_monitor(stream, out)
        if stream.sub in ready:
            self._drain_sub(stream, out)
        if stream.replay is not None and stream.replay in ready:
            self._drain_replay(stream, out)
        if stream.replay_until is not None and time.monotonic() > stream.replay_deadline:
            self._reopen_replay(stream)  # a DEALER dropped for a frame over MAXMSGSIZE never reconnects by itself
            self._replay_failed(stream, out, "no answer")

    def _quarantine(self, stream: _Stream, out: list[Delta], exc: Exception) -> None:
        """An unexpected exception while handling `stream`'s message: whatever it changed is dropped with the
        endpoint's blocks (rebuilt from the batches that follow), other endpoints go on."""
        self.stats["error"] += 1
        self._warn(stream, "handling a message failed (%s: %s); its blocks are dropped and rebuilt from new events",
                   type(exc).__name__, exc, exc_info=exc)
        self._clear_replay(stream)
        self._drop_blocks(stream, out)

    def _warn(self, stream: _Stream, fmt: str, *args, exc_info=None) -> None:
        now = time.monotonic()
        if now - stream.warned_at < WARN_EVERY_S:
            stream.unlogged += 1
            return
        more = f" ({stream.unlogged} more warnings in the last {WARN_EVERY_S:.0f} s)" if stream.unlogged else ""
        stream.warned_at, stream.unlogged = now, 0
        log.warning("KV events of %s: " + fmt + "%s", stream.source.address, *args, more, exc_info=exc_info)

    def _take_commands(self) -> None:
        while True:
            try:
                kind, arg, generation = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "unsubscribe":
                self._drop_stream(arg)
                continue
            self._drop_stream(arg.address)
            try:
                self._add_stream(arg, generation)
            except Exception:  # noqa: BLE001 - an address ZeroMQ refuses: this endpoint only goes without events
                self.stats["error"] += 1
                log.exception("KV events of %s: cannot subscribe to %s", arg.address, arg.endpoint)

    def _add_stream(self, source: EventSource, generation: int) -> None:
        stream = self._open(source, generation)
        self._streams[source.address] = stream
        for sock in (stream.sub, stream.monitor, stream.replay):
            if sock is not None:
                self._poller.register(sock, self._zmq.POLLIN)

    def _socket(self, kind, endpoint: str, connect: bool = True):
        zmq = self._zmq
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

    def _drop_stream(self, address: str) -> None:
        """Forget `address`'s stream (its blocks' count, its sockets), if it has one."""
        stream = self._streams.pop(address, None)
        if stream is None:
            return
        self._blocks -= len(stream.hashes.ours)
        for sock in (stream.sub, stream.monitor, stream.replay):
            if sock is not None:
                self._poller.unregister(sock)
        self._close(stream)

    def _open(self, source: EventSource, generation: int) -> _Stream:
        sub, monitor = self._open_sub(source)
        try:
            replay = self._socket(self._zmq.DEALER, source.replay_endpoint) if source.replay_endpoint else None
        except Exception:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            raise
        log.info("KV events of %s: SUB %s, replay %s", source.address, source.endpoint,
                 source.replay_endpoint or "off")
        return _Stream(source, generation, sub, replay, monitor=monitor)

    def _open_sub(self, source: EventSource):
        zmq = self._zmq
        sub, monitor = self._socket(zmq.SUB, source.endpoint, connect=False), None
        try:
            sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
            # the monitor first: a connection made before it exists would never be reported
            monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
            sub.connect(source.endpoint)
            return sub, monitor
        except Exception:
            if monitor is not None:
                sub.disable_monitor()
                monitor.close(linger=0)
            sub.close(linger=0)
            raise

    def _reopen_sub(self, stream: _Stream) -> None:
        """A new SUB socket (and monitor) for `stream`: ZeroMQ reconnects by itself after a network error, but
        not after a protocol error, and a frame over MAXMSGSIZE is one: the connection would stay down."""
        poller = self._poller
        poller.unregister(stream.sub)
        poller.unregister(stream.monitor)
        stream.sub.disable_monitor()
        stream.monitor.close(linger=0)
        stream.sub.close(linger=0)
        stream.sub, stream.monitor = self._open_sub(stream.source)
        poller.register(stream.sub, self._zmq.POLLIN)
        poller.register(stream.monitor, self._zmq.POLLIN)

    def _reopen_replay(self, stream: _Stream) -> None:
        """A new DEALER for `stream` (late answers to the old one are gone with it)."""
        if stream.replay is None:
            return
        self._poller.unregister(stream.replay)
        stream.replay.close(linger=0)
        stream.replay = self._socket(self._zmq.DEALER, stream.source.replay_endpoint)
        self._poller.register(stream.replay, self._zmq.POLLIN)

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
                self._reopen_sub(stream)  # the next EVENT_CONNECTED is the new socket's
                return
            if event == zmq.EVENT_CONNECTED and stream.disconnected:
                stream.disconnected = False
                self.stats["reconnects"] += 1
                log.info("KV events of %s: reconnected; its blocks are dropped and read again from the engine",
                         stream.source.address)
                self._clear_replay(stream)
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
                self.stats["error"] += 1
                self._warn(stream, "a message of %d frames is not [topic, seq, payload]: skipped", len(frames))
                continue
            try:
                self._on_live(stream, int.from_bytes(frames[1], "big"), frames[2], out)
            except Exception as exc:  # noqa: BLE001 - this message only; the next ones are read as usual
                self._quarantine(stream, out, exc)

    def _on_live(self, stream: _Stream, seq: int, payload: bytes, out: list[Delta]) -> None:
        if stream.replay_until is not None:  # a replay is under way: hold live batches (bounded)
            if len(stream.held) < MAX_HELD and stream.held_bytes + len(payload) <= self.max_held_bytes:
                stream.held.append((seq, payload))
                stream.held_bytes += len(payload)
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
            seq, payload = int.from_bytes(frames[1], "big"), frames[2]
            if seq != END_OF_REPLAY:
                # bounded: past either bound the rest is missing, and _finish_replay sees a hole
                if len(stream.replayed) < MAX_HELD and stream.replayed_bytes + len(payload) <= self.max_held_bytes \
                        and seq not in stream.replayed:
                    stream.replayed[seq] = payload
                    stream.replayed_bytes += len(payload)
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
            self._replay_failed(stream, out, "the replay buffer no longer holds the missing batches, or they were "
                                "over the bound on bytes held")
            return
        self._clear_replay(stream)
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
        stream.replayed, stream.replayed_bytes = {}, 0
        stream.held, stream.held_bytes = held, sum(len(payload) for _, payload in held)
        try:  # never block the thread on one endpoint's replay socket
            stream.replay.send_multipart([b"", start.to_bytes(8, "big")], self._zmq.NOBLOCK)
        except self._zmq.Again:
            stream.replay_deadline = 0.0  # fails as unanswered at once

    @staticmethod
    def _clear_replay(stream: _Stream) -> None:
        stream.replay_until, stream.replayed, stream.held = None, {}, []
        stream.held_bytes = stream.replayed_bytes = 0

    def _replay_failed(self, stream: _Stream, out: list[Delta], why: str) -> None:
        self.stats["replays_failed"] += 1
        self._warn(stream, "cannot fill a gap (%s): its blocks are dropped and rebuilt from new events", why)
        held = stream.held
        self._clear_replay(stream)
        self._reset(stream, out)
        stream.last_seq = None
        for i, (s, payload) in enumerate(held):
            if i == 0:
                stream.last_seq = s - 1  # accept the held run as it is, from its first batch
            self._on_live(stream, s, payload, out)

    def _reset(self, stream: _Stream, out: list[Delta]) -> None:
        """The endpoint's blocks go and its numbering starts again (a new engine, a reconnection, a lost gap)."""
        self._drop_blocks(stream, out)
        stream.last_seq = None

    def _drop_blocks(self, stream: _Stream, out: list[Delta]) -> None:
        self._blocks -= len(stream.hashes.ours)
        stream.hashes.clear()
        out.append(Delta(stream.source.address, stream.generation, cleared=True))

    def _apply(self, stream: _Stream, seq: int, payload: bytes, out: list[Delta]) -> None:
        stream.last_seq = seq
        self.stats["batches"] += 1
        try:
            events = decode_batch(payload, self.max_message_bytes)
        except BadPayload as exc:
            # what the batch did is unknown (it may have removed blocks): a gap nobody can fill, so the blocks
            # go; the numbering goes on from this batch (a replay would give the same bytes again)
            self.stats["bad_payloads"] += 1
            self.stats["error"] += 1
            self._warn(stream, "batch %d is malformed (%s): its blocks are dropped and rebuilt from new events",
                       seq, exc)
            self._drop_blocks(stream, out)
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
                        if delta.added.pop(ours, 0) is not None:  # not stored then removed in this batch
                            delta.removed[ours] = None
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
        if event.lora_name:
            delta.loras.add(event.lora_name)
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
                if delta.removed.pop(h, 0) is not None:  # not removed then stored again in this batch
                    delta.added[h] = None


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
