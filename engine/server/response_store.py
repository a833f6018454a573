"""The Responses API's stored responses (`store: true`, the default), which `previous_response_id` continues and
GET /v1/responses/{id} returns: held in this server's memory only, bounded three ways, each a flag:

- `--responses-store-entries` (default 256; 0 keeps none): the oldest response goes first when it is full;
- `--responses-store-bytes` (default 64 MiB): the stored responses' JSON size (the conversation that led to each
  and its answer), the oldest going first; a response larger than the whole budget is not stored;
- `--responses-store-ttl` (default 3600 s): a response older than this is gone.

A response that is not (or no longer) stored: `previous_response_id` naming it is a 404, as vLLM answers for an
id it does not hold; with the store off (entries 0) `store: true` is served without storing (the response says
`"store": false`, as vLLM does when its store is off) and `previous_response_id` is a 400 saying so. Behind a
gateway with several replicas, a response is stored on the replica that answered it; its id names that replica
(common/response_ids.py) so the EPP can send a follow-up there.
"""

from __future__ import annotations

import argparse
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class StoreLimits:
    max_entries: int = 256
    max_bytes: int = 64 * 2**20
    ttl_s: float = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object as answered
    conversation: list[dict]  # the chat messages that led to it, and its answer: what a follow-up continues
    size: int  # bytes counted against --responses-store-bytes
    stored_at: float


class ResponseStore:
    def __init__(self, limits: StoreLimits = StoreLimits(), clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first
        self.bytes = 0

    @property
    def enabled(self) -> bool:
        return self.limits.max_entries > 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, response: dict, conversation: list[dict], size: int) -> bool:
        """Store a response of `size` bytes; False when it is not stored (the store is off, or it alone is over
        the byte budget). Older responses make room."""
        if not self.enabled or size > self.limits.max_bytes:
            return False
        self._expire()
        old = self._entries.pop(response_id, None)
        if old is not None:
            self.bytes -= old.size
        while self._entries and (len(self._entries) >= self.limits.max_entries
                                 or self.bytes + size > self.limits.max_bytes):
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.size
        self._entries[response_id] = StoredResponse(response, conversation, size, self.clock())
        self.bytes += size
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire()
        return self._entries.get(response_id)

    def _expire(self) -> None:
        oldest_kept = self.clock() - self.limits.ttl_s
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.stored_at >= oldest_kept:
                return
            _, dropped = self._entries.popitem(last=False)
            self.bytes -= dropped.size


def add_store_args(parser: argparse.ArgumentParser) -> None:
    d = StoreLimits()
    g = parser.add_argument_group("Responses API store (server memory; previous_response_id)")
    g.add_argument("--responses-store-entries", type=_non_negative(int), default=d.max_entries,
                   help=f"most stored responses, oldest dropped first; 0: store none (default {d.max_entries})")
    g.add_argument("--responses-store-bytes", type=_non_negative(int), default=d.max_bytes,
                   help=f"most bytes of stored responses (JSON), oldest dropped first (default {d.max_bytes})")
    g.add_argument("--responses-store-ttl", type=_positive_float, default=d.ttl_s, metavar="SECONDS",
                   help=f"seconds a stored response is kept (default {d.ttl_s:g})")


def store_from_args(args: argparse.Namespace) -> ResponseStore:
    return ResponseStore(StoreLimits(args.responses_store_entries, args.responses_store_bytes,
                                     args.responses_store_ttl))


def _non_negative(kind):
    def parse(text: str):
        value = kind(text)
        if value < 0:
            raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
        return value
    return parse


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value
