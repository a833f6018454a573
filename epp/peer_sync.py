"""Peer sync: active-active EPP replicas tell each other their picks, so that they decide alike.

What a replica decides on comes in two kinds. Engine truth, which every replica reads alike: the scraped metrics
and the engines' KV events (the precise prefix index). And what only the replica that picked knows until the
engines show it: the requests it has in flight (the live-load overlay, scheduling/live_load.py), the prompt blocks
a pick will compute (the precise scorer's held speculative entries) and the prefix groups it placed (the
prefix-group-balance scorer). Two replicas that do not share the second kind place a new tenant's prefix each by
its own history, on two endpoints, before either's KV events arrive, and the pool's hit rate falls; synced, two
replicas keep one replica's hit rate (`kvgate bench routing --workloads multi-tenant --rates 24 --epp-replicas 1,2
--epp-peer-sync both` compares the three; docs/epp.md).
Dynamo's router replicas share their active sequences the same way (over NATS); llm-d's router does not (its docs
warn against active-active with approximate prefix routing).

The model. Every replica binds one ZeroMQ PUB socket (`--peer-sync-bind`) and subscribes to each peer's
(`--peer-sync-peer`, repeated). Per pick it publishes a Pick: the endpoint, the request's tokens for the live
load, and what each plugin that shares picks (Plugin.share_pick) needs to replay it — the precise scorer its
prompt's block hashes, the group-balance scorer its group and footprint. A peer lays the Pick on its own state as
if it had picked it (a flight in its LoadTracker, Plugin.peer_pick) and undoes it on the Done that the response's
end publishes. Messages are msgpack (msgspec, typed and bounded); heartbeats every `heartbeat_s`.

Limits, by design:
- Consistent up to the hop: a pick reaches a peer a fraction of a millisecond later (loopback; a pod network
  more), so two replicas deciding within that window for the same new prefix can still split it; the engines'
  KV events settle it after one prefill.
- Best effort: PUB/SUB drops what a slow peer's queue (`RCVHWM`) cannot take and what is sent before a peer has
  connected; a lost Pick leaves that peer's view short of one request until the engines' metrics and events
  show it (as without sync), a lost Done holds one flight until the peer's state for the request ages out
  (`max_flight_s`) or the sender goes silent.
- A peer silent for `peer_timeout_s` (crashed, partitioned) is forgotten: its flights leave the live load, its
  holds are released. A restarted replica has a new identity.
- Trust: only the pool's replicas are peers. With the pool's key (`--peer-sync-key-file`, epp/peer_sync_keys.py)
  both sockets speak CURVE: the PUB admits only subscribers holding the key and every message is encrypted, so a
  stranger who reaches the bind port reads nothing; the SUB completes a handshake only with a publisher holding
  the key, so every message it receives, and every peer slot (`MAX_PEERS`), is a keyed replica's.
  `--peer-sync-insecure` drops both (plain ZeroMQ: anyone who reaches a socket reads or feeds it). A peer, keyed
  or not, can only add what its own picks would (bounded: peers, flights per peer, blocks per pick, the scorers'
  own caps) for endpoints of this replica's pool; anything else is dropped and counted. The socket listens where
  `--peer-sync-bind` says (the local stack: the loopback); it is off unless given.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from typing import Annotated, Union

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvgate.epp.peer_sync_keys import CurvePublisher, PoolKey, curve_subscriber

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 * 1024  # a Pick of a prompt at the precise scorer's 8192-block cap is ~75 KB
MAX_SHARED_INTS = 8194  # a plugin's share: the precise scorer's block size and up to 8192 hashes (and one spare)
MAX_PLUGINS = 16
MAX_PEERS = 64  # origins heard from within the timeout; messages from more are dropped (a replica set is small)
MAX_FLIGHTS_PER_PEER = 20_000  # far above what one EPP has in flight; the oldest go first past it
RECEIVE_HWM = 20_000  # messages queued from all peers before ZeroMQ drops (PUB/SUB never blocks a sender)
SEND_HWM = 20_000
HANDSHAKE_TIMEOUT_MS = 5000  # a connection that has not finished its (CURVE) handshake by then is dropped
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)  # the socket monitors' events, with the pool's key

Identity = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
Address = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]
Shared = Annotated[dict[Annotated[str, msgspec.Meta(max_length=128)],
                        Annotated[list[int], msgspec.Meta(max_length=MAX_SHARED_INTS)]],
                   msgspec.Meta(max_length=MAX_PLUGINS)]


class Pick(msgspec.Struct, tag="pick", array_like=True, frozen=True):
    origin: Identity
    seq: Count
    address: Address
    tokens: Count  # prompt + max_tokens: the live load's in-flight tokens
    uncached: Count  # the prompt tokens the endpoint must prefill: the live load's unseen backlog
    shared: Shared  # plugin name → what it needs to replay the pick (Plugin.share_pick)


class Done(msgspec.Struct, tag="done", array_like=True, frozen=True):
    origin: Identity
    seq: Count


class Beat(msgspec.Struct, tag="beat", array_like=True, frozen=True):
    origin: Identity


Message = Union[Pick, Done, Beat]


class PeerFlight:
    """A peer's request in this replica's LoadTracker (which tells flights apart by identity)."""

    __slots__ = ("pick_id", "address", "at")

    def __init__(self, pick_id: str, address: str, at: float) -> None:
        self.pick_id, self.address, self.at = pick_id, address, at


class _Peer:
    __slots__ = ("seen_at", "flights")

    def __init__(self, now: float) -> None:
        self.seen_at = now
        self.flights: OrderedDict[int, PeerFlight] = OrderedDict()  # seq → flight, oldest first


class PeerSync:
    """One replica's side: publishes its picks and ends, applies its peers'. Runs on the EPP's event loop (all
    its state and the director's are touched there only)."""

    def __init__(self, director, bind: str, peers: list[str], *, key: PoolKey | None,
                 identity: str | None = None, heartbeat_s: float = 0.5, peer_timeout_s: float = 3.0,
                 max_flight_s: float = 600.0, clock=time.monotonic) -> None:
        self.director = director
        self.bind, self.peers = bind, list(peers)
        self.key = key  # the pool's CURVE keypair; None: plain ZeroMQ (--peer-sync-insecure), the caller's choice
        self.identity = identity or secrets.token_hex(8)
        self.heartbeat_s, self.peer_timeout_s, self.max_flight_s = heartbeat_s, peer_timeout_s, max_flight_s
        self.clock = clock
        self._seq = 0
        self._peers: dict[str, _Peer] = {}
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)
        self._ctx: zmq.asyncio.Context | None = None
        self._pub_ctx: zmq.Context | None = None  # the PUB is a plain socket: a send never waits (nor makes a Future)
        self._pub = self._sub = None
        self._curve: CurvePublisher | None = None
        self._tasks: list[asyncio.Task] = []
        self.published: dict[str, float] = {}  # stats() as of the last heartbeat (metrics.py exports it)
        self.counts = {"picks_sent": 0, "dones_sent": 0, "picks_applied": 0, "dones_applied": 0,
                       "bad_messages": 0, "foreign_endpoint": 0, "peers_lost": 0, "flights_dropped": 0,
                       "too_many_peers": 0, "handshakes_failed": 0}
        self._monitors: list[zmq.asyncio.Socket] = []
        self._warned: set[str] = set()  # socket endpoints whose failed handshakes were logged (once each)

    # --- lifecycle ----------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind and connect (raises zmq.ZMQError on a taken or bad address), then receive and beat."""
        self._ctx, self._pub_ctx = zmq.asyncio.Context(), zmq.Context()
        self._pub = self._pub_ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, SEND_HWM)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)  # a larger message drops the connection
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        if self.key is not None:  # before bind and connect: CURVE applies to the connections made after
            self._curve = CurvePublisher(self._pub_ctx, self._pub, self.key)
            curve_subscriber(self._sub, self.key)
        else:
            log.warning("peer sync without a key (--peer-sync-insecure): anyone who reaches %s reads every pick, "
                        "and a process at a peer's address can feed this replica picks", self.bind)
        try:
            self._pub.bind(self.bind)
            for peer in self.peers:
                self._sub.connect(peer)
        except zmq.ZMQError:
            self.close()  # the authenticator's thread and the contexts too
            raise
        self._tasks = [asyncio.ensure_future(self._receive()), asyncio.ensure_future(self._beat())]
        if self.key is not None:  # failed handshakes: strangers, or a replica given another pool's key file
            self._monitors = [zmq.asyncio.Socket.from_socket(self._pub.get_monitor_socket(HANDSHAKE_FAILED)),
                              self._sub.get_monitor_socket(HANDSHAKE_FAILED)]
            self._tasks += [asyncio.ensure_future(self._watch_handshakes(m, side))
                            for m, side in zip(self._monitors, ("subscriber of", "publisher at"))]
        log.info("peer sync on: %s publishing on %s (%s), peers %s", self.identity, self.bind,
                 "CURVE, the pool's key" if self.key is not None else "no key", ", ".join(self.peers))

    def set_peers(self, peers: list[str]) -> None:
        """Follow a new peer list (peer_discovery.py: the pool's EPP pods): connect to the new addresses, disconnect
        from those gone (their state ages out with peer_timeout_s, as a silent peer's). On the event loop."""
        if self._sub is None:
            return
        wanted = list(dict.fromkeys(peers))
        for gone in [p for p in self.peers if p not in wanted]:
            try:
                self._sub.disconnect(gone)
            except zmq.ZMQError:
                pass  # never connected (a bad address, refused earlier)
        for new in [p for p in wanted if p not in self.peers]:
            try:
                self._sub.connect(new)
            except zmq.ZMQError as exc:
                log.warning("peer sync: cannot connect to %s: %s", new, exc)
                wanted.remove(new)
        if wanted != self.peers:
            log.info("peer sync: peers now %s", ", ".join(wanted) or "(none)")
        self.peers = wanted

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []
        for origin in list(self._peers):
            self._forget(origin)
        for sock in self._monitors:
            sock.close(linger=0)
        self._monitors = []
        for sock in (self._pub, self._sub):
            if sock is not None:
                sock.close(linger=0)
        if self._curve is not None:  # its ZAP socket lives on the PUB's context, which ends only once it is closed
            self._curve.stop()
        for ctx in (self._ctx, self._pub_ctx):
            if ctx is not None:
                ctx.term()
        self._pub = self._sub = self._ctx = self._pub_ctx = self._curve = None

    # --- this replica's picks -----------------------------------------------------------------------------------
    def publish_pick(self, request, address: str, tokens: int, uncached: int, shared: dict[str, list[int]]) -> None:
        self.publish_done(request)  # picked again (never today: one decision a request): end the old pick first
        self._seq += 1
        request.peer_seq = self._seq
        if len(shared) > MAX_PLUGINS or any(len(v) > MAX_SHARED_INTS for v in shared.values()):
            # what peers accept: a prefix of a chain of block hashes is still a true (shorter) hold or history
            shared = {k: v[:MAX_SHARED_INTS] for k, v in list(shared.items())[:MAX_PLUGINS]}
        self._send(Pick(self.identity, self._seq, address, max(0, tokens), max(0, uncached), shared))
        self.counts["picks_sent"] += 1

    def publish_done(self, request) -> None:
        seq = getattr(request, "peer_seq", None)
        if seq is None:
            return
        request.peer_seq = None
        self._send(Done(self.identity, seq))
        self.counts["dones_sent"] += 1

    def _send(self, message) -> None:
        if self._pub is None:
            return
        try:  # PUB drops past its HWM rather than block; NOBLOCK for the socket's other refusals
            self._pub.send(self._encoder.encode(message), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # --- peers' picks -------------------------------------------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            data = await self._sub.recv()
            try:
                self.apply(self._decoder.decode(data))
            except msgspec.DecodeError:
                self.counts["bad_messages"] += 1
            except Exception:  # a plugin's bug must not end the sync
                log.exception("peer sync: applying a peer's message failed")

    async def _watch_handshakes(self, monitor, side: str) -> None:
        """Count the CURVE handshakes that failed on one socket; log the first on each endpoint."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            self.counts["handshakes_failed"] += 1
            where = f"{side} {event['endpoint'].decode(errors='replace')}"
            if where not in self._warned:  # the bind and the peers' addresses: a few
                self._warned.add(where)
                log.warning("peer sync: a handshake with a %s failed (%s): a process without this pool's key, or "
                            "a replica given another --peer-sync-key-file; counted in "
                            "kvgate_epp_peer_sync{event=\"handshakes_failed\"}", where, event["event"].name)

    async def _beat(self) -> None:
        while True:
            self._send(Beat(self.identity))
            self.expire()
            self.published = self.stats()  # for the metrics thread, which must not walk what the loop changes
            await asyncio.sleep(self.heartbeat_s)

    def apply(self, message) -> None:
        """A decoded message from a peer (tests call this directly)."""
        if message.origin == self.identity:
            return
        now = self.clock()
        peer = self._peers.get(message.origin)
        if peer is None:
            if len(self._peers) >= MAX_PEERS:
                self.counts["too_many_peers"] += 1
                return
            peer = self._peers[message.origin] = _Peer(now)
            log.info("peer sync: peer %s joined", message.origin)
        peer.seen_at = now
        if isinstance(message, Pick):
            self._apply_pick(message, peer, now)
        elif isinstance(message, Done):
            flight = peer.flights.pop(message.seq, None)
            if flight is not None:
                self._end(flight)
                self.counts["dones_applied"] += 1

    def _apply_pick(self, pick: Pick, peer: _Peer, now: float) -> None:
        if not self.director.in_pool(pick.address):
            self.counts["foreign_endpoint"] += 1
            return
        pick_id = f"{pick.origin}:{pick.seq}"
        old = peer.flights.pop(pick.seq, None)
        if old is not None:
            self._end(old)
        flight = peer.flights[pick.seq] = PeerFlight(pick_id, pick.address, now)
        self.director.peer_picked(flight, pick.tokens, pick.uncached, pick.shared)
        self.counts["picks_applied"] += 1
        while len(peer.flights) > MAX_FLIGHTS_PER_PEER:
            self._end(peer.flights.popitem(last=False)[1])
            self.counts["flights_dropped"] += 1

    def _end(self, flight: PeerFlight) -> None:
        self.director.peer_released(flight)

    def expire(self) -> None:
        """Forget peers silent for peer_timeout_s, and flights older than max_flight_s (a lost Done)."""
        now = self.clock()
        for origin, peer in list(self._peers.items()):
            if now - peer.seen_at > self.peer_timeout_s:
                log.warning("peer sync: peer %s silent for %.1f s: its picks are forgotten", origin,
                            now - peer.seen_at)
                self._forget(origin)
                self.counts["peers_lost"] += 1
                continue
            while peer.flights and now - next(iter(peer.flights.values())).at > self.max_flight_s:
                self._end(peer.flights.popitem(last=False)[1])
                self.counts["flights_dropped"] += 1

    def _forget(self, origin: str) -> None:
        peer = self._peers.pop(origin)
        for flight in peer.flights.values():
            self._end(flight)

    def stats(self) -> dict[str, float]:
        return {**self.counts, "peers": len(self._peers),
                "peer_flights": sum(len(p.flights) for p in self._peers.values())}
