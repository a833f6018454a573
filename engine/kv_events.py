"""KV-cache events: vLLM's `--kv-events-config` and its wire format, so vLLM's consumers (llm-d, Dynamo) read ours.

The block pool records what enters and leaves its prefix-cache table (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared` below); once per engine step the engine hands the step's records to a publisher
(kv_event_publisher.py) as one batch. Records hold the pool's own 128-bit hashes; turning them into the wire's
maps happens on the publisher's thread (`encode_batch`), off the engine's step.

The format follows vLLM's `vllm/distributed/kv_events.py`, `vllm/config/kv_events.py` and the emission sites in
`vllm/v1/core/block_pool.py`, read at vLLM commits 0181ea3173e53eea8cf04a86891488e3dc89bb34 (kv_events.py) and
00634b8acf93e413a1c380288665a543b98be7ea (config); written from that reading, not copied. At those commits vLLM
encodes each event as a msgpack *map* tagged by `type` (msgspec `tag=True`, `omit_defaults=True`), not as a
positional array (older vLLM versions); the batch is a map too:

    {"ts": float (unix seconds), "events": [event, ...], "data_parallel_rank": int}
    {"type": "BlockStored", "block_hashes": [uint64...], "parent_block_hash": uint64 | nil,
     "token_ids": [int...], "block_size": int, "lora_id": nil, "medium": "GPU", "lora_name": nil,
     "extra_keys": [[cache_salt] | nil per block], "group_idx": 0, "kv_cache_spec_kind": "full_attention"}
    {"type": "BlockRemoved", "block_hashes": [uint64...], "medium": "GPU", "group_idx": 0}
    {"type": "AllBlocksCleared"}

Block hashes are sent as vLLM sends them by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): the low 64 bits of
the digest read big-endian, an unsigned int. Ours are xxh3-128 digests chained over (parent, token ids), rooted
at the cache salt; a consumer that keys blocks by its own hash of `token_ids` (llm-d's precise mode) needs none of
that. `parent_block_hash` is nil for a request's first block, as in vLLM. Fields that vLLM omits at their
defaults (`kv_cache_spec_sliding_window`) are omitted.

Unlike vLLM (which announces every full block, duplicates included, and removes per block), the pool announces
a hash when it enters the prefix-cache table and removes it when it leaves, so replaying the stream yields
exactly the table's keys.

What travels is vLLM's schema and nothing more. It holds tenant data: `token_ids` (every cached prompt) and the
first block's `extra_keys` = [cache_salt]. Both stay: the EPP hashes token ids as it hashes incoming prompts,
and keys the chain's root by the salt (epp/prefix/hashing.py root_hash), so salted tenants never share a
prefix in its index either; vLLM sends the salt there for the same reason. Who may read the stream is the
NetworkPolicy's job (operator/network_policy.py; README, Security). A step's batch is cut to at most
`max_batch_bytes` encoded (`split_batch`: runs of blocks and of removals cut apart, each part chained to the
one before), so the publisher can bound its queues in bytes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

from kvgate.common import bounded_json
from kvgate.common.errors import ConfigError

MEDIUM_GPU = "GPU"  # vLLM's name for the accelerator's KV cache (the sim's and the CPU's too: one tier)
KV_CACHE_SPEC_KIND = "full_attention"  # every kvgate model has one KV group of full attention

_U64 = (1 << 64) - 1
REPLAY_BURST_S = 5.0  # a replay rate limit lets this many seconds' worth of requests through at once


# -- the flag -----------------------------------------------------------------------------------------------------


@dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig: the same keys, defaults and meaning; then kvgate's limits (keys vLLM does not have),
    which bound what a slow or hostile peer of the sockets can cost (kv_event_publisher.py says how)."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when enabled
    # PUB socket. vLLM's rule: an endpoint with `*`, `::`, ipc:// or inproc:// is bound (tcp://*:5557 listens on
    # every interface); any other (tcp://collector:5557) is connected to, for a collector that binds.
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # ROUTER socket, always bound: missed batches by sequence number
    buffer_steps: int = 10_000  # batches (one per engine step with events) kept for replay
    hwm: int = 100_000  # ZeroMQ high-water mark of the PUB socket (capped by max_subscriber_bytes, below)
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; past it batches are dropped
    topic: str = ""
    # -- kvgate's limits --
    max_batch_bytes: int = 16 * 1024  # one message's payload at most; a bigger step is split into several batches
    max_subscriber_bytes: int = 16 * 1024 * 1024  # queued per subscriber that does not read: the HWM is cut to fit
    max_buffer_bytes: int = 64 * 1024 * 1024  # the replay buffer's bytes, besides its buffer_steps batches
    max_replay_batches: int = 1000  # one replay answer at most (the oldest from the start asked for) ...
    max_replay_bytes: int = 8 * 1024 * 1024  # ... and at most this many payload bytes
    replay_requests_per_s: float = 2.0  # per peer (a ROUTER identity), bursts of 5 s worth
    replay_requests_per_s_total: float = 10.0  # all peers together, bursts of 5 s worth

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ConfigError(f"--kv-events-config: publisher must be \"zmq\" or \"null\", got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size", "max_batch_bytes", "max_subscriber_bytes",
                     "max_buffer_bytes", "max_replay_batches", "max_replay_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--kv-events-config: {name} must be a positive integer, got {value!r}")
        if self.max_batch_bytes < MIN_BATCH_BYTES:
            raise ConfigError(f"--kv-events-config: max_batch_bytes must be at least {MIN_BATCH_BYTES}, "
                              f"got {self.max_batch_bytes}")
        for name in ("max_subscriber_bytes", "max_buffer_bytes", "max_replay_bytes"):
            if getattr(self, name) < self.max_batch_bytes:
                raise ConfigError(f"--kv-events-config: {name} must be at least max_batch_bytes "
                                  f"({self.max_batch_bytes}), got {getattr(self, name)}")
        for name in ("replay_requests_per_s", "replay_requests_per_s_total"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
                raise ConfigError(f"--kv-events-config: {name} must be a positive number, got {value!r}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"--kv-events-config: {name} must be a ZeroMQ address such as tcp://*:5557, "
                                  f"got {value!r}")
        if not isinstance(self.topic, str):
            raise ConfigError(f"--kv-events-config: topic must be a string, got {self.topic!r}")
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ConfigError("--kv-events-config: enable_kv_cache_events must be true or false, "
                              f"got {self.enable_kv_cache_events!r}")

    @property
    def subscriber_hwm(self) -> int:
        """The PUB socket's SNDHWM: `hwm`, cut so that a subscriber's queue of whole messages stays within
        `max_subscriber_bytes` (ZeroMQ counts messages, not bytes; each is at most max_batch_bytes + topic + seq)."""
        largest = self.max_batch_bytes + len(self.topic.encode()) + 8
        return max(1, min(self.hwm, self.max_subscriber_bytes // largest))

    @property
    def replay_burst_per_peer(self) -> int:
        return max(1, int(REPLAY_BURST_S * self.replay_requests_per_s))

    @property
    def replay_burst_total(self) -> int:
        return max(1, int(REPLAY_BURST_S * self.replay_requests_per_s_total))

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        try:
            data = bounded_json.loads(text, bounded_json.FLAG_BYTES)
        except bounded_json.JSONLimitError as exc:
            raise ConfigError(f"--kv-events-config: {exc}") from None
        except ValueError as exc:
            raise ConfigError(f"--kv-events-config is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ConfigError("--kv-events-config must be a JSON object, e.g. "
                              '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}')
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ConfigError(f"--kv-events-config: unknown key(s) {', '.join(unknown)}; known: {', '.join(known)}")
        return cls(**data)


# -- what the block pool records ----------------------------------------------------------------------------------


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[bytes]  # consecutive blocks of one request, in order
    parent_block_hash: bytes | None  # the block before the first one; None for a request's first block
    token_ids: list[int]  # block_size tokens per block
    block_size: int
    cache_salt: str | None = None  # hashed into the first block (vLLM's extra key of block 0)
    first_block_index: int = 0
    lora_id: int | None = None  # the adapter the blocks were computed with (None: the base model)
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[bytes]


@dataclass(slots=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    events: list[KVCacheEvent]
    ts: float = field(default_factory=time.time)


# -- the wire -----------------------------------------------------------------------------------------------------


def external_block_hash(digest: bytes) -> int:
    """vLLM's default wire form of a hash: its low 64 bits, the digest read big-endian."""
    return int.from_bytes(digest, "big") & _U64


def event_to_wire(event: KVCacheEvent) -> dict:
    if isinstance(event, BlockStored):
        hashes = [external_block_hash(h) for h in event.block_hashes]
        salt = event.cache_salt
        extra_keys = [[salt] if salt is not None and event.first_block_index + i == 0 else None
                      for i in range(len(hashes))]
        return {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None if event.parent_block_hash is None
            else external_block_hash(event.parent_block_hash),
            "token_ids": event.token_ids,
            "block_size": event.block_size,
            "lora_id": event.lora_id,
            "medium": MEDIUM_GPU,
            "lora_name": event.lora_name,
            "extra_keys": extra_keys,
            "group_idx": 0,
            "kv_cache_spec_kind": KV_CACHE_SPEC_KIND,
        }
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": [external_block_hash(h) for h in event.block_hashes],
                "medium": MEDIUM_GPU, "group_idx": 0}
    return {"type": "AllBlocksCleared"}


def encode_batch(batch: KVEventBatch, data_parallel_rank: int = 0) -> bytes:
    import msgpack

    return msgpack.packb({"ts": batch.ts, "events": [event_to_wire(e) for e in batch.events],
                          "data_parallel_rank": data_parallel_rank}, use_bin_type=True)


# -- sizes: every message within max_batch_bytes ------------------------------------------------------------------
#
# Upper bounds of the msgpack size of what event_to_wire / encode_batch make: an int takes at most 9 bytes (a
# uint64 hash), a token id at most 5 (ids are below 2**32), a string its UTF-8 length + 5; the fixed keys and
# values of each map are counted generously below (test_kv_events_limits checks the bound on random events).
_BATCH_FIXED = 64  # {ts, events: [...], data_parallel_rank}
_STORED_FIXED = 220  # a BlockStored's keys and fixed-size values
_REMOVED_FIXED = 64
_CLEARED_FIXED = 24
_PER_HASH = 9
_PER_TOKEN = 5
_SALT_ENTRY = 6  # [salt] in extra_keys: array and string headers (nil, 1 byte, for every other block)
MIN_BATCH_BYTES = 1024  # room for any event's fixed part and a few blocks


def _stored_fixed(event: BlockStored, with_salt: bool) -> int:
    size = _STORED_FIXED + 5 + len((event.lora_name or "").encode())
    if with_salt and event.cache_salt is not None:
        size += _SALT_ENTRY + len(event.cache_salt.encode())
    return size


def event_size_bound(event: KVCacheEvent) -> int:
    if isinstance(event, BlockStored):
        blocks = len(event.block_hashes)
        return (_stored_fixed(event, event.first_block_index == 0) + blocks * (_PER_HASH + 1)
                + len(event.token_ids) * _PER_TOKEN)
    if isinstance(event, BlockRemoved):
        return _REMOVED_FIXED + len(event.block_hashes) * _PER_HASH
    return _CLEARED_FIXED


def batch_size_bound(batch: KVEventBatch) -> int:
    return _BATCH_FIXED + sum(event_size_bound(e) for e in batch.events)


def _pieces(event: KVCacheEvent, room: int) -> tuple[list[tuple[KVCacheEvent, int]], int]:
    """`event` cut into pieces of at most `room` bytes each (runs of blocks, runs of hashes): (piece, size bound)
    pairs, and how many blocks could not be cut small enough (a salt or adapter name near `room` alone)."""
    size = event_size_bound(event)
    if size <= room:
        return [(event, size)], 0
    out, skipped = [], 0
    if isinstance(event, BlockStored):
        per_block = _PER_HASH + 1 + event.block_size * _PER_TOKEN
        i, n = 0, len(event.block_hashes)
        while i < n:
            fixed = _stored_fixed(event, event.first_block_index + i == 0)
            k = min(n - i, (room - fixed) // per_block)
            if k < 1:  # this block's event would not fit in any message: left out (the index misses it)
                skipped, i = skipped + 1, i + 1
                continue
            bs = event.block_size
            piece = BlockStored(block_hashes=event.block_hashes[i:i + k],
                                parent_block_hash=event.block_hashes[i - 1] if i else event.parent_block_hash,
                                token_ids=event.token_ids[i * bs:(i + k) * bs], block_size=bs,
                                cache_salt=event.cache_salt, first_block_index=event.first_block_index + i,
                                lora_id=event.lora_id, lora_name=event.lora_name)
            out.append((piece, fixed + k * per_block))
            i += k
    elif isinstance(event, BlockRemoved):
        k = (room - _REMOVED_FIXED) // _PER_HASH
        for i in range(0, len(event.block_hashes), k):
            piece = BlockRemoved(event.block_hashes[i:i + k])
            out.append((piece, event_size_bound(piece)))
    return out, skipped


def split_batch(batch: KVEventBatch, max_bytes: int) -> tuple[list[KVEventBatch], int]:
    """`batch` as batches of at most `max_bytes` encoded, in order (a run of blocks cut in two keeps its chain:
    the second part's parent is the first part's last block); and the number of blocks left out because a single
    block's event is bigger than that. Usually the batch itself, uncut."""
    if batch_size_bound(batch) <= max_bytes:
        return [batch], 0
    out, current, size, skipped = [], [], _BATCH_FIXED, 0
    for event in batch.events:
        pieces, left_out = _pieces(event, max_bytes - _BATCH_FIXED)
        skipped += left_out
        for piece, piece_size in pieces:
            if current and size + piece_size > max_bytes:
                out.append(KVEventBatch(current, batch.ts))
                current, size = [], _BATCH_FIXED
            current.append(piece)
            size += piece_size
    if current:
        out.append(KVEventBatch(current, batch.ts))
    return out, skipped
