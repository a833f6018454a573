"""Streaming load that checks every answer: closed-loop workers send streamed completions of a fixed length
(`ignore_eos`) and record, per request, when it was sent, when its headers came, which endpoint served it (the
engine's `x-kvgate-endpoint`), how many tokens arrived and how it ended. A request succeeded only if it got a
200, exactly `max_tokens` token events, the usage chunk saying so and `[DONE]`: a cut or corrupted stream is a
failure, never a success. `kvgate bench routing` sends its own prompts open-loop through `one` (and reads
`first_token_at` for TTFT)."""

from __future__ import annotations

import asyncio
import json
import random
import string
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

SERVED_BY = "x-kvgate-endpoint"
FAILURE_BACKOFF_S = 0.1  # a worker whose request failed waits this long, as a client would, before the next


def text(n: int, seed: int) -> str:
    """`n` characters of words (a few hundred of them, random from `seed`): prompts, fast to make at MiBs."""
    rng = random.Random(seed)
    words = ["".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 9))) for _ in range(512)]
    out, size = [], 0
    while size < n:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def tenant_prompts(tenants: int = 4, system_chars: int = 1500) -> Callable[[int], str]:
    """A StreamLoad's `prompt_for`: request `seq` starts with one of `tenants` shared system prompts (so the prefix
    cache and prefix-aware routing matter), then a question of its own."""
    systems = [text(system_chars, seed=100 + i) for i in range(tenants)]
    return lambda seq: f"{systems[seq % tenants]}\nrequest {seq}: go on"


@dataclass
class Outcome:
    sent_at: float
    headers_at: float | None = None
    first_token_at: float | None = None  # the first token event (time to first token = this - sent_at)
    ended_at: float | None = None
    status: int | None = None
    endpoint: str | None = None
    tokens: int = 0
    usage_tokens: int | None = None
    prompt_tokens: int | None = None  # the usage chunk's prompt tokens and, of them, those the engine had cached
    cached_tokens: int | None = None  # (prompt_tokens_details; None where the server does not say)
    done: bool = False
    error: str | None = None
    token_gaps: list[float] = field(default_factory=list)  # seconds between token events (inter-token latency)
    max_tokens: int | None = None  # what this request asked for, where it asked for its own

    def ok(self, max_tokens: int | None = None) -> bool:
        """200, the whole stream, and exactly the tokens asked for (`max_tokens`, else the request's own)."""
        expected = self.max_tokens if max_tokens is None else max_tokens
        return (self.status == 200 and self.done and self.tokens == expected
                and self.usage_tokens == expected and self.error is None)

    def failure_kind(self) -> str:
        """What went wrong, in a word a summary can count: `HTTP 503`, the exception's name, or `incomplete`."""
        if self.status not in (None, 200):
            return f"HTTP {self.status}"
        return (self.error or "incomplete").split(":")[0]

    def running_at(self, t: float) -> bool:
        """Sent before `t` and not ended by then."""
        return self.sent_at <= t and (self.ended_at is None or self.ended_at > t)


class StreamLoad:
    def __init__(self, url: str | list[str], model: str, *, concurrency: int, max_tokens: int = 64,
                 timeout_s: float = 120.0, keep_gaps: bool = False,
                 prompt_for: Callable[[int], str] | None = None) -> None:
        """`url`: the gateway, or a list of servers taken in turn (a baseline straight at the engines);
        `prompt_for(seq)`: the prompts `run` sends (default: a short one of its own per request)."""
        self.urls = [u.rstrip("/") for u in ([url] if isinstance(url, str) else url)]
        self.model = model
        self.concurrency, self.max_tokens, self.timeout_s = concurrency, max_tokens, timeout_s
        self.keep_gaps = keep_gaps
        self.prompt_for = prompt_for
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._seq = 0

    def stop(self) -> None:
        self._stop.set()

    async def run(self, total: int | None = None) -> list[Outcome]:
        """Until stop() (or `total` requests have been sent): `concurrency` requests in flight at all times."""
        limits = httpx.Limits(max_connections=self.concurrency, max_keepalive_connections=self.concurrency)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s, connect=10.0), limits=limits) as client:
            async def worker():
                while not self._stop.is_set() and (total is None or self._seq < total):
                    self._seq += 1
                    out = await self.one(client, self._seq,
                                         self.prompt_for(self._seq) if self.prompt_for else None)
                    if out.status != 200 or out.error:
                        await asyncio.sleep(FAILURE_BACKOFF_S)
            await asyncio.gather(*(worker() for _ in range(self.concurrency)))
        return self.outcomes

    async def one(self, client: httpx.AsyncClient, seq: int, prompt: str | None = None,
                  url: str | None = None, max_tokens: int | None = None,
                  headers: dict[str, str] | None = None) -> Outcome:
        """One streamed completion of `prompt` (default: a short prompt of its own per `seq`), to `url` (default:
        the load's URLs in turn), of `max_tokens` (default: the load's), with extra request `headers`."""
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        out = Outcome(sent_at=time.monotonic(), max_tokens=max_tokens)
        self.outcomes.append(out)
        prompt = f"request {seq}: tell me a story" if prompt is None else prompt
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
        try:
            url = url.rstrip("/") if url else self.urls[seq % len(self.urls)]
            async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
                out.headers_at, out.status, out.endpoint = time.monotonic(), r.status_code, r.headers.get(SERVED_BY)
                if r.status_code != 200:
                    out.error = (await r.aread()).decode(errors="replace")[:200]
                    return out
                last = out.headers_at
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        out.done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if event.get("choices"):
                            out.tokens += 1
                            if out.first_token_at is None:
                                out.first_token_at = time.monotonic()
                            if self.keep_gaps:
                                now = time.monotonic()
                                out.token_gaps.append(now - last)
                                last = now
                        if usage := event.get("usage"):
                            out.usage_tokens = usage.get("completion_tokens")
                            out.prompt_tokens = usage.get("prompt_tokens")
                            out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"[:200]
        finally:
            out.ended_at = time.monotonic()
        return out


@dataclass
class Tally:
    sent: int
    succeeded: int
    failed: int

    @classmethod
    def of(cls, outcomes: list[Outcome], max_tokens: int) -> "Tally":
        ok = sum(o.ok(max_tokens) for o in outcomes)
        return cls(len(outcomes), ok, len(outcomes) - ok)
