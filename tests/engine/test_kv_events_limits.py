"""The KV-event publisher under hostile or broken peers: real ZeroMQ sockets on loopback.

- a replay request gets at most `max_replay_batches` / `max_replay_bytes`, the oldest first (a prefix the
  subscriber can apply in order, then ask again), and requests over the rate get just the end marker;
- a flood of replay requests does not hold back a live batch;
- subscribers that connect and never read cost the publisher at most the byte budget (measured as the RSS of a
  publisher process of its own);
- the replay buffer is bounded in bytes, and a step's batch is split so that no message exceeds `max_batch_bytes`.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time

import msgpack
import pytest
import zmq

from kvgate.engine.kv_event_publisher import END_OF_REPLAY, ZmqKVEventPublisher
from kvgate.engine.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventsConfig,
                                     encode_batch, event_to_wire)
from tests.procs import free_port

BLOCK_SIZE = 16
MiB = 1024 * 1024


def stored(num_blocks: int, salt: str | None = None, first_token: int = 100_000) -> BlockStored:
    """A BlockStored of `num_blocks` blocks; token ids above 2**16 (5 bytes each on the wire, the most)."""
    return BlockStored(block_hashes=[os.urandom(16) for _ in range(num_blocks)], parent_block_hash=None,
                       token_ids=[first_token + i for i in range(num_blocks * BLOCK_SIZE)], block_size=BLOCK_SIZE,
                       cache_salt=salt)


def free_port_v6() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return s.getsockname()[1]


def sub_socket(ctx: zmq.Context) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.IPV6, 1)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    return sub


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


class Publisher:
    """A real publisher on loopback ports, stopped by `close`."""

    def __init__(self, **config) -> None:
        self.pub_port, self.replay_port = free_port_v6(), free_port("127.0.0.1")
        self.publisher = ZmqKVEventPublisher(KVEventsConfig(  # `::` in the address: bound (on loopback)
            enable_kv_cache_events=True, endpoint=f"tcp://[::1]:{self.pub_port}",
            replay_endpoint=f"tcp://127.0.0.1:{self.replay_port}", **config))

    def publish_and_wait(self, batches: list[KVEventBatch]) -> int:
        """Publish, wait until the thread has sent them all; the last sequence number."""
        for batch in batches:
            self.publisher.publish(batch)
        last = self.publisher.next_seq - 1
        wait_for(lambda: self.publisher.last_sent_seq >= last, 30, "the publisher thread")
        return last

    def close(self) -> None:
        self.publisher.shutdown()


def dealer(ctx: zmq.Context, port: int) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


def read_answer(sock: zmq.Socket, timeout_ms: int = 10_000) -> list[tuple[int, bytes]]:
    out = []
    while True:
        assert sock.poll(timeout_ms), "no end marker"
        empty, seq_bytes, payload = sock.recv_multipart()
        assert empty == b""
        if seq_bytes == END_OF_REPLAY:
            assert payload == b""
            return out
        out.append((int.from_bytes(seq_bytes, "big"), payload))


# -- replay: bounded per request, rate-limited --------------------------------------------------------------------


def test_one_replay_request_gets_at_most_the_bound_oldest_first(zctx):
    pub = Publisher(buffer_steps=5000, max_replay_batches=1000, max_replay_bytes=4 * MiB)
    sock = dealer(zctx, pub.replay_port)
    try:
        last = pub.publish_and_wait([KVEventBatch([stored(1)]) for _ in range(3000)])
        assert last == 2999
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        got = read_answer(sock)
        # a prefix from the start asked for: in order, applicable, and the next request goes on from there
        assert [s for s, _ in got] == list(range(1000))
        sock.send_multipart([b"", (1000).to_bytes(8, "big")])
        assert [s for s, _ in read_answer(sock)] == list(range(1000, 2000))
    finally:
        sock.close()
        pub.close()


def test_replay_answer_is_bounded_in_bytes(zctx):
    pub = Publisher(buffer_steps=1000, max_replay_batches=1000, max_replay_bytes=256 * 1024)
    sock = dealer(zctx, pub.replay_port)
    try:
        pub.publish_and_wait([KVEventBatch([stored(32)]) for _ in range(200)])  # ~2.9 KB each
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        got = read_answer(sock)
        size = sum(len(p) for _, p in got)
        assert size <= 256 * 1024 and [s for s, _ in got] == list(range(len(got)))
        assert size + len(got[0][1]) > 256 * 1024  # as many as fit, not fewer
    finally:
        sock.close()
        pub.close()


def test_replay_requests_over_the_rate_get_only_the_end_marker(zctx):
    pub = Publisher(buffer_steps=100, replay_requests_per_s=1.0, replay_requests_per_s_total=100.0)
    socks = [dealer(zctx, pub.replay_port) for _ in range(2)]
    try:
        pub.publish_and_wait([KVEventBatch([stored(1)]) for _ in range(10)])
        for _ in range(30):
            socks[0].send_multipart([b"", (0).to_bytes(8, "big")])
        answers = [read_answer(socks[0]) for _ in range(30)]
        full = [a for a in answers if a]
        assert all(len(a) == 10 for a in full)
        assert 1 <= len(full) <= pub.publisher.config.replay_burst_per_peer + 2  # the burst, and what refilled
        assert pub.publisher.stats["replays_refused"] >= 30 - len(full)
        # a limit per peer: another peer is still answered
        socks[1].send_multipart([b"", (0).to_bytes(8, "big")])
        assert len(read_answer(socks[1])) == 10
    finally:
        for sock in socks:
            sock.close()
        pub.close()


def test_replay_flood_does_not_delay_live_events(zctx):
    """A flood of 2 000 replay requests, never read, holds a live batch back under 0.5 s."""
    pub = Publisher(buffer_steps=10_000)
    flood = dealer(zctx, pub.replay_port)
    sub = sub_socket(zctx)
    sub.connect(f"tcp://[::1]:{pub.pub_port}")
    try:
        pub.publish_and_wait([KVEventBatch([stored(8)]) for _ in range(200)])
        wait_for(lambda: sub.poll(0) or pub.publisher.publish(KVEventBatch([AllBlocksCleared()])), 10,
                 "the subscription")  # publish until the SUB sees a batch: its subscription has arrived
        while sub.poll(0):
            sub.recv_multipart()
        for _ in range(2000):  # the flood: never read (the answers pile up in ZeroMQ, as a slow peer's would)
            flood.send_multipart([b"", (0).to_bytes(8, "big")])
        wait_for(lambda: pub.publisher.stats["replay_requests"] >= 1, 10, "the flood to arrive")
        marker = AllBlocksCleared()
        started = time.monotonic()
        pub.publisher.publish(KVEventBatch([marker]))
        seq = pub.publisher.next_seq - 1
        while True:
            assert sub.poll(20_000), "the live batch never came"
            frames = sub.recv_multipart()
            if int.from_bytes(frames[1], "big") == seq:
                break
        delay = time.monotonic() - started
        print(f"live batch behind a 2000-request replay flood: {delay:.3f} s")
        assert delay < 0.5
    finally:
        flood.close()
        sub.close()
        pub.close()


def test_malformed_and_oversized_replay_requests_are_ignored(zctx):
    pub = Publisher(buffer_steps=10)
    sock = dealer(zctx, pub.replay_port)
    try:
        pub.publish_and_wait([KVEventBatch([stored(1)]) for _ in range(3)])
        sock.send_multipart([b"", b"\x00" * 7])  # not 8 bytes
        sock.send_multipart([b"", b"x" * 100_000])  # over the socket's MAXMSGSIZE: the peer is disconnected
        time.sleep(0.2)
        good = dealer(zctx, pub.replay_port)
        try:
            good.send_multipart([b"", (1).to_bytes(8, "big")])
            assert [s for s, _ in read_answer(good)] == [1, 2]
        finally:
            good.close()
    finally:
        sock.close()
        pub.close()


# -- sizes: batches split, buffer bounded --------------------------------------------------------------------------


def test_a_big_step_is_split_so_no_message_exceeds_max_batch_bytes(zctx):
    pub = Publisher(buffer_steps=100, max_batch_bytes=8192)
    try:
        big = stored(400, salt="tenant-a")  # ~33 KB on the wire in one event
        removed = BlockRemoved(block_hashes=[os.urandom(16) for _ in range(3000)])
        last = pub.publish_and_wait([KVEventBatch([stored(2), big, removed, AllBlocksCleared()])])
        payloads = [p for _, p in pub.publisher.buffered()]
        assert last == len(payloads) - 1 > 4 and all(len(p) <= 8192 for p in payloads)
        events = [e for p in payloads for e in msgpack.unpackb(p)["events"]]
        # the same blocks, in order, each run chained to the one before; the salt on block 0 only
        runs = [e for e in events if e["type"] == "BlockStored"][1:]
        wire_big = event_to_wire(big)
        assert [h for e in runs for h in e["block_hashes"]] == wire_big["block_hashes"]
        assert [t for e in runs for t in e["token_ids"]] == wire_big["token_ids"]
        assert [k for e in runs for k in e["extra_keys"]] == wire_big["extra_keys"]
        assert runs[0]["parent_block_hash"] is None
        for before, after in zip(runs, runs[1:]):
            assert after["parent_block_hash"] == before["block_hashes"][-1]
        removed_hashes = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert removed_hashes == event_to_wire(removed)["block_hashes"]
        assert events[-1] == {"type": "AllBlocksCleared"}
    finally:
        pub.close()


def test_the_size_bound_holds_for_any_event():
    from kvgate.engine.kv_events import batch_size_bound, split_batch

    rng = random.Random(7)
    for _ in range(300):
        events = []
        for _ in range(rng.randint(0, 6)):
            kind = rng.random()
            if kind < 0.6:
                n = rng.randint(1, 80)
                events.append(BlockStored([os.urandom(16) for _ in range(n)], rng.choice([None, os.urandom(16)]),
                                          [rng.randint(0, 2**32 - 1) for _ in range(n * BLOCK_SIZE)], BLOCK_SIZE,
                                          cache_salt=rng.choice([None, "", "s" * rng.randint(1, 300), "ü" * 40]),
                                          first_block_index=rng.choice([0, 0, 3]), lora_id=rng.choice([None, 7]),
                                          lora_name=rng.choice([None, "adapter-x"])))
            elif kind < 0.9:
                events.append(BlockRemoved([os.urandom(16) for _ in range(rng.randint(1, 500))]))
            else:
                events.append(AllBlocksCleared())
        batch = KVEventBatch(events)
        assert len(encode_batch(batch, 3)) <= batch_size_bound(batch)
        limit = rng.choice([2048, 4096, 16384])
        parts, left_out = split_batch(batch, limit)
        assert left_out == 0  # no salt or name here is near the limit
        for part in parts:
            assert len(encode_batch(part, 3)) <= limit


def test_a_block_too_big_for_any_message_is_left_out_not_sent_whole():
    """A salt near max_batch_bytes (a client chooses it): its block is left out, the blocks after it still go."""
    pub = Publisher(buffer_steps=100, max_batch_bytes=2048)
    try:
        last = pub.publish_and_wait([KVEventBatch([stored(3, salt="s" * 3000)])])
        assert pub.publisher.num_blocks_too_big == 1
        payloads = [p for _, p in pub.publisher.buffered()]
        assert last == len(payloads) - 1 and all(len(p) <= 2048 for p in payloads)
        (event,) = [e for p in payloads for e in msgpack.unpackb(p)["events"]]
        assert len(event["block_hashes"]) == 2 and event["extra_keys"] == [None, None]
    finally:
        pub.close()


@pytest.mark.parametrize("key, value, says", [
    ("max_batch_bytes", 100, "max_batch_bytes must be at least 1024"),
    ("max_subscriber_bytes", 2048, "max_subscriber_bytes must be at least max_batch_bytes"),
    ("max_replay_batches", 0, "max_replay_batches must be a positive integer"),
    ("replay_requests_per_s", 0, "replay_requests_per_s must be a positive number"),
    ("replay_requests_per_s_total", "fast", "replay_requests_per_s_total must be a positive number"),
])
def test_bad_limits_are_refused_by_name(key, value, says):
    from kvgate.common.errors import ConfigError

    with pytest.raises(ConfigError, match=says):
        KVEventsConfig.from_json(json.dumps({"enable_kv_cache_events": True, key: value}))


def test_subscriber_hwm_fits_the_byte_budget():
    config = KVEventsConfig(enable_kv_cache_events=True, topic="kv-events")
    assert config.subscriber_hwm * (config.max_batch_bytes + len("kv-events") + 8) <= config.max_subscriber_bytes
    assert config.subscriber_hwm == 1022
    assert KVEventsConfig(hwm=10, max_batch_bytes=1024).subscriber_hwm == 10  # a smaller hwm stays


def test_replay_buffer_is_bounded_in_bytes():
    pub = Publisher(buffer_steps=10_000, max_buffer_bytes=1 * MiB)
    try:
        pub.publish_and_wait([KVEventBatch([stored(32)]) for _ in range(1000)])  # ~2.9 MB in all
        buffered = pub.publisher.buffered()
        assert sum(len(p) for _, p in buffered) <= 1 * MiB
        assert buffered[-1][0] == 999 and len(buffered) > 300  # the newest kept, as many as fit
    finally:
        pub.close()


# -- slow subscribers ------------------------------------------------------------------------------------------------

_RSS_PROBE = r"""
import json, os, sys, time
from kvgate.engine.kv_event_publisher import ZmqKVEventPublisher
from kvgate.engine.kv_events import BlockStored, KVEventBatch, KVEventsConfig

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

config, count = json.loads(sys.argv[1]), int(sys.argv[2])
pub = ZmqKVEventPublisher(KVEventsConfig(**config))
events = [BlockStored([os.urandom(16) for _ in range(32)], None, [100_000 + i for i in range(512)], 16)
          for _ in range(3)]  # ~8.6 KB a batch; the same objects every time, so the queue costs nothing

def drain():
    deadline = time.monotonic() + 60
    while pub._queue.qsize() and time.monotonic() < deadline:
        time.sleep(0.005)

for _ in range(200):
    pub.publish(KVEventBatch(events))
drain()
print("ready", flush=True)
sys.stdin.readline()
base = rss()
for i in range(count):
    pub.publish(KVEventBatch(events))
    if i % 200 == 199:
        drain()
drain()
time.sleep(0.5)
print(json.dumps({"growth": rss() - base}), flush=True)
pub.shutdown()
"""


@pytest.mark.processes
def test_subscribers_that_never_read_cost_at_most_the_byte_budget(zctx):
    """Three subscribers that connect and never read grow the publisher (a process of its own, by its RSS) by
    at most three times the per-subscriber byte budget."""
    port = free_port_v6()
    config = {"enable_kv_cache_events": True, "endpoint": f"tcp://[::1]:{port}", "buffer_steps": 10}
    probe = subprocess.Popen([sys.executable, "-c", _RSS_PROBE, json.dumps(config), "12000"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    subs = []
    try:
        assert probe.stdout.readline().strip() == "ready"
        for _ in range(3):
            sub = sub_socket(zctx)
            sub.setsockopt(zmq.RCVHWM, 1)  # never read: what piles up, piles up at the publisher
            sub.setsockopt(zmq.RCVBUF, 4096)
            sub.connect(f"tcp://[::1]:{port}")
            subs.append(sub)
        time.sleep(1.0)  # the subscriptions reach the publisher
        probe.stdin.write("go\n")
        probe.stdin.flush()
        growth = json.loads(probe.stdout.readline())["growth"]
        print(f"publisher RSS growth with 3 subscribers that never read (~100 MB published): {growth / MiB:.1f} MiB")
        budget = KVEventsConfig().max_subscriber_bytes
        assert growth <= 3 * budget, f"{growth / MiB:.1f} MiB"
    finally:
        for sub in subs:
            sub.close()
        try:
            probe.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            probe.kill()
            probe.communicate()
