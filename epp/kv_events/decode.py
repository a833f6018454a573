"""vLLM's KV-cache event payloads → plain records, whichever of vLLM's two encodings the engine speaks.

A payload is one msgpack event batch. vLLM encodes it with msgspec:
  - up to 2025 (`array_like=True`): the batch is [ts, events, data_parallel_rank] and an event is a positional
    array whose first element is its tag: ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
    lora_id, medium, lora_name?...], ["BlockRemoved", block_hashes, medium?], ["AllBlocksCleared"];
  - since 2026 (`tag=True`, maps): {"ts", "events", "data_parallel_rank"} and each event a map with "type"
    (engine/kv_events.py documents the fields kvgate's engine sends).
Hashes are ints (vLLM's default) or bytes; both are used as they come, as dict keys. Unknown event types are
skipped (a newer engine may add some); a malformed payload raises BadPayload and the subscriber counts it.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack


class BadPayload(ValueError):
    """The payload is not a vLLM event batch."""


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

# Positional layouts (vLLM's msgspec field order) of the pre-2026 array encoding.
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys")
_REMOVED_FIELDS = ("block_hashes", "medium")


def decode_batch(payload: bytes) -> list[Event]:
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several types for bad bytes
        raise BadPayload(f"not msgpack: {exc}") from None
    if isinstance(batch, dict):
        events = batch.get("events")
    elif isinstance(batch, list) and len(batch) >= 2:
        events = batch[1]
    else:
        raise BadPayload(f"an event batch is a map or an array, got {type(batch).__name__}")
    if not isinstance(events, list):
        raise BadPayload("the batch has no event list")
    out: list[Event] = []
    for raw in events:
        event = _event(raw)
        if event is not None:
            out.append(event)
    return out


def _event(raw) -> Event | None:
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS if kind == "BlockRemoved" else ()
        fields = dict(zip(names, raw[1:]))
    else:
        raise BadPayload(f"an event is a map or a tagged array, got {type(raw).__name__}")
    if kind == "BlockStored":
        hashes, tokens, size = fields.get("block_hashes"), fields.get("token_ids"), fields.get("block_size")
        if not isinstance(hashes, list) or not isinstance(tokens, list) or not isinstance(size, int) or size < 1:
            raise BadPayload("BlockStored needs block_hashes, token_ids and a positive block_size")
        if len(tokens) != len(hashes) * size:
            raise BadPayload(f"BlockStored: {len(tokens)} token ids for {len(hashes)} blocks of {size}")
        extra = fields.get("extra_keys")
        salt = None
        if isinstance(extra, list) and extra and isinstance(extra[0], list) and extra[0]:
            salt = extra[0][0] if isinstance(extra[0][0], str) else None
        lora = fields.get("lora_name")
        return Stored(hashes, fields.get("parent_block_hash"), tokens, size,
                      lora if isinstance(lora, str) else None, salt)
    if kind == "BlockRemoved":
        hashes = fields.get("block_hashes")
        if not isinstance(hashes, list):
            raise BadPayload("BlockRemoved needs block_hashes")
        return Removed(hashes)
    if kind == "AllBlocksCleared":
        return Cleared()
    return None
