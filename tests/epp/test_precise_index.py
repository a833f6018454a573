"""The precise prefix index fed by KV-cache events: both of vLLM's encodings, gaps (replayed, or dropped and
rebuilt), engine restarts, endpoint removal, bounded memory, speculative entries; and, after a
mixed workload with evictions and preemptions on two real sim engines, the index of each endpoint equals that
engine's block pool."""

from __future__ import annotations

import random
import socket
import tracemalloc

import pytest
import zmq

from kvgate.engine.block_pool import hash_block_tokens, root_block_hash
from kvgate.engine.config import EngineConfig
from kvgate.engine.kv_events import KVEventsConfig
from kvgate.engine.llm_engine import LLMEngine
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.sim_runner import SimProfile
from kvgate.epp.kv_events.engine_hashes import BYTES_PER_BLOCK, EngineHashes
from kvgate.epp.prefix.hashing import chain, root_hash
from kvgate.epp.prefix.precise_index import Delta, PreciseIndex
from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState, LLMRequest
from tests.epp.kv_events_helpers import Harness, Publisher, batch, cleared, removed, stored

BS = 4
A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def blocks(tokens, salt=None):
    return set(chain(tokens, BS, root_hash(None, salt)))


TOKENS = list(range(100, 112))  # three blocks of 4


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_both_encodings_index_the_blocks_by_our_hashes_and_remove_by_engine_hashes(zctx, harness, encoding):
    pub = Publisher(zctx)
    harness.subscribe(A, pub)
    pub.send(0, batch([stored([11, 12], None, TOKENS[:8], BS, encoding),
                       stored([13], 12, TOKENS[8:], BS, encoding)], encoding))
    harness.pump(lambda: harness.applied(A, 0))
    assert harness.index.blocks_of(A) == blocks(TOKENS)
    assert harness.index.block_sizes[A] == BS
    pub.send(1, batch([removed([13], encoding)], encoding))
    harness.pump(lambda: harness.applied(A, 1))
    assert harness.index.blocks_of(A) == blocks(TOKENS[:8])
    pub.send(2, batch([cleared(encoding)], encoding))
    harness.pump(lambda: harness.applied(A, 2))
    assert harness.index.blocks_of(A) == set()


def test_cache_salt_separates_namespaces(zctx, harness):
    pub = Publisher(zctx)
    harness.subscribe(A, pub)
    pub.send(0, batch([stored([1, 2], None, TOKENS[:8], BS, salt="tenant-a")]))
    harness.pump(lambda: harness.applied(A, 0))
    assert harness.index.blocks_of(A) == blocks(TOKENS[:8], "tenant-a")
    assert not harness.index.blocks_of(A) & blocks(TOKENS[:8])


def test_stored_and_removed_within_one_batch_nets_out(zctx, harness):
    pub = Publisher(zctx)
    harness.subscribe(A, pub)
    pub.send(0, batch([stored([1], None, TOKENS[:4], BS), removed([1]), stored([2], None, TOKENS[4:8], BS),
                       removed([2]), stored([3], None, TOKENS[4:8], BS)]))
    harness.pump(lambda: harness.applied(A, 0))
    assert harness.index.blocks_of(A) == blocks(TOKENS[4:8])


def test_a_gap_is_filled_by_the_replay_socket(zctx, harness):
    pub = Publisher(zctx)
    harness.subscribe(A, pub)
    pub.send(0, batch([stored([1], None, TOKENS[:4], BS)]))
    harness.pump(lambda: harness.applied(A, 0))
    pub.send(1, batch([stored([2], 1, TOKENS[4:8], BS)]), publish=False)  # lost on the way, kept for replay
    pub.send(2, batch([stored([3], 2, TOKENS[8:12], BS)]), publish=False)
    pub.send(3, batch([removed([1])]))
    harness.pump(lambda: harness.applied(A, 3))
    assert harness.index.blocks_of(A) == blocks(TOKENS) - blocks(TOKENS[:4])
    stats = harness.scorer.subscriber.stats
    assert pub.replay_requests[-1] == 1 and stats["gaps"] == 1  # (a first one, from 0, on connecting)


def test_a_gap_the_replay_cannot_fill_drops_the_endpoint_then_rebuilds(zctx, harness):
    pub = Publisher(zctx)
    harness.subscribe(A, pub)
    pub.send(0, batch([stored([1], None, TOKENS[:4], BS)]))
    harness.pump(lambda: harness.applied(A, 0))
    pub.send(1, batch([stored([9], None, [7] * 4, BS)]), buffer=False, publish=False)  # gone for good
    pub.send(2, batch([stored([5], None, [5] * 4, BS)]))
    harness.pump(lambda: harness.applied(A, 2))
    # block 1 may be gone on the engine (batch 1 is unknown): dropped; what follows is indexed again
    assert harness.index.blocks_of(A) == blocks([5] * 4)
    assert harness.scorer.subscriber.stats["replays_failed"] == 1


def test_a_gap_without_replay_socket_drops_the_endpoint(zctx, harness):
    pub = Publisher(zctx, replay=False)
    harness.subscribe(A, pub)
    pub.send(0, batch([stored([1], None, TOKENS[:4], BS)]))
    harness.pump(lambda: harness.applied(A, 0))
    pub.send(5, batch([stored([5], None, [5] * 4, BS)]))
    harness.pump(lambda: harness.applied(A, 5))
    assert harness.index.blocks_of(A) == blocks([5] * 4)


def test_engine_restart_sequence_goes_back_drops_the_blocks(zctx, harness):
    pub = Publisher(zctx, replay=False)
    harness.subscribe(A, pub)
    pub.send(0, batch([stored([1], None, TOKENS[:4], BS)]))
    pub.send(1, batch([stored([2], 1, TOKENS[4:8], BS)]))
    harness.pump(lambda: harness.applied(A, 1))
    pub.send(0, batch([stored([7], None, [7] * 4, BS)]))  # a new engine: numbering from 0, an empty cache
    harness.pump(lambda: harness.scorer.subscriber.stats["restarts"] == 1 and harness.applied(A, 0))
    assert harness.index.blocks_of(A) == blocks([7] * 4)


def test_a_late_subscriber_learns_the_history_of_an_idle_engine_on_connecting(zctx, harness):
    pub = Publisher(zctx)
    pub.send(0, batch([stored([1], None, TOKENS[:4], BS)]), publish=False)
    pub.send(1, batch([stored([2], 1, TOKENS[4:8], BS)]), publish=False)
    harness.subscribe(A, pub)
    harness.pump(lambda: harness.applied(A, 1))  # nothing published since: the replay on connecting
    assert harness.index.blocks_of(A) == blocks(TOKENS[:8])
    pub.send(2, batch([stored([3], 2, TOKENS[8:], BS)]))
    harness.pump(lambda: harness.applied(A, 2))
    assert harness.index.blocks_of(A) == blocks(TOKENS) and pub.replay_requests == [0]


def test_endpoint_removal_drops_its_blocks_and_closes_its_socket(zctx, harness):
    pa, pb = Publisher(zctx), Publisher(zctx)
    harness.subscribe(A, pa)
    harness.subscribe(B, pb)
    pa.send(0, batch([stored([1], None, TOKENS[:4], BS)]))
    pb.send(0, batch([stored([1], None, TOKENS[:4], BS)]))
    harness.pump(lambda: harness.applied(A, 0) and harness.applied(B, 0))
    hashes = chain(TOKENS[:4], BS, root_hash(None, None))
    assert harness.index.match(hashes) == {A: 1, B: 1}
    harness.index.add_speculative(hashes, A)
    harness.scorer.remove_endpoint(A)
    assert harness.index.match(hashes) == {B: 1} and harness.index.blocks_of(A) == set()
    # the socket closes: the publisher sees the unsubscription (XPUB reports it; a closed SUB's is b"\0")
    harness.pump(lambda: A not in harness.scorer.subscriber._streams)
    assert pa.pub.poll(5000) and pa.pub.recv()[0] == 0
    # a delta made before the removal, delivered after it, is ignored
    harness.index.apply(Delta(A, 1, added=hashes))
    assert harness.index.blocks_of(A) == set() and harness.index.stale_deltas == 1


def test_bad_payloads_are_counted_not_fatal(zctx, harness):
    pub = Publisher(zctx, replay=False)
    harness.subscribe(A, pub)
    pub.send(0, b"\xc1not msgpack")
    pub.send(1, batch([stored([1], None, TOKENS[:3], BS)]))  # 3 token ids for a block of 4
    pub.send(2, batch([stored([1], None, TOKENS[:4], BS)]))
    harness.pump(lambda: harness.applied(A, 2))
    assert harness.scorer.subscriber.stats["bad_payloads"] == 2
    assert harness.index.blocks_of(A) == blocks(TOKENS[:4])


def test_memory_is_bounded_by_the_budget(zctx):
    h = Harness(index_max_bytes=100 * BYTES_PER_BLOCK)
    try:
        pub = Publisher(zctx, replay=False)
        h.subscribe(A, pub)
        pub.send(0, batch([stored(list(range(1, 301)), None, list(range(300 * BS)), BS)]))
        h.pump(lambda: h.applied(A, 0))
        assert h.index.size() == 100 and h.scorer.subscriber.stats["blocks_over_budget"] == 200
    finally:
        h.close()


def test_bytes_per_block_covers_what_both_sides_hold():
    """BYTES_PER_BLOCK (the budget's unit) ≥ the measured cost of one block: the thread's engine-hash map and
    the loop's index (its set entry and holder bitset)."""
    n = 20_000
    tokens = list(range(n * BS))
    ours = chain(tokens, BS, root_hash(None, None))
    engine = [random.getrandbits(64) for _ in range(n)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    table, index = EngineHashes(), PreciseIndex()
    index.watch(A, 1)
    for e, h in zip(engine, ours):
        table.ours[e] = h
        table.count[h] = 1
    index.apply(Delta(A, 1, added=list(ours)))
    per_block = (tracemalloc.get_traced_memory()[0] - before) / n
    tracemalloc.stop()
    print(f"bytes per indexed block: {per_block:.0f}")
    assert per_block <= BYTES_PER_BLOCK


def test_speculative_entries_expire_and_are_bounded():
    now = [0.0]
    index = PreciseIndex(speculative_ttl_s=2.0, max_speculative=5, clock=lambda: now[0])
    hashes = chain(TOKENS, BS, root_hash(None, None))
    index.add_speculative(hashes, A)
    assert index.match(hashes) == {A: 3}
    now[0] = 1.9
    assert index.match(hashes) == {A: 3}
    now[0] = 2.1
    assert index.match(hashes) == {} and index.speculative_size() == 0
    index.add_speculative(hashes, A)
    index.add_speculative(hashes, B)  # 6 entries > 5: A's oldest go first
    assert index.speculative_size() == 5 and index.match(hashes) == {B: 3}


def test_match_is_the_leading_run_per_endpoint():
    index = PreciseIndex()
    hashes = chain(list(range(20)), BS, root_hash(None, None))  # 5 blocks
    for address, held in ((A, hashes[:3]), (B, hashes[:1] + hashes[2:])):  # B lacks block 1
        index.watch(address, 1)
        index.apply(Delta(address, 1, added=held))
    assert index.match(hashes) == {A: 3, B: 1}
    assert index.match(hashes[1:]) == {A: 2}
    assert index.match([]) == {}


# -- the index equals the engines' block pools ------------------------------------------------------------------


def free_port_v6() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return s.getsockname()[1]


def sim_engine(port: int, replay_port: int) -> LLMEngine:
    free = SimProfile(step_overhead_ms=0, prefill_ms_per_token=0, decode_ms_per_seq=0, ms_per_context_token=0,
                      max_model_len=512)
    events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://[::1]:{port}",
                            replay_endpoint=f"tcp://[::1]:{replay_port}", topic="kv-events")
    return LLMEngine(EngineConfig(model="sim", backend="sim", sim_profile=free, block_size=16,
                                  num_gpu_blocks_override=40, max_num_seqs=8, max_num_batched_tokens=256,
                                  kv_events_config=events))


def engine_leading_blocks(engine: LLMEngine, tokens: list[int], salt: str | None) -> int:
    """How many leading full blocks of `tokens` the engine's block pool holds (the engine's own hashes)."""
    parent, n = root_block_hash((salt,)), 0
    cached = engine.kv_cache_manager.pool.cached
    for i in range(len(tokens) // 16):
        parent = hash_block_tokens(parent, tokens[i * 16:(i + 1) * 16])
        if parent not in cached:
            break
        n += 1
    return n


def u64(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & (2**64 - 1)


def test_index_equals_each_engines_block_pool_after_evictions_and_preemptions(monkeypatch, tmp_path):
    from kvgate.epp.kv_events.sources import EventSource

    monkeypatch.setenv("KVGATE_CACHE_DIR", str(tmp_path))
    ports = {A: (free_port_v6(), free_port_v6()), B: (free_port_v6(), free_port_v6())}
    engines = {a: sim_engine(*p) for a, p in ports.items()}
    h = Harness()
    try:
        h.scorer.set_sources([EventSource(a, f"tcp://[::1]:{p}", f"tcp://[::1]:{r}", "kv-events")
                              for a, (p, r) in ports.items()])
        states = [EndpointState(Endpoint(a), EndpointMetrics(), stale=False) for a in engines]
        rng = random.Random(3)
        tenants = [[rng.randrange(32, 127) for _ in range(rng.randrange(40, 150))] for _ in range(8)]
        salts = [None, None, None, "tenant-x"]
        prompts: list[tuple[list[int], str | None]] = []
        live = {a: {} for a in engines}
        checks = 0

        def wait_applied():
            for a, engine in engines.items():
                seq = engine.kv_event_publisher.next_seq - 1
                if seq >= 0:
                    h.pump(lambda: h.applied(a, seq), timeout=10)

        for step in range(500):
            if rng.random() < 0.6:
                tokens = rng.choice(tenants) + [rng.randrange(32, 127) for _ in range(rng.randrange(1, 90))]
                salt = rng.choice(salts)
                prompts.append((tokens, salt))
                request = LLMRequest(f"r{step}", "sim", "sim", "", cache_salt=salt, body={"prompt": tokens})
                scores = h.scorer.score(request, states)
                target = states[int(scores.argmax())] if scores.max() > 0 else rng.choice(states)
                engine = engines[target.address]
                if sum(len(v) for v in live.values()) < 20:
                    engine.add_request(f"r{step}", tokens, SamplingParams(max_tokens=rng.randrange(4, 50),
                                                                            ignore_eos=True), cache_salt=salt)
                    live[target.address][f"r{step}"] = step
            for a, engine in engines.items():
                if live[a] and rng.random() < 0.03:
                    rid = rng.choice(sorted(live[a]))
                    del live[a][rid]
                    assert engine.abort_request(rid)
                for out in engine.step():
                    if out.finished:
                        live[a].pop(out.request_id, None)
            if step % 25 == 24:
                wait_applied()
                for a, engine in engines.items():
                    table = h.scorer.subscriber._streams[a].hashes
                    assert set(table.ours) == {u64(d) for d in engine.kv_cache_manager.pool.cached}, step
                    assert h.index.blocks_of(a) == set(table.ours.values()), step
                    for tokens, salt in prompts[-30:]:
                        ours = chain(tokens, 16, root_hash(None, salt))
                        assert h.index.match(ours).get(a, 0) == engine_leading_blocks(engine, tokens, salt), step
                checks += 1
        for engine in engines.values():
            while engine.has_unfinished_requests():
                engine.step()
        wait_applied()
        for a, engine in engines.items():
            assert h.index.blocks_of(a) and len(h.index.blocks_of(a)) == len(engine.kv_cache_manager.pool.cached)
        stats = {a: e.stats() for a, e in engines.items()}
        assert all(s.num_preemptions > 0 for s in stats.values()), stats  # small KV: preemptions on both
        sub_stats = h.scorer.subscriber.stats
        assert sub_stats["orphan_blocks"] == 0 and checks == 20
        assert sub_stats["blocks_removed"] > sub_stats["blocks_stored"] // 2 > 40, sub_stats  # LRU reuse, often
        # both engines got work, and the removals (evictions) reached the index
        assert all(len(e.kv_cache_manager.pool.cached) for e in engines.values())
    finally:
        h.close()
        for engine in engines.values():
            engine.close()


def test_an_engine_restarted_behind_the_address_is_read_again_even_past_the_old_sequence(zctx, harness):
    """The new engine published more batches than the old one before the EPP reconnected: the sequence does
    not go back, but the reconnection drops the old blocks and the history is read from the new replay buffer."""
    pub = Publisher(zctx)
    harness.subscribe(A, pub)
    pub.send(0, batch([stored([1], None, TOKENS[:4], BS)]))
    pub.send(1, batch([stored([2], 1, TOKENS[4:8], BS)]))
    harness.pump(lambda: harness.applied(A, 1))
    port, replay_port = pub.port, pub.replay_port
    pub.close()
    harness.publishers.remove(pub)
    harness.pump(lambda: harness.scorer.subscriber._streams[A].disconnected)
    new = Publisher.__new__(Publisher)  # the restarted engine: same ports, numbering from 0
    new.topic, new.port, new.replay_port, new.buffer, new.replay_requests = b"kv", port, replay_port, {}, []
    new.pub = zctx.socket(zmq.XPUB)
    new.pub.setsockopt(zmq.LINGER, 0)
    new.pub.bind(f"tcp://127.0.0.1:{port}")
    new.router = zctx.socket(zmq.ROUTER)
    new.router.setsockopt(zmq.LINGER, 0)
    new.router.bind(f"tcp://127.0.0.1:{replay_port}")
    harness.publishers.append(new)
    for seq in range(3):
        new.send(seq, batch([stored([50 + seq], None, [seq] * 4, BS)]), publish=False)
    new.wait_subscribed(timeout=10)
    new.send(3, batch([stored([60], None, [9] * 4, BS)]))
    harness.pump(lambda: harness.applied(A, 3), timeout=10)
    assert harness.index.blocks_of(A) == blocks([0] * 4) | blocks([1] * 4) | blocks([2] * 4) | blocks([9] * 4)
    assert harness.scorer.subscriber.stats["reconnects"] == 1 and new.replay_requests == [0]
