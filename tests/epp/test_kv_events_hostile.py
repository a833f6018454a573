"""The EPP's KV-event subscriber against a hostile publisher: real ZeroMQ PUB sockets speaking
vLLM's wire format send malformed batches (a list parent hash, a non-int or >= 2^63 token id, garbage msgpack,
an oversized message, a stream of LoRA names), interleaved with good batches from the same and another endpoint.
The thread keeps running, the good endpoint's blocks are all indexed, the bad batch drops the bad endpoint's
blocks as a whole (never half-applied) and counts as an `error`; a dead thread is restarted; held and replayed
batches are bounded in bytes; the LoRA table is bounded. A property test: any event structure decodes to valid
events or raises BadPayload, never anything else."""

from __future__ import annotations

import queue
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.epp.kv_events.decode import (MAX_BLOCK_SIZE, MAX_NAME_CHARS, MAX_TOKEN_ID, BadPayload, Cleared, Removed,
                                         Stored, decode_batch)
from kvgate.epp.kv_events.subscriber import MAX_MESSAGE_BYTES, KVEventSubscriber
from kvgate.epp.prefix.hashing import chain, root_hash
from kvgate.epp.prefix.precise_index import MAX_LORAS, Delta, PreciseIndex
from tests.epp.kv_events_helpers import Publisher, batch, removed, stored

BS = 4
A, B = "10.0.0.1:8000", "10.0.0.2:8000"  # A: the rogue endpoint, B: a good one
GOOD = list(range(100, 108))  # two blocks of 4
LATER = list(range(200, 204))


def blocks(tokens, lora=None):
    return set(chain(tokens, BS, root_hash(lora, None)))


def with_bad_stored(**bad) -> bytes:
    """A batch whose first event is good and whose second has one bad field: nothing of it may be applied."""
    event = stored([31], None, [1, 2, 3, 4], BS)
    event.update(bad)
    return batch([stored([30], None, [9, 9, 9, 9], BS), event])


MALFORMED = {
    "list parent hash": with_bad_stored(parent_block_hash=[1, 2]),
    "non-int token id": with_bad_stored(token_ids=[1, "two", 3, 4]),
    "float token id": with_bad_stored(token_ids=[1, 2.0, 3, 4]),
    "token id 2^63": with_bad_stored(token_ids=[1, 2**63, 3, 4]),
    "token id 2^32": with_bad_stored(token_ids=[1, 2**32, 3, 4]),
    "negative token id": with_bad_stored(token_ids=[1, -1, 3, 4]),
    "list block hash": with_bad_stored(block_hashes=[[31]]),
    "bool block hash": with_bad_stored(block_hashes=[True]),
    "huge block size": with_bad_stored(block_hashes=[], token_ids=[], block_size=MAX_BLOCK_SIZE + 1),
    "lora name too long": with_bad_stored(lora_name="x" * (MAX_NAME_CHARS + 1)),
    "lora name not a string": with_bad_stored(lora_name=["a"]),
    "removal of a list hash": batch([stored([30], None, [9, 9, 9, 9], BS), removed([[1]])]),
    "garbage msgpack": b"\xc1\xff not msgpack",
    "an event that is an int": batch([stored([30], None, [9, 9, 9, 9], BS), 7]),
    "a map without a type": batch([{"block_hashes": [1]}]),
}


@pytest.mark.parametrize("bad", list(MALFORMED), ids=list(MALFORMED))
def test_a_malformed_batch_drops_only_its_endpoint_and_the_thread_keeps_running(zctx, harness, bad):
    rogue, good = Publisher(zctx, replay=False), Publisher(zctx, replay=False)
    harness.subscribe(A, rogue)
    harness.subscribe(B, good)
    rogue.send(0, batch([stored([1, 2], None, GOOD, BS)]))
    good.send(0, batch([stored([1, 2], None, GOOD, BS)]))
    harness.pump(lambda: harness.applied(A, 0) and harness.applied(B, 0))
    assert harness.index.blocks_of(A) == blocks(GOOD)

    rogue.send(1, MALFORMED[bad])
    good.send(1, batch([stored([3], None, LATER, BS)]))
    rogue.send(2, batch([stored([5], None, LATER, BS)]))
    good.send(2, batch([removed([1, 2])]))
    harness.pump(lambda: harness.applied(A, 2) and harness.applied(B, 2))

    stats = harness.scorer.subscriber.stats
    # the good endpoint saw every batch; the rogue's batch 1 is unknown, so its earlier blocks may be gone:
    # dropped whole (none of batch 1's good first event either), then rebuilt from batch 2
    assert harness.index.blocks_of(B) == blocks(LATER)
    assert harness.index.blocks_of(A) == blocks(LATER)
    assert stats["bad_payloads"] == 1 and stats["error"] == 1 and stats["thread_restarts"] == 0
    assert harness.scorer.stats()["error"] == 1  # exported as kvgate_epp_kv_events_total{event="error"}


def test_a_malformed_batch_met_in_a_replay_is_dropped_whole_too(zctx, harness):
    pub = Publisher(zctx)
    harness.subscribe(A, pub)
    pub.send(0, batch([stored([1, 2], None, GOOD, BS)]))
    harness.pump(lambda: harness.applied(A, 0))
    pub.send(1, MALFORMED["list parent hash"], publish=False)  # lost live, kept for the replay
    pub.send(2, batch([stored([5], None, LATER, BS)]))
    harness.pump(lambda: harness.applied(A, 2))
    assert harness.index.blocks_of(A) == blocks(LATER)
    assert harness.scorer.subscriber.stats["error"] == 1


def verbose(pub: Publisher) -> Publisher:
    """XPUB passes on every subscription, a second one to the same topic too (a new SUB replacing the old)."""
    pub.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    return pub


def wait_resubscribed(pub: Publisher, timeout: float = 10.0) -> None:
    """Read XPUB's (un)subscriptions until a subscription: the SUB has connected again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pub.pub.poll(100) and pub.pub.recv()[0] == 1:
            return
    raise AssertionError("the subscriber never subscribed again")


def test_an_oversized_message_drops_the_connection_then_the_endpoint_is_rebuilt(zctx, harness):
    rogue, good = verbose(Publisher(zctx, replay=False)), Publisher(zctx, replay=False)
    harness.subscribe(A, rogue)
    harness.subscribe(B, good)
    rogue.send(0, batch([stored([1, 2], None, GOOD, BS)]))
    harness.pump(lambda: harness.applied(A, 0))
    # one frame over ZMQ_MAXMSGSIZE: ZeroMQ drops the connection before the EPP holds it; it reconnects
    rogue.send(1, batch([stored([9], None, [9] * 4, BS)]) + b"\0" * MAX_MESSAGE_BYTES)
    good.send(0, batch([stored([1, 2], None, GOOD, BS)]))
    wait_resubscribed(rogue)
    harness.pump(lambda: harness.scorer.subscriber.stats["reconnects"] == 1)
    rogue.send(2, batch([stored([5], None, LATER, BS)]))
    harness.pump(lambda: harness.applied(A, 2) and harness.applied(B, 0))
    assert harness.index.blocks_of(A) == blocks(LATER)  # the reconnection dropped batch 0's blocks
    assert harness.index.blocks_of(B) == blocks(GOOD)
    assert harness.scorer.subscriber.stats["thread_restarts"] == 0


def test_a_stream_of_lora_names_is_bounded(zctx, harness):
    pub = Publisher(zctx, replay=False)
    harness.subscribe(A, pub)
    names = [f"adapter-{i}" for i in range(MAX_LORAS + 500)]
    events = [dict(stored([i + 1], None, [i] * BS, BS), lora_name=name) for i, name in enumerate(names)]
    pub.send(0, batch(events[:500]))
    pub.send(1, batch(events[500:]))
    harness.pump(lambda: harness.applied(A, 1))
    assert set(harness.index.loras) == set(names[500:])  # the oldest went first
    assert len(harness.index.blocks_of(A)) == len(names)


def test_the_lora_table_keeps_the_names_seen_last():
    index = PreciseIndex(max_loras=3)
    index.watch(A, 1)
    for name in ["a", "b", "c", "a", "d"]:
        index.apply(Delta(A, 1, loras={name}))
    assert set(index.loras) == {"c", "a", "d"}


class FlakyQueue(queue.Queue):
    """The harness's delivery queue, failing its first put: the EPP's loop.call_soon_threadsafe raises the same
    way once the loop is closed."""

    def __init__(self) -> None:
        super().__init__()
        self.failed = False

    def put(self, item, block=True, timeout=None):
        if not self.failed:
            self.failed = True
            raise RuntimeError("Event loop is closed")
        super().put(item, block, timeout)


def test_a_thread_killed_by_an_unexpected_exception_is_restarted_and_resyncs(zctx, harness):
    pub = Publisher(zctx)
    harness.deltas = FlakyQueue()
    harness.subscribe(A, pub)
    pub.send(0, batch([stored([1, 2], None, GOOD, BS)]))  # its delivery kills the thread
    harness.pump(lambda: harness.scorer.subscriber.stats["thread_restarts"] == 1 and harness.applied(A, 0),
                 timeout=10.0)
    assert harness.index.blocks_of(A) == blocks(GOOD)  # read again from the replay socket on reconnecting
    pub.send(1, batch([stored([5], None, LATER, BS)]))
    harness.pump(lambda: harness.applied(A, 1))
    assert harness.index.blocks_of(A) == blocks(GOOD) | blocks(LATER)
    assert harness.scorer.subscriber.stats["error"] == 1


class Direct:
    """A subscriber built with small bounds, its deltas applied to an index by the test."""

    def __init__(self, **bounds) -> None:
        self.index = PreciseIndex(speculative_ttl_s=0.0)
        self.deltas: queue.Queue = queue.Queue()
        self.sub = KVEventSubscriber(self.deltas.put, **bounds)

    def subscribe(self, address: str, pub: Publisher) -> None:
        generation = self.sub.next_generation()
        self.index.watch(address, generation)
        self.sub.subscribe(pub.source(address), generation)
        pub.wait_subscribed()

    def pump(self, until, pubs, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not until():
            for p in pubs:
                p.serve_replays()
            try:
                for delta in self.deltas.get(timeout=0.01):
                    self.index.apply(delta)
            except queue.Empty:
                pass
            assert time.monotonic() < deadline, f"not reached in {timeout} s; stats {self.sub.stats}"

    def applied(self, address: str, seq: int) -> bool:
        return self.sub.last_seq(address) == seq and self.deltas.empty()


def padded(events, size: int) -> bytes:
    return msgpack.packb({"ts": 0.0, "events": events, "data_parallel_rank": 0, "pad": b"\0" * size})


def test_live_batches_held_during_a_replay_are_bounded_in_bytes(zctx):
    d = Direct(max_message_bytes=1 << 20, max_held_bytes=2 << 20)
    pub = Publisher(zctx)
    try:
        d.subscribe(A, pub)
        d.pump(lambda: pub.replay_requests == [0], [pub])  # the replay on connecting: none held, nothing to give
        pub.send(0, batch([stored([1], None, GOOD[:4], BS)]))
        d.pump(lambda: d.applied(A, 0), [pub])
        # a gap; the replay socket is slow (not served): live batches are held, three of 900 KiB overflow 2 MiB
        for seq in (5, 6, 7):
            pub.send(seq, padded([stored([seq], None, [seq] * 4, BS)], 900 << 10))
        deadline = time.monotonic() + 5
        while d.sub.stats["replays_failed"] == 0:
            assert time.monotonic() < deadline, d.sub.stats
            time.sleep(0.01)
        d.pump(lambda: d.applied(A, 7), [])
        assert d.index.blocks_of(A) == blocks([5] * 4) | blocks([6] * 4) | blocks([7] * 4)
    finally:
        d.sub.close()
        pub.close()


def test_replayed_batches_are_bounded_in_bytes(zctx):
    d = Direct(max_message_bytes=1 << 20, max_held_bytes=2 << 20)
    pub = Publisher(zctx)
    try:
        d.subscribe(A, pub)
        d.pump(lambda: pub.replay_requests == [0], [pub])
        pub.send(0, batch([stored([1], None, GOOD[:4], BS)]))
        d.pump(lambda: d.applied(A, 0), [pub])
        for seq in (1, 2, 3):  # lost on the way; the replay would give back 2.7 MiB
            pub.send(seq, padded([stored([seq + 1], seq, [seq] * 4, BS)], 900 << 10), publish=False)
        pub.send(4, batch([stored([9], None, LATER, BS)]))
        d.pump(lambda: d.applied(A, 4), [pub])
        assert d.sub.stats["replays_failed"] == 1  # not all of it could be kept: dropped, rebuilt from batch 4
        assert d.index.blocks_of(A) == blocks(LATER)
    finally:
        d.sub.close()
        pub.close()


def test_sockets_refuse_messages_over_the_bound(zctx):
    d = Direct(max_message_bytes=1 << 20)
    pub = verbose(Publisher(zctx, replay=False))
    try:
        d.subscribe(A, pub)
        assert d.sub.max_message_bytes == 1 << 20
        pub.send(0, padded([stored([1], None, GOOD[:4], BS)], 2 << 20))
        wait_resubscribed(pub)
        d.pump(lambda: d.sub.stats["reconnects"] == 1, [])
        pub.send(1, batch([stored([2], None, LATER, BS)]))
        d.pump(lambda: d.applied(A, 1), [])
        assert d.index.blocks_of(A) == blocks(LATER)
    finally:
        d.sub.close()
        pub.close()


# -- field-level validation, property-based -----------------------------------------------------------------------

ODD = st.sampled_from([None, True, False, 0, 1, -1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), 0.5,
                       float("nan"), "", "GPU", "x" * (MAX_NAME_CHARS + 1), b"", b"\x01" * 32, b"\x01" * 65, [], {},
                       [1], [[1]], {"a": 1}, msgpack.ExtType(1, b"x")])
scalars = st.one_of(ODD, st.integers(min_value=-(2**63), max_value=2**64 - 1), st.floats(), st.text(max_size=8),
                    st.binary(max_size=40), st.booleans(), st.none())
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                        st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                      max_leaves=10)
ints = st.integers(min_value=0, max_value=40)
hashes = st.one_of(st.integers(min_value=-(2**63), max_value=2**64 - 1), st.binary(min_size=1, max_size=64), values)


@st.composite
def stored_events(draw):
    n, size = draw(st.integers(0, 3)), draw(st.sampled_from([1, 2, 4, 0, -1, MAX_BLOCK_SIZE + 1, 2.0, None]))
    good_size = size if type(size) is int and 0 < size <= 4 else 1
    fields = {"type": "BlockStored", "block_hashes": draw(st.lists(hashes, min_size=n, max_size=n)),
              "parent_block_hash": draw(st.one_of(st.none(), hashes)),
              "token_ids": draw(st.lists(st.one_of(ints, values), min_size=n * good_size, max_size=n * good_size)),
              "block_size": size, "lora_id": draw(st.one_of(st.none(), values)),
              "medium": draw(st.one_of(st.just("GPU"), values)),
              "lora_name": draw(st.one_of(st.none(), st.text(max_size=10), values)),
              "extra_keys": draw(st.one_of(st.none(), st.lists(st.one_of(st.none(), st.lists(values, max_size=2)),
                                                               max_size=4), values))}
    for key in draw(st.lists(st.sampled_from(sorted(fields)), max_size=2)):
        fields.pop(key, None)
    if draw(st.booleans()):  # the pre-2026 positional form
        order = ["block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
                 "extra_keys"]
        return ["BlockStored", *(fields.get(k) for k in order)]
    return fields


events = st.one_of(stored_events(), st.fixed_dictionaries({"type": st.just("BlockRemoved"),
                                                           "block_hashes": st.one_of(st.lists(hashes, max_size=3),
                                                                                     values)}),
                   st.just({"type": "AllBlocksCleared"}), st.just(["AllBlocksCleared"]),
                   st.fixed_dictionaries({"type": st.one_of(st.text(max_size=12), values)}), values)
batches = st.one_of(st.fixed_dictionaries({"ts": st.one_of(st.floats(), values),
                                           "events": st.one_of(st.lists(events, max_size=4), values)}),
                    st.tuples(st.floats(), st.lists(events, max_size=4), st.integers(0, 3)).map(list), values)


def check_event(event) -> None:
    """What the subscriber relies on, for every event decode_batch returns."""
    assert isinstance(event, (Stored, Removed, Cleared))
    if isinstance(event, Cleared):
        return
    for h in event.block_hashes:
        assert type(h) in (int, bytes) and hash(h) is not None
    if isinstance(event, Stored):
        assert event.parent_block_hash is None or type(event.parent_block_hash) in (int, bytes)
        assert type(event.block_size) is int and 1 <= event.block_size <= MAX_BLOCK_SIZE
        assert all(isinstance(t, int) and 0 <= t <= MAX_TOKEN_ID for t in event.token_ids)
        assert len(event.token_ids) == len(event.block_hashes) * event.block_size
        assert event.lora_name is None or (type(event.lora_name) is str and len(event.lora_name) <= MAX_NAME_CHARS)
        assert event.cache_salt is None or type(event.cache_salt) is str
        chain(event.token_ids, event.block_size, root_hash(event.lora_name, event.cache_salt))


@pytest.mark.slow
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches)
def test_any_event_structure_decodes_to_valid_events_or_bad_payload(structure):
    try:
        payload = msgpack.packb(structure, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return  # not representable in msgpack: no publisher can send it
    try:
        decoded = decode_batch(payload)
    except BadPayload:
        return
    for event in decoded:
        check_event(event)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_decode_to_valid_events_or_bad_payload(payload):
    try:
        decoded = decode_batch(payload)
    except BadPayload:
        return
    for event in decoded:
        check_event(event)


@pytest.mark.parametrize("block_size, min_tokens", [(16, 2_500_000), (1, 650_000)])
def test_the_message_bound_holds_a_huge_engine_step(block_size, min_tokens):
    """MAX_MESSAGE_BYTES against what the engine really sends: a step's BlockStored and as many BlockRemoved,
    token ids over 65536 (5 bytes each), encoded by the engine's own encoder."""
    from kvgate.engine.kv_events import BlockRemoved, BlockStored, KVEventBatch, encode_batch

    tokens = 1 << 16
    digests = [i.to_bytes(16, "big") for i in range(tokens // block_size)]
    step = KVEventBatch([BlockStored(digests, None, [100_000] * tokens, block_size), BlockRemoved(digests)])
    per_token = len(encode_batch(step)) / tokens
    assert MAX_MESSAGE_BYTES / per_token >= min_tokens


@pytest.mark.slow
def test_a_batch_storing_and_removing_many_blocks_costs_linear_time(zctx, harness):
    """Stored-then-removed blocks within one batch net out; with 50000 of each that must not be quadratic (a
    list's membership test per block made it 29 s of the thread's time, every endpoint waiting)."""
    pub = Publisher(zctx, replay=False)
    harness.subscribe(A, pub)
    n = 50_000
    hashes = list(range(1, n + 1))
    tokens = [i % 50_000 for i in range(n * BS)]
    pub.send(0, batch([stored(hashes, None, tokens, BS), removed(hashes[::-1]), stored([n + 1], None, LATER, BS)]))
    started = time.monotonic()
    harness.pump(lambda: harness.applied(A, 0), timeout=30.0)
    assert harness.index.blocks_of(A) == blocks(LATER)
    assert time.monotonic() - started < 20  # ~1 s on the shared 2-core box; 29 s when it was quadratic
