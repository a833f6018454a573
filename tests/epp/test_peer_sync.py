"""Active-active peer sync (epp/peer_sync.py): a peer's picks laid on a replica's state make both decide alike;
the ZeroMQ path between two replicas on the loopback; hostile or lost messages bounded."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from kvgate.epp.admission import Admission
from kvgate.epp.datalayer import Datalayer
from kvgate.epp.datastore import Datastore
from kvgate.epp.director import Director
from kvgate.epp.peer_sync import Beat, Done, Pick, PeerSync
from kvgate.epp.peer_sync_keys import write_pool_key
from kvgate.epp.scheduling.config import DEFAULT_CONFIG_YAML, KVGATE_PROFILE_YAML, parse_config
from kvgate.epp.scheduling.framework import Scheduler
from kvgate.epp.types import Endpoint, EndpointMetrics
from kvgate.common.processes import free_port
from tests.epp.helpers import request

ADDRESSES = [f"10.0.0.{i}:8000" for i in range(1, 5)]


def replica(config_yaml: str = KVGATE_PROFILE_YAML) -> Director:
    """A director with kvgate's profile (or the config given) over four scraped, idle endpoints (no engine events:
    the precise prefix index holds only picks' held blocks)."""
    endpoints = [Endpoint(a) for a in ADDRESSES]
    layer = Datalayer()
    layer.set_endpoints(endpoints)
    for a in ADDRESSES:
        c = layer._collectors[a]
        c.metrics = EndpointMetrics(updated_at=time.monotonic(), kv_block_size=16)
        c.scrapes += 1
    return Director(Datastore(endpoints=endpoints, synced=True), layer,
                    Scheduler(parse_config(config_yaml).scheduler), Admission(), seed=1)


def tenant(t: int, user: int) -> str:
    return f"tenant {t} system prompt " * 40 + f"user {user} asks something"


class Wire:
    """Two replicas' PeerSyncs joined by hand: each message encoded, decoded and applied to the other (what the
    sockets do), or dropped while `cut`."""

    def __init__(self, a: Director, b: Director) -> None:
        self.syncs = [PeerSync(a, "tcp://127.0.0.1:1", [], key=None, identity="a"),
                      PeerSync(b, "tcp://127.0.0.1:2", [], key=None, identity="b")]
        a.peers, b.peers = self.syncs
        self.cut = False
        for sync, other in ((self.syncs[0], self.syncs[1]), (self.syncs[1], self.syncs[0])):
            sync._send = self._sender(other)

    def _sender(self, other: PeerSync):
        encoder, decoder = msgspec.msgpack.Encoder(), other._decoder

        def send(message):
            if not self.cut:
                other.apply(decoder.decode(encoder.encode(message)))
        return send


def test_two_replicas_with_sync_place_new_tenants_as_one_would():
    """Eight tenants' first requests alternate between two replicas: with their picks shared, the second request
    of each tenant goes where the first went whichever replica routes it, and the tenants spread over the pool
    (2 per endpoint) as one replica alone spreads them; without, replica b knows nothing of a's placements."""
    a, b = replica(), replica()
    Wire(a, b)
    placed = {}
    for t in range(8):
        picker = (a, b)[t % 2]
        placed[t] = picker.pick(request(tenant(t, 0), request_id=f"t{t}u0"))[0].address
    for t in range(8):
        other = (b, a)[t % 2]  # the replica that did not place the tenant
        assert other.pick(request(tenant(t, 1), request_id=f"t{t}u1"))[0].address == placed[t]
    assert sorted(list(placed.values()).count(x) for x in ADDRESSES) == [2, 2, 2, 2]
    assert a.load.counts() == b.load.counts()  # every flight on both replicas

    lone_a, lone_b = replica(), replica()  # the same without sync: b places its tenants by its own history only
    lone = {t: (lone_a, lone_b)[t % 2].pick(request(tenant(t, 0), request_id=f"t{t}u0"))[0].address
            for t in range(8)}
    assert sum(lone_b.pick(request(tenant(t, 1), request_id=f"t{t}u1"))[0].address == lone[t]
               for t in range(0, 8, 2)) < 4


def test_a_peers_picks_count_in_the_interference_arrival_rate():
    """prefill-interference-scorer's arrival rate counts every replica's picks: they land on the same engines."""
    a, b = replica(), replica()
    Wire(a, b)
    picked = [a.pick(request(tenant(0, i), request_id=f"r{i}"))[0].address for i in range(5)]
    scorer = b.scheduler.plugins_of_type("prefill-interference-scorer")[0]
    assert {address: len(times) for address, times in scorer._picks.items()} == \
        {x: picked.count(x) for x in set(picked)}


def test_approximate_prefix_replicas_learn_one_history():
    """The approximate scorer's index learns from picks: with sync, replica b's index holds a's placements, so a
    tenant placed by a is found there by b (upstream's reason to warn against active-active with it)."""
    a, b = replica(DEFAULT_CONFIG_YAML), replica(DEFAULT_CONFIG_YAML)
    Wire(a, b)
    placed = [a.pick(request(tenant(t, 0), request_id=f"t{t}"))[0].address for t in range(6)]
    scorer_a, scorer_b = (d.scheduler.plugins_of_type("prefix-cache-scorer")[0] for d in (a, b))
    assert scorer_b.index.size() == scorer_a.index.size() > 0
    for t in range(6):
        assert b.pick(request(tenant(t, 1), request_id=f"t{t}b"))[0].address == placed[t]


def test_a_share_too_long_for_peers_goes_as_its_prefix():
    a, b = replica(), replica()
    wire = Wire(a, b)
    from kvgate.epp import peer_sync

    long = peer_sync.MAX_SHARED_INTS + 100
    wire.syncs[0].publish_pick(request("x"), ADDRESSES[2], 5, 5, {"precise-prefix-cache-scorer": [16] * long})
    assert wire.syncs[1].counts["picks_applied"] == 1 and b.load.counts() == {ADDRESSES[2]: (1, 5)}


def test_a_peers_flights_end_with_its_responses_or_its_silence():
    a, b = replica(), replica()
    wire = Wire(a, b)
    requests = [request(tenant(t, 0), request_id=f"r{t}") for t in range(3)]
    picks = [a.pick(r)[0].address for r in requests]
    assert sum(n for n, _ in b.load.counts().values()) == 3
    a.release(requests[0], picks[0])
    assert sum(n for n, _ in b.load.counts().values()) == 2
    assert wire.syncs[1].counts["dones_applied"] == 1
    # a goes silent (crashed, partitioned): b forgets its flights and holds after the timeout
    sync_b = wire.syncs[1]
    sync_b.clock = lambda: time.monotonic() + sync_b.peer_timeout_s + 1
    sync_b.expire()
    assert b.load.counts() == {} and sync_b.counts["peers_lost"] == 1
    precise = b.scheduler.plugins_of_type("precise-prefix-cache-scorer")[0]
    assert len(precise._held) == 0


def test_hostile_and_foreign_messages_are_dropped_and_counted():
    b = replica()
    sync = PeerSync(b, "tcp://127.0.0.1:1", [], key=None, identity="b")
    b.peers = sync
    sync.apply(Pick("x", 1, "192.168.9.9:80", 10, 10, {}))  # not in this pool
    assert sync.counts["foreign_endpoint"] == 1 and b.load.counts() == {}
    # shares of the wrong shape: ignored by the plugins, the flight still counts (its tokens are well-formed)
    sync.apply(Pick("x", 2, ADDRESSES[0], 10, 10, {"prefix-group-balance-scorer": [1, 2, 3],
                                                   "precise-prefix-cache-scorer": [7],
                                                   "no-such-plugin": [1]}))
    assert b.load.counts() == {ADDRESSES[0]: (1, 10)}
    sync.apply(Done("x", 2))
    sync.apply(Done("x", 2))  # twice, and an unknown one: nothing to undo
    sync.apply(Done("x", 99))
    assert b.load.counts() == {} and sync.counts["dones_applied"] == 1
    decoder = sync._decoder
    for data in (b"", b"\xff\x00garbage", msgspec.msgpack.encode(["pick", "x", -1, ADDRESSES[0], 1, 1, {}]),
                 msgspec.msgpack.encode(["pick", "x" * 65, 1, ADDRESSES[0], 1, 1, {}]),
                 msgspec.msgpack.encode(["pick", "x", 1, ADDRESSES[0], 1, 1, {"p": list(range(9000))}])):
        with pytest.raises(msgspec.DecodeError):
            decoder.decode(data)
    assert isinstance(decoder.decode(msgspec.msgpack.encode(Beat("x"))), Beat)
    # a flood of one peer's picks stays bounded, and so does a flood of peers
    from kvgate.epp import peer_sync

    for k in range(peer_sync.MAX_PEERS + 10):
        sync.apply(Beat(f"p{k}"))
    assert sync.stats()["peers"] == peer_sync.MAX_PEERS and sync.counts["too_many_peers"] == 11  # "x" and 63 more
    sync._peers.clear()

    for seq in range(peer_sync.MAX_FLIGHTS_PER_PEER + 50):
        sync.apply(Pick("y", seq, ADDRESSES[1], 1, 1, {}))
    assert b.load.counts()[ADDRESSES[1]][0] == peer_sync.MAX_FLIGHTS_PER_PEER
    assert sync.counts["flights_dropped"] == 50


@pytest.mark.parametrize("keyed", [True, False], ids=["pool-key", "insecure"])
def test_two_replicas_over_zeromq_on_the_loopback(tmp_path, keyed):
    """The sockets themselves, with the pool's CURVE key and without (--peer-sync-insecure): a's pick and its end
    reach b; garbage on the wire is counted, not fatal."""
    key = write_pool_key(tmp_path / "pool.key_secret") if keyed else None

    async def main():
        a, b = replica(), replica()
        ports = free_port(), free_port()
        binds = [f"tcp://127.0.0.1:{p}" for p in ports]
        a.peers = PeerSync(a, binds[0], [binds[1]], key=key, heartbeat_s=0.05)
        b.peers = PeerSync(b, binds[1], [binds[0]], key=key, heartbeat_s=0.05)
        a.peers.start()
        b.peers.start()
        try:
            async def until(check, what):
                deadline = time.monotonic() + 10
                while not check():
                    assert time.monotonic() < deadline, what
                    await asyncio.sleep(0.02)

            await until(lambda: b.peers.stats()["peers"] == 1 and a.peers.stats()["peers"] == 1, "heartbeats")
            r = request(tenant(1, 0), request_id="z")
            address = a.pick(r)[0].address
            await until(lambda: b.load.counts().get(address) is not None, "the pick to reach b")
            a.peers._pub.send(b"\xc1 not msgpack")
            a.release(r, address)
            await until(lambda: b.load.counts() == {}, "the end to reach b")
            await until(lambda: b.peers.counts["bad_messages"] == 1, "garbage counted")
            assert b.peers.published["picks_applied"] >= 0  # the metrics' copy exists once a beat ran
            assert b.peers.published["handshakes_failed"] == 0
        finally:
            a.peers.close()
            b.peers.close()

    asyncio.run(main())


def test_peer_sync_flags_take_the_kv_event_sockets_form():
    import argparse

    from kvgate.epp.main import tcp_endpoint

    for good in ("tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://epp-0.epp.ns:5557"):
        assert tcp_endpoint(good) == good
    for bad in ("127.0.0.1:5557", "tcp://:5557", "tcp://h:0", "tcp://h:70000", "tcp://*:5557", "tcp://h:x"):
        with pytest.raises(argparse.ArgumentTypeError):
            tcp_endpoint(bad)
