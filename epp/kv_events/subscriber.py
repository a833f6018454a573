"""The KV-event subscriber: one background thread reading every endpoint's event sockets and handing the EPP's
loop index `Delta`s. It only wires the parts:

  sockets.py        per endpoint, the SUB socket (+ its connection monitor) and the replay DEALER
  sequencer.py      per endpoint, what to do with each batch: apply, hold, ask for a replay, drop the blocks
  decode.py         a batch's payload → events, every field checked
  engine_hashes.py  per endpoint, engine block hashes → the EPP's, the events → Deltas, the shared block budget

Why a thread and not an asyncio task on the EPP's loop: decoding a batch (msgpack) and hashing its blocks are
most of the work of an event; applying its delta to the index is the small rest. The thread keeps the first two
and ZeroMQ's blocking
poll off the loop that answers Envoy; the GIL still shares the CPU, but in 5 ms slices rather than inside a
decision, and sockets get one owner thread as ZeroMQ wants. `deliver` hands the Deltas to the loop
(`loop.call_soon_threadsafe`), where the index is changed by one writer, so the scorer reads it without locks.

A reconnection (the SUB's monitor: connected again after a disconnect) drops the endpoint's blocks and reads
the history again, as a restarted engine may have published past the old sequence number: a network blip
costs a rebuild from the replay buffer, never a stale index. An endpoint leaving the pool (`unsubscribe`) has
its sockets closed and its map dropped; the index side is told through a new generation
(prefix.precise_index.PreciseIndex.watch/remove).

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
    answer within `REPLAY_TIMEOUT_S` is replaced too;
  - live batches held while a replay is under way, and the replay's answer, are bounded per endpoint by count
    (sequencer.MAX_HELD) and by bytes (`max_held_bytes` each, default `MAX_HELD_BYTES`): past either, the replay
    gives up as when it cannot fill the gap;
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
import threading
import time
from dataclasses import dataclass

import zmq

from kvgate.epp.kv_events.decode import BadPayload, decode_batch
from kvgate.epp.kv_events.engine_hashes import BYTES_PER_BLOCK, BlockBudget, EngineHashes
from kvgate.epp.kv_events.sequencer import (GAP_LOST, REPLAY_FAILED, RESTARTED, Action, Apply, AskReplay,
                                            ReplayFilled, Reset, Sequencer)
from kvgate.epp.kv_events.sockets import END_OF_REPLAY, EndpointSockets
from kvgate.epp.kv_events.sources import EventSource
from kvgate.epp.prefix.precise_index import Delta

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 2.0
POLL_MS = 50  # how often the thread looks at its command queue
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


@dataclass
class _Stream:
    """One subscribed endpoint, as the worker thread sees it."""

    source: EventSource
    generation: int
    sockets: EndpointSockets
    sequencer: Sequencer
    hashes: EngineHashes
    delivered_seq: int | None = None  # the sequencer's last_seq once its deltas were handed to `deliver`
    applying: int | None = None  # the batch being applied: the numbering resumes after it if that raises
    replay_deadline: float = 0.0
    disconnected: bool = False  # the SUB's monitor saw a disconnection, and no connection since
    warned_at: float = -WARN_EVERY_S
    unlogged: int = 0  # warnings not logged since the last one (rate limit)


class KVEventSubscriber:
    def __init__(self, deliver, max_bytes: int = DEFAULT_MAX_BYTES, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 max_held_bytes: int = MAX_HELD_BYTES) -> None:
        if max_message_bytes < 1 or max_held_bytes < max_message_bytes:
            raise ValueError(f"max_held_bytes ({max_held_bytes}) must hold one message of max_message_bytes "
                             f"({max_message_bytes} ≥ 1)")
        self.deliver = deliver  # called from the thread with a list of Deltas
        self.max_blocks = max(1, max_bytes // BYTES_PER_BLOCK)
        self.max_message_bytes = max_message_bytes
        self.max_held_bytes = max_held_bytes
        self._budget = BlockBudget(self.max_blocks)  # shared by every endpoint's EngineHashes
        self._ctx = zmq.Context()
        self._poller: zmq.Poller | None = None  # the live worker's
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._generation = 0
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

    # -- the threads ----------------------------------------------------------------------------------------------

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
                self._budget.used = 0
                delay = RESTART_MIN_S if time.monotonic() - started > 60 else min(2 * delay, RESTART_MAX_S)
                log.error("KV-event subscriber thread died; restarting it in %.1f s, its %d endpoints' blocks are "
                          "dropped and read again", delay, len(resume))
                self._stop.wait(delay)
        finally:
            self._ctx.term()

    def _run(self, resume: list[tuple[EventSource, int]]) -> None:
        """The worker: `resume` holds the subscriptions of a worker that died (their index entries are dropped,
        their history asked for again as on a first connection)."""
        self._poller = zmq.Poller()
        try:
            out: list[Delta] = []
            for source, generation in resume:
                self._add_stream(source, generation)
                out.append(Delta(source.address, generation, cleared=True))
            while not self._stop.is_set():
                self._take_commands()
                ready = dict(self._poller.poll(POLL_MS))
                for stream in list(self._streams.values()):
                    try:
                        self._service(stream, ready, out)
                    except Exception as exc:  # noqa: BLE001 - one endpoint's trouble stays its own
                        self._quarantine(stream, out, exc)
                if out:
                    self.deliver(out)
                    out = []
                for stream in self._streams.values():
                    stream.delivered_seq = stream.sequencer.last_seq
        except Exception:  # noqa: BLE001 - logged here; the supervisor counts it and starts another worker
            log.exception("KV-event subscriber thread died")
        finally:
            for stream in self._streams.values():
                stream.sockets.close()

    # -- subscriptions --------------------------------------------------------------------------------------------

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
        sockets = EndpointSockets(self._ctx, self._poller, source, self.max_message_bytes)
        self._streams[source.address] = _Stream(
            source, generation, sockets, Sequencer(sockets.replay is not None, self.max_held_bytes),
            EngineHashes(self._budget, self.stats))

    def _drop_stream(self, address: str) -> None:
        """Forget `address`'s stream (its blocks' budget, its sockets), if it has one."""
        stream = self._streams.pop(address, None)
        if stream is None:
            return
        stream.hashes.clear()
        stream.sockets.unregister()
        stream.sockets.close()

    # -- one endpoint's sockets -----------------------------------------------------------------------------------

    def _service(self, stream: _Stream, ready: dict, out: list[Delta]) -> None:
        sockets = stream.sockets
        if sockets.monitor in ready:
            self._drain_monitor(stream, out)
        if sockets.sub in ready:
            self._drain_sub(stream, out)
        if sockets.replay is not None and sockets.replay in ready:
            self._drain_replay(stream, out)
        if stream.sequencer.replaying and time.monotonic() > stream.replay_deadline:
            sockets.reopen_replay()
            self._act(stream, stream.sequencer.replay_timed_out(), out)

    def _drain_monitor(self, stream: _Stream, out: list[Delta]) -> None:
        from zmq.utils.monitor import recv_monitor_message

        for _ in range(100):
            try:
                event = recv_monitor_message(stream.sockets.monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            if event == zmq.EVENT_DISCONNECTED:
                stream.disconnected = True
                stream.sockets.reopen_sub()  # the next EVENT_CONNECTED is the new socket's
                return
            if event == zmq.EVENT_CONNECTED and stream.disconnected:
                stream.disconnected = False
                self.stats["reconnects"] += 1
                log.info("KV events of %s: reconnected; its blocks are dropped and read again from the engine",
                         stream.source.address)
                self._act(stream, stream.sequencer.reconnected(), out)
            if event == zmq.EVENT_CONNECTED:
                self._act(stream, stream.sequencer.connected(), out)

    def _drain_sub(self, stream: _Stream, out: list[Delta]) -> None:
        for _ in range(1000):  # bounded per round, so one busy engine cannot starve the others
            try:
                frames = stream.sockets.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[1]) != 8:
                self.stats["bad_payloads"] += 1
                self.stats["error"] += 1
                self._warn(stream, "a message of %d frames is not [topic, seq, payload]: skipped", len(frames))
                continue
            try:
                self._act(stream, stream.sequencer.live(int.from_bytes(frames[1], "big"), frames[2]), out)
            except Exception as exc:  # noqa: BLE001 - this message only; the next ones are read as usual
                self._quarantine(stream, out, exc)

    def _drain_replay(self, stream: _Stream, out: list[Delta]) -> None:
        for _ in range(100_000):
            try:
                frames = stream.sockets.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if not stream.sequencer.replaying or len(frames) != 3 or len(frames[1]) != 8:
                continue  # a late answer to a replay already given up on
            seq = int.from_bytes(frames[1], "big")
            if seq != END_OF_REPLAY:
                stream.sequencer.replayed(seq, frames[2])
                continue
            self._act(stream, stream.sequencer.replay_ended(), out)
            return

    # -- what the sequencer decided -------------------------------------------------------------------------------

    def _act(self, stream: _Stream, actions: list[Action], out: list[Delta]) -> None:
        stats = self.stats
        for action in actions:
            match action:
                case Apply(seq, payload):
                    stream.applying = seq
                    self._apply(stream, seq, payload, out)
                    stream.applying = None
                case AskReplay(start):
                    if action.for_gap:
                        stats["gaps"] += 1
                    stream.replay_deadline = time.monotonic() + REPLAY_TIMEOUT_S
                    if not stream.sockets.ask_replay(start):
                        stream.replay_deadline = 0.0  # fails as unanswered at once
                case ReplayFilled():
                    stats["replays_ok"] += 1
                case Reset(cause):
                    if cause == RESTARTED:
                        stats["restarts"] += 1
                        log.info("KV events of %s: sequence %d after %d, the engine restarted: its blocks are "
                                 "dropped", stream.source.address, action.seq, action.last)
                    elif cause == GAP_LOST:
                        stats["gaps"] += 1
                        stats["replays_failed"] += 1
                    elif cause == REPLAY_FAILED:
                        stats["replays_failed"] += 1
                        self._warn(stream, "cannot fill a gap (%s): its blocks are dropped and rebuilt from new "
                                   "events", action.why)
                    self._drop_blocks(stream, out)
                # Hold: the sequencer keeps the batch until its replay ends

    def _apply(self, stream: _Stream, seq: int, payload: bytes, out: list[Delta]) -> None:
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
        stream.hashes.apply(events, stream.source.address, stream.generation, out)

    def _drop_blocks(self, stream: _Stream, out: list[Delta]) -> None:
        stream.hashes.clear()
        out.append(Delta(stream.source.address, stream.generation, cleared=True))

    def _quarantine(self, stream: _Stream, out: list[Delta], exc: Exception) -> None:
        """An unexpected exception while handling `stream`'s message: whatever it changed is dropped with the
        endpoint's blocks (rebuilt from the batches that follow), other endpoints go on."""
        self.stats["error"] += 1
        self._warn(stream, "handling a message failed (%s: %s); its blocks are dropped and rebuilt from new events",
                   type(exc).__name__, exc, exc_info=exc)
        stream.sequencer.quarantine(stream.applying)
        stream.applying = None
        self._drop_blocks(stream, out)

    def _warn(self, stream: _Stream, fmt: str, *args, exc_info=None) -> None:
        now = time.monotonic()
        if now - stream.warned_at < WARN_EVERY_S:
            stream.unlogged += 1
            return
        more = f" ({stream.unlogged} more warnings in the last {WARN_EVERY_S:.0f} s)" if stream.unlogged else ""
        stream.warned_at, stream.unlogged = now, 0
        log.warning("KV events of %s: " + fmt + "%s", stream.source.address, *args, more, exc_info=exc_info)
