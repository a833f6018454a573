"""vLLM's KV-cache event payloads → plain records, whichever of vLLM's two encodings the engine speaks.

A payload is one msgpack event batch. vLLM encodes it with msgspec:
  - older vLLM (`array_like=True`): the batch is [ts, events, data_parallel_rank] and an event is a positional
    array whose first element is its tag: ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
    lora_id, medium, lora_name?...], ["BlockRemoved", block_hashes, medium?], ["AllBlocksCleared"];
  - newer vLLM (`tag=True`, maps): {"ts", "events", "data_parallel_rank"} and each event a map with "type"
    (engine/kv_events.py documents the fields kvgate's engine sends).
Hashes are ints (vLLM's default) or bytes; both are used as they come, as dict keys. Unknown event types and
unknown fields are skipped (a newer engine may add some).

The payload comes off the network, so every field of every event is checked against vLLM's types
(vllm/distributed/kv_events.py) before anything is returned; one field out of bounds makes the whole batch a
BadPayload (the subscriber then drops the endpoint's blocks: never half a batch applied). The bounds:
  - a block hash (block_hashes, parent_block_hash): an int in [-2^63, 2^64) — vLLM's default sends the digest's
    low 64 bits, unsigned; other engines a signed int64 — or 1..`MAX_HASH_BYTES` bytes (vLLM with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 sends the whole digest, 32 bytes of sha256); never a bool or a float;
  - a token id: an int in [0, `MAX_TOKEN_ID`] = [0, 2^32) — vLLM's are int32 (no vocabulary comes near 2^31);
    the bound is what one C-level conversion to array("I") checks (a msgpack boolean reads as 0/1, as Python's
    bool is an int; harmless: any id could be sent);
  - block_size: an int in [1, `MAX_BLOCK_SIZE`] (vLLM's largest, hybrid models' attention blocks, are ~10^3);
    token_ids exactly len(block_hashes) × block_size;
  - lora_name, medium, kv_cache_spec_kind: a string of at most `MAX_NAME_CHARS` characters, or nil; lora_id,
    group_idx, kv_cache_spec_sliding_window, data_parallel_rank: an int or nil; ts: a number; extra_keys: nil or
    a list (at most one entry per block) of nil or lists;
  - list lengths: bounded by the payload's size (every element takes at least one byte), itself bounded by the
    subscriber's ZMQ_MAXMSGSIZE (subscriber.py MAX_MESSAGE_BYTES) and here by `max_bytes`.
Checking costs one C-level pass over the token ids, not a Python loop per token (numbers in the test's docstring).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import msgpack


class BadPayload(ValueError):
    """The payload is not a vLLM event batch."""


MAX_TOKEN_ID = (1 << 32) - 1  # array("I"): 4-byte unsigned on every platform Python runs on
MAX_BLOCK_SIZE = 1 << 16
MAX_HASH_BYTES = 64
MAX_NAME_CHARS = 1024
DEFAULT_MAX_BYTES = 16 << 20  # subscriber.MAX_MESSAGE_BYTES; a direct caller gets the same bound
_HASH_MIN, _HASH_END = -(1 << 63), 1 << 64


@dataclass(slots=True)
class Stored:
    block_hashes: list
    parent_block_hash: object  # None: a request's first block
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None
    cache_salt: str | None = None  # the first block's extra key (vLLM's cache_salt), when the event carries it


@dataclass(slots=True)
class Removed:
    block_hashes: list


@dataclass(slots=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared

# Positional layouts (vLLM's msgspec field order) of the older array encoding.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_NAMES = ("lora_name", "medium", "kv_cache_spec_kind")
_INTS = ("lora_id", "group_idx", "kv_cache_spec_sliding_window")


def decode_batch(payload: bytes, max_bytes: int = DEFAULT_MAX_BYTES) -> list[Event]:
    if len(payload) > max_bytes:
        raise BadPayload(f"{len(payload)} bytes, over the {max_bytes}-byte bound")
    try:
        # unpackb bounds every str, bin, array and map length by len(payload): a short header cannot claim more
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for bad bytes
        raise BadPayload(f"not msgpack: {exc}") from None
    if isinstance(batch, dict):
        events, ts, rank = batch.get("events"), batch.get("ts", 0), batch.get("data_parallel_rank")
    elif isinstance(batch, list) and len(batch) >= 2:
        events, ts, rank = batch[1], batch[0], batch[2] if len(batch) > 2 else None
    else:
        raise BadPayload(f"an event batch is a map or an array, got {_kind(batch)}")
    if not isinstance(events, list):
        raise BadPayload("the batch has no event list")
    if type(ts) not in (int, float):
        raise BadPayload(f"ts: a number, got {_kind(ts)}")
    if rank is not None and type(rank) is not int:
        raise BadPayload(f"data_parallel_rank: an int or nil, got {_kind(rank)}")
    out: list[Event] = []
    for raw in events:
        event = _event(raw)
        if event is not None:
            out.append(event)
    return out


def _event(raw) -> Event | None:
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
        if type(kind) is not str:
            raise BadPayload(f"an event's type is a string, got {_kind(kind)}")
    elif isinstance(raw, list) and raw and type(raw[0]) is str:
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS if kind == "BlockRemoved" else ()
        fields = dict(zip(names, raw[1:]))
    else:
        raise BadPayload(f"an event is a map or a tagged array, got {_kind(raw)}")
    if kind == "BlockStored":
        return _stored(fields)
    if kind == "BlockRemoved":
        _optional(fields, "BlockRemoved", ("medium",), ("group_idx",))
        return Removed(_hashes(fields.get("block_hashes"), "BlockRemoved.block_hashes"))
    if kind == "AllBlocksCleared":
        return Cleared()
    return None


def _stored(fields: dict) -> Stored:
    hashes = _hashes(fields.get("block_hashes"), "BlockStored.block_hashes")
    parent = fields.get("parent_block_hash")
    if parent is not None:
        _check_hash(parent, "BlockStored.parent_block_hash")
    size = fields.get("block_size")
    if type(size) is not int or not 1 <= size <= MAX_BLOCK_SIZE:
        raise BadPayload(f"BlockStored.block_size: an int in [1, {MAX_BLOCK_SIZE}], got {_kind(size)}")
    tokens = fields.get("token_ids")
    if type(tokens) is not list:
        raise BadPayload(f"BlockStored.token_ids: a list, got {_kind(tokens)}")
    if len(tokens) != len(hashes) * size:
        raise BadPayload(f"BlockStored: {len(tokens)} token ids for {len(hashes)} blocks of {size}")
    try:
        array("I", tokens)  # non-integers, negatives and ids ≥ 2^32 all raise
    except (TypeError, OverflowError):
        raise BadPayload(f"BlockStored.token_ids: ints in [0, {MAX_TOKEN_ID}]") from None
    _optional(fields, "BlockStored", _NAMES, _INTS)
    extra = fields.get("extra_keys")
    salt = None
    if extra is not None:
        if type(extra) is not list or len(extra) > len(hashes) \
                or not all(key is None or type(key) is list for key in extra):
            raise BadPayload("BlockStored.extra_keys: nil or a list of nil or lists, one per block")
        if extra and extra[0] and type(extra[0][0]) is str:
            salt = extra[0][0]
    return Stored(hashes, parent, tokens, size, fields.get("lora_name"), salt)


def _optional(fields: dict, event: str, names: tuple[str, ...], ints: tuple[str, ...]) -> None:
    for name in names:
        value = fields.get(name)
        if value is not None and (type(value) is not str or len(value) > MAX_NAME_CHARS):
            raise BadPayload(f"{event}.{name}: nil or a string of at most {MAX_NAME_CHARS} characters, "
                             f"got {_kind(value)}")
    for name in ints:
        value = fields.get(name)
        if value is not None and type(value) is not int:
            raise BadPayload(f"{event}.{name}: nil or an int, got {_kind(value)}")


def _hashes(value, what: str) -> list:
    if type(value) is not list:
        raise BadPayload(f"{what}: a list, got {_kind(value)}")
    if not value:
        return value
    if set(map(type, value)) == {int}:  # vLLM's default: range-check the whole list at C speed
        if min(value) < _HASH_MIN or max(value) >= _HASH_END:
            raise BadPayload(f"{what}: 64-bit ints")
        return value
    for h in value:
        _check_hash(h, what)
    return value


def _check_hash(h, what: str) -> None:
    if type(h) is int and _HASH_MIN <= h < _HASH_END:
        return
    if type(h) is bytes and 0 < len(h) <= MAX_HASH_BYTES:
        return
    raise BadPayload(f"{what}: a block hash is a 64-bit int or 1..{MAX_HASH_BYTES} bytes, got {_kind(h)}")


def _kind(value) -> str:
    """A short description of a bad value (never its whole text: it may be megabytes)."""
    if type(value) in (int, float, bool) or value is None:
        text = repr(value)
        return text if len(text) <= 24 else f"{type(value).__name__} of {len(text)} digits"
    if type(value) in (str, bytes, list, dict):
        return f"{type(value).__name__} of length {len(value)}"
    return type(value).__name__
