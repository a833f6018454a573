"""KV-cache events: vLLM's `--kv-events-config` and its wire format, so vLLM's consumers (llm-d, Dynamo) read ours.

The block pool records what enters and leaves its prefix-cache table (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared` below); once per engine step the engine hands the step's records to a publisher
(kv_event_publisher.py) as one batch. Records hold the pool's own 128-bit hashes; turning them into the wire's
maps happens on the publisher's thread (`encode_batch`), off the engine's step.

The format follows vLLM's `vllm/distributed/kv_events.py`, `vllm/config/kv_events.py` and the emission sites in
`vllm/v1/core/block_pool.py`, read at vLLM commits 0181ea3173e53eea8cf04a86891488e3dc89bb34 (kv_events.py) and
00634b8acf93e413a1c380288665a543b98be7ea (config), 2026; written from that reading, not copied. Since 2026 vLLM
encodes each event as a msgpack *map* tagged by `type` (msgspec `tag=True`, `omit_defaults=True`), no longer as
a positional array; the batch is a map too:

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
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, fields

from kvgate.engine.errors import ConfigError

MEDIUM_GPU = "GPU"  # vLLM's name for the accelerator's KV cache (the sim's and the CPU's too: one tier)
KV_CACHE_SPEC_KIND = "full_attention"  # every kvgate model has one KV group of full attention

_U64 = (1 << 64) - 1


# -- the flag -----------------------------------------------------------------------------------------------------


@dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig: the same keys, defaults and meaning."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when enabled
    # PUB socket. vLLM's rule: an endpoint with `*`, `::`, ipc:// or inproc:// is bound (tcp://*:5557 listens on
    # every interface); any other (tcp://collector:5557) is connected to, for a collector that binds.
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None  # ROUTER socket, always bound: missed batches by sequence number
    buffer_steps: int = 10_000  # batches (one per engine step with events) kept for replay
    hwm: int = 100_000  # ZeroMQ high-water mark of the PUB socket: past it, slow subscribers miss messages
    max_queue_size: int = 100_000  # batches waiting for the publisher thread; past it batches are dropped
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ConfigError(f"--kv-events-config: publisher must be \"zmq\" or \"null\", got {self.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"--kv-events-config: {name} must be a positive integer, got {value!r}")
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
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
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
