"""The attacks of `kvgate bench hostile`: what a hostile or broken client, a rogue pod on the pool's network or a
rogue publisher of KV events sends, each one way in which a peer could make the stack misbehave. An attack is a
function `(Target) -> Attempt`: it sends its input, records what came back, and never judges the stack — the
runner (bench/chaos/hostile.py) holds the good traffic and the verdict.

Each attack names the answer it expects: `4xx` (a clear refusal: a 4xx status with an OpenAI-style JSON error
body), `4xx-or-200` (refused, or served within its bounds), `absorbed` (no answer to check: what is judged is
that good traffic and the stack's memory did not suffer).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import msgpack
import zmq

from kvgate.bench.chaos.load import text

REPLAY_END = (-1).to_bytes(8, "big", signed=True)


@dataclass
class Target:
    gateway: str  # http://host:port of Envoy
    engines: list[str]  # host:port of each engine (a rogue pod reaches them on the pod network)
    model: str
    event_sockets: list[tuple[str, str]]  # each engine's (PUB, replay) ZMQ endpoints
    rogue: zmq.Socket | None = None  # bound where the EPP believes engine 1 publishes
    # sockets an attack leaves open on purpose (slow subscribers) until the run ends
    held: list[zmq.Socket] = field(default_factory=list)


@dataclass
class Attempt:
    answers: list[int | str] = field(default_factory=list)  # HTTP status per request, or what a socket did
    refused_clearly: bool = True  # every 4xx carried an OpenAI-style JSON error
    detail: str = ""  # one line: sizes, counts, the first error message


@dataclass(frozen=True)
class Attack:
    name: str
    what: str
    run: Callable[[Target], Attempt]
    expect: str  # "4xx" | "4xx-or-200" | "absorbed"


def _post(url: str, body: dict | bytes, attempt: Attempt, timeout: float = 120.0) -> None:
    try:
        if isinstance(body, bytes):
            r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=timeout)
        else:
            r = httpx.post(url, json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        attempt.answers.append(type(exc).__name__)
        return
    attempt.answers.append(r.status_code)
    if 400 <= r.status_code < 500:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            attempt.refused_clearly = False
            message = r.text[:120]
        attempt.detail = attempt.detail or message[:160]
    elif r.status_code >= 500:
        attempt.detail = attempt.detail or r.text[:160]


def regex_bomb(t: Target) -> Attempt:
    """A regex whose matcher is costly to build with the demo tokenizer, for each of 16 samples (`n`)."""
    a = Attempt()
    _post(f"{t.gateway}/v1/completions", {"model": t.model, "prompt": "x", "max_tokens": 4, "n": 16,
                                          "structured_outputs": {"regex": "a{200000}"}}, a)
    return a


def _schema(i: int, description_bytes: int) -> dict:
    return {"type": "object", "description": f"{i}:" + "d" * description_bytes,
            "properties": {f"field_{i}": {"type": "string"}}, "required": [f"field_{i}"]}


def schema_flood(t: Target) -> Attempt:
    """12 distinct JSON schemas with a 4 MiB description each, to an engine's render endpoint (the compile cache
    kept every one, by count, not bytes)."""
    a = Attempt()
    for i in range(12):
        _post(f"http://{t.engines[0]}/v1/completions/render",
              {"model": t.model, "prompt": "x", "response_format": {
                  "type": "json_schema", "json_schema": {"name": f"s{i}", "schema": _schema(i, 4 << 20)}}}, a)
    return a


def long_prompt(t: Target) -> Attempt:
    """Two 6 MiB prompts through the gateway: under the EPP's 16 MiB body limit, far over the model's context."""
    a = Attempt()
    prompt = text(6 << 20, seed=1)
    for _ in range(2):
        _post(f"{t.gateway}/v1/completions", {"model": t.model, "prompt": prompt, "max_tokens": 1}, a)
    return a


def tokenize_big(t: Target) -> Attempt:
    """A 2 MiB prompt to an engine's /tokenize (unbounded, its answer is megabytes of ids built on the event loop)."""
    a = Attempt()
    _post(f"http://{t.engines[0]}/tokenize", {"model": t.model, "prompt": text(2 << 20, seed=2)}, a)
    return a


def huge_token_id(t: Target) -> Attempt:
    """Token-id prompts with ids at and past 2^63 and negative, through the gateway."""
    a = Attempt()
    for ids in ([2**63, 1, 2], [2**64 + 5], [-1, 3]):
        _post(f"{t.gateway}/v1/completions", {"model": t.model, "prompt": ids, "max_tokens": 1}, a)
    return a


def _socket(kind: int) -> zmq.Socket:
    s = zmq.Context.instance().socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IPV6, 1)  # the local stack's engines bind their event sockets on [::1]
    return s


def replay_flood(t: Target) -> Attempt:
    """2000 replay requests from the start of history to every engine's replay socket, answers read and thrown
    away as fast as they come (one 8-byte request re-sent the whole buffer, ahead of live events)."""
    a = Attempt()
    for _, replay in t.event_sockets:
        s = _socket(zmq.DEALER)
        s.setsockopt(zmq.RCVHWM, 1000)
        s.connect(replay)
        try:
            for _ in range(2000):
                s.send_multipart([b"", (0).to_bytes(8, "big")], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        got, deadline = 0, time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if s.poll(200) == 0:
                break
            s.recv_multipart()
            got += 1
        a.answers.append(f"{got} messages back")
        s.close()
    a.detail = f"replies per engine: {', '.join(str(x) for x in a.answers)}"
    return a


def slow_subscribers(t: Target) -> Attempt:
    """Three subscribers per engine that connect and never read, held open until the run ends."""
    a = Attempt()
    for pub, _ in t.event_sockets:
        for _ in range(3):
            s = _socket(zmq.SUB)
            # stop reading at once: our queue holds one message, the kernel's a few KiB, the rest waits in the
            # publisher
            s.setsockopt(zmq.RCVHWM, 1)
            s.setsockopt(zmq.RCVBUF, 4096)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.connect(pub)
            t.held.append(s)
    a.answers.append(f"{len(t.held)} subscribers")
    return a


def _rogue_batches(seq_start: int) -> list[list[bytes]]:
    """Malformed batches on vLLM's wire ([topic, seq, msgpack payload]), each a way that stopped the EPP's
    subscriber thread or grew its memory: a list parent hash, a non-int token id, a token id of 2^63, garbage
    msgpack, a 1 MiB LoRA name."""
    def batch(*events) -> bytes:
        return msgpack.packb({"ts": time.time(), "events": list(events), "data_parallel_rank": 0})

    def stored(**fields) -> dict:
        return {"type": "BlockStored", "block_hashes": [11], "parent_block_hash": None, "token_ids": [1] * 16,
                "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None} | fields
    payloads = [
        batch(stored(parent_block_hash=[1, 2])),
        batch(stored(token_ids=["x"] * 16)),
        batch(stored(token_ids=[2**63] * 16)),
        b"\xc1\xc1garbage",
        batch(stored(lora_id=7, lora_name="l" * (1 << 20))),
    ]
    return [[b"", (seq_start + i).to_bytes(8, "big"), p] for i, p in enumerate(payloads)]


def bind_rogue(address: str) -> zmq.Socket:
    """The rogue's PUB socket, bound before the stack starts (the EPP connects once; a late bind would meet its
    reconnection back-off)."""
    s = _socket(zmq.PUB)
    s.bind(address)
    return s


def rogue_publisher(t: Target) -> Attempt:
    """A rogue holds the PUB address the EPP subscribes to for engine 1 and sends malformed batches for 2 s (the
    thread that reads every engine's events must survive them all)."""
    a = Attempt()
    if t.rogue is None:
        a.answers.append("no rogue socket")
        return a
    sent, deadline, seq = 0, time.monotonic() + 2.0, 1_000_000  # ahead of what the EPP has seen: not stale
    while time.monotonic() < deadline:
        for frames in _rogue_batches(seq):
            t.rogue.send_multipart(frames)
            sent += 1
        seq += 5
        time.sleep(0.05)
    a.answers.append(f"{sent} malformed batches")
    return a


ATTACKS = [
    Attack("regex-bomb", "n=16 samples under regex a{200000}, through the gateway", regex_bomb, "4xx-or-200"),
    Attack("schema-flood", "12 distinct 4 MiB JSON schemas to an engine's render endpoint", schema_flood,
           "4xx-or-200"),
    Attack("long-prompt", "two 6 MiB prompts through the gateway (EPP tokenization)", long_prompt, "4xx"),
    Attack("tokenize-big", "a 2 MiB prompt to an engine's /tokenize", tokenize_big, "4xx"),
    Attack("huge-token-id", "token ids >= 2^63 and < 0 through the gateway", huge_token_id, "4xx"),
    Attack("replay-flood", "2000 replay requests to every engine's replay socket", replay_flood, "absorbed"),
    Attack("slow-subscribers", "3 never-reading subscribers on every engine's PUB socket", slow_subscribers,
           "absorbed"),
    Attack("rogue-publisher", "malformed KV-event batches where the EPP listens for engine 1", rogue_publisher,
           "absorbed"),
]
BY_NAME = {a.name: a for a in ATTACKS}


def run_in_thread(attack: Attack, target: Target) -> tuple[threading.Thread, list[Attempt]]:
    """Start `attack` on a thread of its own (its requests block); the list gets its Attempt when done."""
    out: list[Attempt] = []

    def go() -> None:
        try:
            out.append(attack.run(target))
        except Exception as exc:  # noqa: BLE001 - an attack that breaks is reported, never the run's end
            out.append(Attempt([f"attack raised {type(exc).__name__}"], detail=str(exc)[:160]))
    thread = threading.Thread(target=go, daemon=True, name=f"attack-{attack.name}")
    thread.start()
    return thread, out


def held_close(target: Target) -> None:
    for s in [*target.held, *([target.rogue] if target.rogue is not None else [])]:
        s.close(0)
    target.held.clear()


def to_json(attempt: Attempt) -> dict:
    return {"answers": attempt.answers, "refused_clearly": attempt.refused_clearly, "detail": attempt.detail}


def as_text(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else value
