"""KV-cache events (`--kv-events-config`): vLLM's wire format, read back by a decoder written here from that format.

The decoder below knows only the format (ZeroMQ multipart [topic, 8-byte big-endian sequence number, msgpack
batch]; a batch is a map {ts, events, data_parallel_rank}; an event is a map tagged by `type`), never our encoder.
Replaying what it decodes must give exactly the engine's prefix-cache table, after evictions, preemptions, aborts
and a reset; the replay socket must give back what a late subscriber missed.
"""

from __future__ import annotations

import json
import random
import socket
import subprocess
import time

import httpx
import msgpack
import pytest
import zmq

from kvgate.engine.config import EngineConfig
from kvgate.engine.kv_events import KVEventsConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.sim_runner import SimProfile
from tests.procs import KVGATE, KvgateServe, free_port

BLOCK_SIZE = 16
END_OF_REPLAY = -1
STORED_KEYS = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"}


# -- the independent decoder ----------------------------------------------------------------------------------------


def decode_frames(frames: list[bytes], topic: bytes) -> tuple[int, dict]:
    assert len(frames) == 3, frames
    assert frames[0] == topic
    assert len(frames[1]) == 8
    seq = int.from_bytes(frames[1], "big", signed=False)
    return seq, decode_payload(frames[2])


def decode_payload(payload: bytes) -> dict:
    batch = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    assert isinstance(batch, dict) and set(batch) == {"ts", "events", "data_parallel_rank"}, batch
    assert isinstance(batch["ts"], float) and abs(batch["ts"] - time.time()) < 600
    assert batch["data_parallel_rank"] == 0
    for event in batch["events"]:
        kind = event["type"]
        if kind == "BlockStored":
            assert set(event) == STORED_KEYS, event
            assert event["block_size"] == BLOCK_SIZE and event["medium"] == "GPU"
            assert len(event["token_ids"]) == len(event["block_hashes"]) * BLOCK_SIZE
            assert len(event["extra_keys"]) == len(event["block_hashes"])
            assert all(isinstance(h, int) and 0 <= h < 2**64 for h in event["block_hashes"])
        elif kind == "BlockRemoved":
            assert set(event) == {"type", "block_hashes", "medium", "group_idx"}, event
            assert event["block_hashes"]
        else:
            assert event == {"type": "AllBlocksCleared"}, event
    return batch


class Index:
    """What a router learns from the stream: the engine's cached hashes, with each block's tokens."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int | None, tuple[int, ...]]] = {}  # hash -> (parent, tokens)
        self.counts = {"BlockStored": 0, "BlockRemoved": 0, "AllBlocksCleared": 0}

    def apply(self, batch: dict) -> None:
        for event in batch["events"]:
            self.counts[event["type"]] += 1
            if event["type"] == "BlockStored":
                parent = event["parent_block_hash"]
                tokens = event["token_ids"]
                for i, block_hash in enumerate(event["block_hashes"]):
                    assert block_hash not in self.blocks, "stored twice without a removal"
                    self.blocks[block_hash] = (parent, tuple(tokens[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]))
                    parent = block_hash
            elif event["type"] == "BlockRemoved":
                for block_hash in event["block_hashes"]:
                    assert block_hash in self.blocks, "removal of a block never stored"
                    del self.blocks[block_hash]
            else:
                self.blocks.clear()


class Subscriber:
    """A vLLM-events consumer: SUB for the stream, a DEALER to the replay socket to fill gaps."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str | None, topic: bytes, bind: bool) -> None:
        self.topic = topic
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.IPV6, 1)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        (self.sub.bind if bind else self.sub.connect)(endpoint)
        self.replay_endpoint = replay
        self.ctx = ctx
        self.index = Index()
        self.next_seq = 0
        self.payloads: dict[int, bytes] = {}
        self.num_replayed = 0

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IPV6, 1)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                assert dealer.poll(5000), "no replay answer within 5 s"
                empty, seq_bytes, payload = dealer.recv_multipart()
                assert empty == b""
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_OF_REPLAY:
                    assert payload == b""
                    return out
                out.append((seq, payload))
        finally:
            dealer.close()

    def _take(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq
        self.index.apply(decode_payload(payload))
        self.payloads[seq] = payload
        self.next_seq = seq + 1

    def receive_until(self, last_seq: int, timeout: float = 10.0) -> None:
        """Apply batches in order up to `last_seq`, replaying any gap (a late start included)."""
        deadline = time.monotonic() + timeout
        while self.next_seq <= last_seq:
            assert time.monotonic() < deadline, f"stream stalled at {self.next_seq}, waiting for {last_seq}"
            if not self.sub.poll(100):
                if self.replay_endpoint is not None:
                    self._fill_gap(last_seq + 1)
                continue
            frames = self.sub.recv_multipart()
            seq, _ = decode_frames(frames, self.topic)
            payload = frames[2]
            if seq < self.next_seq:
                continue
            if seq > self.next_seq:
                self._fill_gap(seq)
            if seq == self.next_seq:
                self._take(seq, payload)

    def _fill_gap(self, upto: int) -> None:
        for seq, payload in self.replay(self.next_seq):
            if seq == self.next_seq and seq < upto:
                self._take(seq, payload)
                self.num_replayed += 1

    def close(self) -> None:
        self.sub.close()


# -- fixtures ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def kvgate_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kvgate-cache")


def free_port_v6() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return s.getsockname()[1]


def u64(digest: bytes) -> int:
    """The format's block hash: the low 64 bits of the engine's digest, read big-endian."""
    return int.from_bytes(digest, "big") & (2**64 - 1)


def sim_engine(num_blocks: int, kv_events: KVEventsConfig, max_num_seqs: int = 8) -> LLMEngine:
    free = SimProfile(step_overhead_ms=0, prefill_ms_per_token=0, decode_ms_per_seq=0, ms_per_context_token=0,
                      max_model_len=512)
    return LLMEngine(EngineConfig(model="sim", backend="sim", sim_profile=free, block_size=BLOCK_SIZE,
                                  num_gpu_blocks_override=num_blocks, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=256, kv_events_config=kv_events))


def engine_hashes(engine: LLMEngine) -> set[int]:
    return {u64(h) for h in engine.kv_cache_manager.pool.cached}


# -- tests -------------------------------------------------------------------------------------------------------


def test_replayed_events_equal_the_engines_cache_through_evictions_preemptions_aborts_and_reset(
        zctx, kvgate_cache, monkeypatch):
    """Connect mode (a collector that binds, as in llm-d's centralized mode): the test binds, the engine connects."""
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(kvgate_cache))
    pub_port, replay_port = free_port("127.0.0.1"), free_port("127.0.0.1")
    sub = Subscriber(zctx, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}", b"kv", bind=True)
    engine = sim_engine(40, KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{pub_port}",
                                           replay_endpoint=f"tcp://127.0.0.1:{replay_port}", topic="kv"))
    try:
        rng = random.Random(7)
        tenants = [[rng.randrange(32, 127) for _ in range(rng.randrange(40, 120))] for _ in range(6)]
        live: dict[str, int] = {}
        checks = 0
        for step in range(600):
            if len(live) < 12 and rng.random() < 0.5:
                rid = f"r{step}"
                prompt = rng.choice(tenants) + [rng.randrange(32, 127) for _ in range(rng.randrange(1, 80))]
                engine.add_request(rid, prompt, SamplingParams(max_tokens=rng.randrange(4, 60), ignore_eos=True))
                live[rid] = step
                if rng.random() < 0.2:  # its twin, in the same step: both compute the same blocks (duplicates)
                    engine.add_request(rid + "b", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
                    live[rid + "b"] = step
            if live and rng.random() < 0.05:  # a client goes away mid-request
                rid = rng.choice(sorted(live))
                del live[rid]
                assert engine.abort_request(rid)
            for out in engine.step():
                if out.finished:
                    live.pop(out.request_id)
            if step % 10 == 0 and engine.kv_event_publisher.next_seq:
                sub.receive_until(engine.kv_event_publisher.next_seq - 1)
                assert set(sub.index.blocks) == engine_hashes(engine), f"diverged at step {step}"
                checks += 1
        while engine.has_unfinished_requests():
            engine.step()
        sub.receive_until(engine.kv_event_publisher.next_seq - 1)
        assert set(sub.index.blocks) == engine_hashes(engine) and sub.index.blocks
        stats = engine.stats()
        assert stats.num_preemptions > 0 and sub.index.counts["BlockRemoved"] > 0 and checks > 20, (stats, checks)

        assert engine.reset_prefix_cache()
        sub.receive_until(engine.kv_event_publisher.next_seq - 1)
        assert sub.index.counts["AllBlocksCleared"] == 1 and sub.index.blocks == {} == engine.kv_cache_manager.pool.cached
    finally:
        engine.close()
        sub.close()


def test_replay_socket_returns_missed_batches_within_buffer_steps(zctx, kvgate_cache, monkeypatch):
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(kvgate_cache))
    replay_port = free_port("127.0.0.1")
    engine = sim_engine(64, KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://kv-events-unread",
                                           replay_endpoint=f"tcp://127.0.0.1:{replay_port}", buffer_steps=5))
    sub = Subscriber(zctx, f"tcp://127.0.0.1:{free_port('127.0.0.1')}", f"tcp://127.0.0.1:{replay_port}", b"",
                     bind=True)  # nobody publishes to this one: every batch is missed, then replayed
    try:
        for i in range(8):  # eight distinct prompts: at least one batch each
            engine.add_request(f"r{i}", [40 + i] * 70, SamplingParams(max_tokens=2, ignore_eos=True))
            while engine.has_unfinished_requests():
                engine.step()
        last = engine.kv_event_publisher.next_seq - 1
        assert last >= 7
        deadline = time.monotonic() + 5
        while (got := sub.replay(0)) and got[-1][0] != last:  # the thread may still be sending the last one
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert [seq for seq, _ in got] == list(range(last - 4, last + 1))  # only buffer_steps batches kept
        assert [seq for seq, _ in sub.replay(last - 1)] == [last - 1, last]
        assert sub.replay(last + 1) == []
        stored = [e for _, p in got for e in decode_payload(p)["events"] if e["type"] == "BlockStored"]
        assert stored and all(e["token_ids"][0] in range(40, 48) for e in stored)
    finally:
        engine.close()
        sub.close()


@pytest.mark.processes
@pytest.mark.parametrize("engine_loop", ["thread", "process"])
def test_kvgate_serve_sim_stream_decodes_and_replays(zctx, kvgate_cache, engine_loop):
    """A real `kvgate serve --backend sim`, its engine loop in a thread or a process of its own (the publisher lives
    with the block pool); bind mode on IPv6 loopback (`::` in the address binds, vLLM's rule)."""
    pub_port, replay_port = free_port_v6(), free_port_v6()
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://[::1]:{pub_port}",
              "replay_endpoint": f"tcp://[::1]:{replay_port}", "topic": "kv-events", "buffer_steps": 1000,
              "hwm": 1000}
    with KvgateServe("sim", "--backend", "sim", "--sim-max-model-len", "1024", "--engine-loop", engine_loop,
                     "--kv-events-config",
                     json.dumps(config), cache_dir=kvgate_cache) as server:
        sub = Subscriber(zctx, f"tcp://[::1]:{pub_port}", f"tcp://[::1]:{replay_port}", b"kv-events", bind=False)
        try:
            prompt = "The quick brown fox jumps over the lazy dog. " * 8
            ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, timeout=10).json()["tokens"]
            r = httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 40}, timeout=30)
            assert r.status_code == 200
            num_full = len(ids) // BLOCK_SIZE  # the prompt's full blocks, at least
            deadline = time.monotonic() + 10
            while len(sub.index.blocks) < num_full:  # late subscription: the replay socket fills the gap
                assert time.monotonic() < deadline, sub.index.blocks
                sub.receive_until(sub.next_seq, timeout=10)
            first = next(b for b in sub.index.blocks.values() if b[0] is None)
            assert list(first[1]) == ids[:BLOCK_SIZE]
            prompt_blocks = {tokens for _, tokens in sub.index.blocks.values()}
            assert all(tuple(ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE]) in prompt_blocks
                       for i in range(len(ids) // BLOCK_SIZE))
            # the replay socket returns the very bytes the stream carried
            replayed = dict(sub.replay(0))
            assert replayed and all(replayed[seq] == payload for seq, payload in sub.payloads.items())
        finally:
            sub.close()


BAD_CONFIGS = [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:5557"}', "unknown key(s) endpont"),
    ("{enable_kv_cache_events: true}", "is not valid JSON"),
    ('["tcp://*:5557"]', "must be a JSON object"),
    ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps must be a positive integer"),
    ('{"enable_kv_cache_events": true, "hwm": "lots"}', "hwm must be a positive integer"),
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', 'publisher must be "zmq" or "null"'),
    ('{"enable_kv_cache_events": true, "endpoint": "localhost:5557"}', "endpoint must be a ZeroMQ address"),
    ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events must be true or false"),
]


@pytest.mark.parametrize("config, message", BAD_CONFIGS)
def test_bad_kv_events_config_is_a_one_line_error(config, message, capsys):
    from kvgate.cli import main

    assert main(["serve", "sim", "--backend", "sim", "--kv-events-config", config]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvgate serve: error: --kv-events-config"), err
    assert message in err


@pytest.mark.processes
def test_bad_kv_events_config_exits_the_real_command():
    config, message = BAD_CONFIGS[0]
    r = subprocess.run([KVGATE, "serve", "sim", "--backend", "sim", "--kv-events-config", config],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and message in r.stderr, r.stderr


def test_busy_event_port_fails_the_engine_start_clearly(zctx, kvgate_cache, monkeypatch):
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(kvgate_cache))
    taken = zctx.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(Exception, match=f"--kv-events-config: cannot open .*127.0.0.1:{port}"):
            sim_engine(64, KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://kv-busy",
                                          replay_endpoint=f"tcp://127.0.0.1:{port}"))
    finally:
        taken.close()


def test_events_are_off_by_default(kvgate_cache, monkeypatch):
    monkeypatch.setenv("KVGATE_CACHE_DIR", str(kvgate_cache))
    engine = sim_engine(64, None)
    try:
        assert engine.kv_event_publisher is None and engine.kv_cache_manager.pool.kv_events is None
        assert KVEventsConfig().publisher == "null" and not KVEventsConfig().enabled
    finally:
        engine.close()


def test_publish_never_blocks_the_step_a_full_queue_drops_and_the_sequence_skips():
    from kvgate.engine.kv_event_publisher import ZmqKVEventPublisher
    from kvgate.engine.kv_events import AllBlocksCleared, KVEventBatch

    publisher = ZmqKVEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://kv-full",
                                                   max_queue_size=2))
    publisher.shutdown()  # its thread is gone: nothing drains the queue any more
    started = time.monotonic()
    for _ in range(5):
        publisher.publish(KVEventBatch([AllBlocksCleared()]))
    assert time.monotonic() - started < 0.5
    assert (publisher.num_dropped, publisher.next_seq) == (3, 5)  # subscribers see seq 2..4 missing
