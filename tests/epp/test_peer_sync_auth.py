"""Peer sync under the pool's CURVE key (epp/peer_sync_keys.py), on real ZeroMQ sockets on the loopback: a subscriber
or publisher without the key reads nothing and feeds nothing (no pick applied, no peer slot taken); two keyed
replicas sync; the key file and the flags are checked before anything listens (one line, exit 2)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time

import msgspec
import pytest
import zmq

from kvgate.cli import main as kvgate_main
from kvgate.epp.peer_sync import MAX_PEERS, Beat, Pick, PeerSync
from kvgate.epp.peer_sync_keys import PeerSyncKeyError, load_pool_key, write_pool_key
from kvgate.common.processes import free_port
from tests.epp.helpers import request
from tests.epp.test_peer_sync import ADDRESSES, replica, tenant
from tests.gateway import EPP
from tests.procs import KVGATE

WAIT_S = 10.0  # every wait for something that must happen; what must not happen is watched for QUIET_S
QUIET_S = 1.0


def bind_address() -> str:
    return f"tcp://127.0.0.1:{free_port()}"


async def until(check, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.02)


def drain(sock: zmq.Socket) -> int:
    """Messages waiting on a subscriber, taken without blocking."""
    n = 0
    while True:
        try:
            sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return n
        n += 1


@pytest.fixture
def pool_key(tmp_path):
    return write_pool_key(tmp_path / "pool.key_secret")


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def test_only_a_subscriber_with_the_pool_key_reads_a_replicas_picks(pool_key, context):
    """While a keyed replica publishes picks (their block hashes confirm a guessed prompt): a subscriber holding the
    pool's key receives them; a plain SUB, a SUB with a keypair of its own, and one that claims the pool's public
    key without its secret receive nothing; the replica counts their failed handshakes."""
    stranger_public, stranger_secret = zmq.curve_keypair()

    def subscriber(public=None, secret=None) -> zmq.Socket:
        sock = context.socket(zmq.SUB)
        sock.linger = 0
        if public is not None:
            sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = public, secret, pool_key.public
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        return sock

    async def main():
        a = replica()
        a.peers = PeerSync(a, bind_address(), [], key=pool_key, heartbeat_s=0.05)
        a.peers.start()
        keyed = subscriber(pool_key.public, pool_key.secret)
        strangers = {"plain": subscriber(), "own keypair": subscriber(stranger_public, stranger_secret),
                     "pool's public key, wrong secret": subscriber(pool_key.public, stranger_secret)}
        try:
            for sock in (keyed, *strangers.values()):
                sock.connect(a.peers.bind)
            got = {name: 0 for name in strangers}
            picks = 0

            def keyed_reads_picks() -> bool:
                nonlocal picks
                a.pick(request(tenant(picks, 0), request_id=f"r{picks}"))
                picks += 1
                for name, sock in strangers.items():
                    got[name] += drain(sock)
                while True:  # the keyed subscriber decodes what it reads: the replica's picks, in clear to it
                    try:
                        message = a.peers._decoder.decode(keyed.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        return False
                    if isinstance(message, Pick) and message.shared.get("precise-prefix-cache-scorer"):
                        return True

            await until(keyed_reads_picks, "the keyed subscriber to read a pick with its block hashes")
            quiet_until = time.monotonic() + QUIET_S
            while time.monotonic() < quiet_until:
                a.pick(request(tenant(picks, 0), request_id=f"r{picks}"))
                picks += 1
                for name, sock in strangers.items():
                    got[name] += drain(sock)
                await asyncio.sleep(0.02)
            assert got == {name: 0 for name in strangers}, got
            assert a.peers.stats()["handshakes_failed"] >= len(strangers)
        finally:
            for sock in (keyed, *strangers.values()):
                sock.close(linger=0)
            a.peers.close()

    asyncio.run(main())


def rogue_publisher(context: zmq.Context, address: str, public: bytes | None = None) -> zmq.Socket:
    """A process at a peer's address without the pool's secret key: a plain PUB, or a CURVE server with a secret
    of its own under `public` (its own public key, or the pool's: all a stranger can know of the pool's key)."""
    sock = context.socket(zmq.PUB)
    sock.linger = 0
    if public is not None:
        sock.curve_secretkey = zmq.curve_keypair()[1]
        sock.curve_publickey = public
        sock.curve_server = True
    sock.bind(address)
    return sock


def flood(rogues: list[zmq.Socket], round_: int) -> None:
    """Each rogue's beats from fresh origins (each would take a peer slot) and picks of the pool's endpoints."""
    encoder = msgspec.msgpack.Encoder()
    for r, sock in enumerate(rogues):
        for k in range(MAX_PEERS // 4):
            origin = f"rogue{r}-{round_}-{k}"
            sock.send(encoder.encode(Beat(origin)), zmq.NOBLOCK)
            sock.send(encoder.encode(Pick(origin, 1, ADDRESSES[0], 1000, 1000, {})), zmq.NOBLOCK)


def test_a_publisher_without_the_pool_key_is_refused(pool_key, context):
    """A keyed replica subscribed to a keyed peer and to three rogue publishers at other --peer-sync-peer addresses
    (plain, own keypair, the pool's public key with a wrong secret), each flooding beats and picks from fresh
    origins: the replica applies its peer's pick and nothing of the rogues' — one peer, no peer slot full, no flight
    but the peer's."""
    async def main():
        a, b = replica(), replica()
        binds = [bind_address(), bind_address()]
        rogue_addresses = [bind_address() for _ in range(3)]
        rogues = [rogue_publisher(context, address, public) for address, public in
                  zip(rogue_addresses, (None, zmq.curve_keypair()[0], pool_key.public))]
        a.peers = PeerSync(a, binds[0], [binds[1], *rogue_addresses], key=pool_key, heartbeat_s=0.05)
        b.peers = PeerSync(b, binds[1], [binds[0]], key=pool_key, heartbeat_s=0.05)
        a.peers.start()
        b.peers.start()
        try:
            rounds = 0

            def peer_heard() -> bool:
                nonlocal rounds
                flood(rogues, rounds)
                rounds += 1
                return a.peers.stats()["peers"] >= 1

            await until(peer_heard, "a to hear b")
            address = b.pick(request(tenant(1, 0), request_id="z"))[0].address
            await until(lambda: a.load.counts().get(address) is not None, "b's pick to reach a")
            quiet_until = time.monotonic() + QUIET_S
            while time.monotonic() < quiet_until:
                flood(rogues, rounds)
                rounds += 1
                await asyncio.sleep(0.02)
            stats = a.peers.stats()
            assert stats["peers"] == 1 and stats["too_many_peers"] == 0, stats
            assert stats["picks_applied"] == 1 and stats["peer_flights"] == 1 and stats["bad_messages"] == 0, stats
            assert a.load.counts() == {address: a.load.counts()[address]}  # b's flight alone
            assert stats["handshakes_failed"] >= len(rogues) and b.peers.stats()["handshakes_failed"] == 0
        finally:
            for sock in rogues:
                sock.close(linger=0)
            a.peers.close()
            b.peers.close()

    asyncio.run(main())


def test_without_a_key_a_rogue_publisher_fills_the_peer_slots(context):
    """The same flood against replicas synced with --peer-sync-insecure: the plain rogue's origins take every peer
    slot and its picks are applied (what the pool key prevents, and what the insecure flag accepts)."""
    async def main():
        a = replica()
        rogue_address = bind_address()
        rogue = rogue_publisher(context, rogue_address)
        a.peers = PeerSync(a, bind_address(), [rogue_address], key=None, heartbeat_s=0.05)
        a.peers.start()
        try:
            rounds = 0

            def slots_full() -> bool:
                nonlocal rounds
                flood([rogue], rounds)
                rounds += 1
                return a.peers.stats()["too_many_peers"] > 0

            await until(slots_full, "the rogue to fill the peer slots")
            assert a.peers.stats()["peers"] == MAX_PEERS and a.peers.stats()["picks_applied"] > 0
        finally:
            rogue.close(linger=0)
            a.peers.close()

    asyncio.run(main())


def test_replicas_with_different_keys_do_not_sync(tmp_path, pool_key, caplog):
    """A replica given another pool's key file neither hears nor is heard, and both count and log the failed
    handshakes: a misconfiguration shows as no peers and a warning, not as a split view that looks synced."""
    other = write_pool_key(tmp_path / "other.key_secret")

    async def main():
        a, b = replica(), replica()
        binds = [bind_address(), bind_address()]
        a.peers = PeerSync(a, binds[0], [binds[1]], key=pool_key, heartbeat_s=0.05)
        b.peers = PeerSync(b, binds[1], [binds[0]], key=other, heartbeat_s=0.05)
        a.peers.start()
        b.peers.start()
        try:
            await until(lambda: a.peers.stats()["handshakes_failed"] and b.peers.stats()["handshakes_failed"],
                        "each to see the other's handshakes fail")
            a.pick(request(tenant(1, 0), request_id="z"))
            await asyncio.sleep(QUIET_S)
            assert a.peers.stats()["peers"] == b.peers.stats()["peers"] == 0 and b.load.counts() == {}
            warnings = [r.getMessage() for r in caplog.records if "handshake with a" in r.getMessage()]
            # once per socket endpoint, however many times the peers retried: each replica's bind and its peer
            assert 2 <= len(warnings) <= 4 and len(set(warnings)) == len(warnings), warnings
            assert any(f"publisher at {binds[1]}" in w for w in warnings), warnings
        finally:
            a.peers.close()
            b.peers.close()

    asyncio.run(main())


# --- the key file and the flags --------------------------------------------------------------------------------

def test_keygen_writes_a_private_certificate_and_never_replaces_one(tmp_path, capsys):
    path = tmp_path / "pool.key_secret"
    assert kvgate_main(["peer-sync-keygen", str(path)]) == 0
    key = load_pool_key(path)
    assert (os.stat(path).st_mode & 0o777) == 0o600 and zmq.curve_public(key.secret) == key.public
    assert key.public.decode() in capsys.readouterr().out and key.secret.decode() not in repr(key)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pool.key_secret"]  # no public file or scratch left
    before = path.read_bytes()
    assert kvgate_main(["peer-sync-keygen", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "exists" in err and path.read_bytes() == before


def bad_key_files(tmp_path, pool_key) -> dict[str, tuple[str, str]]:
    """name → (path, what its one-line error says)."""
    public_file, _ = zmq.auth.create_certificates(tmp_path, "made")
    garbage = tmp_path / "garbage"
    garbage.write_bytes(b"\x00\xffnot a certificate\n")
    mismatched = tmp_path / "mismatched.key_secret"
    mismatched.write_text(f'curve\n    public-key = "{zmq.curve_keypair()[0].decode()}"\n'
                          f'    secret-key = "{pool_key.secret.decode()}"\n')
    short = tmp_path / "short.key_secret"
    short.write_text(f'curve\n    public-key = "{pool_key.public.decode()}"\n    secret-key = "abc"\n')
    big = tmp_path / "big"
    big.write_bytes(b"#" * (65 * 1024))
    return {"missing": (str(tmp_path / "none"), "No such file"), "a directory": (str(tmp_path), "not a regular"),
            "public only": (public_file, "no secret-key"), "garbage": (str(garbage), "no public-key"),
            "mismatched": (str(mismatched), "not the secret-key's"), "short secret": (str(short), "40-character"),
            "too big": (str(big), "at most")}


def test_bad_key_files_are_one_line_errors(tmp_path, pool_key, capsys):
    bind = bind_address()
    for name, (path, says) in bad_key_files(tmp_path, pool_key).items():
        with pytest.raises(PeerSyncKeyError, match=says):
            load_pool_key(path)
        code = kvgate_main(["epp", "--endpoints", "127.0.0.1:1", "--peer-sync-bind", bind,
                            "--peer-sync-key-file", path])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and err.startswith("kvgate epp: error: --peer-sync-key-file"), \
            (name, err)


@pytest.mark.parametrize("flags, says", [
    ([], "--peer-sync-bind needs --peer-sync-key-file PATH"),
    (["--peer-sync-insecure", "--peer-sync-key-file", "k"], "not both"),
])
def test_peer_sync_flags_need_a_key_or_the_insecure_flag(flags, says, capsys):
    code = kvgate_main(["epp", "--endpoints", "127.0.0.1:1", "--peer-sync-bind", bind_address(), *flags])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and says in err, err


@pytest.mark.parametrize("flag", [["--peer-sync-insecure"], ["--peer-sync-key-file", "k"]])
def test_key_flags_need_peer_sync(flag, capsys):
    assert kvgate_main(["epp", "--endpoints", "127.0.0.1:1", *flag]) == 2
    assert "needs --peer-sync-bind" in capsys.readouterr().err


@pytest.mark.processes
def test_a_keyless_epp_process_exits_2_with_one_line():
    r = subprocess.run([KVGATE, "epp", "--endpoints", "127.0.0.1:1", "--peer-sync-bind", bind_address()],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--peer-sync-key-file" in r.stderr, r.stderr


def peer_count(epp: EPP) -> float:
    for line in epp.metrics().splitlines():
        if line.startswith("kvgate_epp_peer_sync_peers "):
            return float(line.split()[1])
    return -1.0


@pytest.mark.processes
def test_keyed_epp_processes_sync_and_an_insecure_one_is_left_out(tmp_path, pool_key):
    """Real `kvgate epp` processes: two given the pool's key file hear each other; a third started with
    --peer-sync-insecure and subscribed to the first hears nothing from it and says once that it runs keyless."""
    binds = [bind_address() for _ in range(3)]
    key_file = str(tmp_path / "pool.key_secret")
    flags = [["--peer-sync-bind", binds[0], "--peer-sync-peer", binds[1], "--peer-sync-key-file", key_file],
             ["--peer-sync-bind", binds[1], "--peer-sync-peer", binds[0], "--peer-sync-key-file", key_file],
             ["--peer-sync-bind", binds[2], "--peer-sync-peer", binds[0], "--peer-sync-insecure"]]
    epps = []
    try:
        for i, extra in enumerate(flags):
            logdir = tmp_path / f"epp{i}"
            logdir.mkdir()
            epps.append(EPP(logdir, endpoints=ADDRESSES, extra=extra, wait_ready=False))
        deadline = time.monotonic() + 20
        while not (peer_count(epps[0]) == peer_count(epps[1]) == 1):
            assert time.monotonic() < deadline and all(e.alive() for e in epps), [e.log() for e in epps]
            time.sleep(0.1)
        time.sleep(QUIET_S)
        assert peer_count(epps[2]) == 0 and peer_count(epps[0]) == 1
        assert epps[2].log().count("peer sync without a key (--peer-sync-insecure)") == 1, epps[2].log()
        assert "without a key" not in epps[0].log() and "handshake with a subscriber of" in epps[0].log()
    finally:
        for e in epps:
            e.stop()
