"""The workloads of `kvgate bench routing`, as fixed request sequences: the same seed gives the same prompts in the
same order with the same arrival times, so every routing configuration is driven by the identical stream.

Prompts are text whose length in characters is its length in tokens (the sim backend's byte tokenizer).
- multi-tenant: T tenants, each a long system prompt; U users per tenant, each with a context of their own; every
  request is tenant system prompt + user context + a fresh question (llm-d's shared-prefix benchmark, scaled
  down). Which (tenant, user) asks is uniform at random.
- multi-turn: C conversations; a request is a conversation's next turn: its whole history so far (system, every
  earlier question and a stand-in reply) + a new question, so each conversation's prompt grows. The reply in the
  history is text of the turn's output length, not what the engine answered: what a router can reuse is the
  previous prompt, which the engine cached either way.
- no-reuse: random prompts that share nothing (routing must not lose to round-robin here).
Arrivals are Poisson at the given rate (exponential gaps from a seeded generator).

Foreign traffic (`with_foreign`): a share of the requests, drawn by the seed and so the same for every
configuration, reaches the replicas through another gateway sharing the pool — one that hashes the prompt's first
FOREIGN_KEY_CHARS characters to a replica (session affinity by prefix, as a consistent-hash gateway or another
router's placement would give). The router under test never sees them: an index built from its own picks cannot
know what they put in the caches; one fed by the engines' KV events can.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import numpy as np
import xxhash

from kvgate.bench_serve import random_text


@dataclass(frozen=True)
class WorkloadShape:
    name: str
    what: str
    output_len: int
    # multi-tenant
    tenants: int = 0
    users_per_tenant: int = 0
    system_len: int = 0
    user_context_len: int = 0
    question_len: int = 0
    # multi-turn
    conversations: int = 0
    reply_len: int = 0
    max_turns: int = 0
    # no-reuse
    prompt_len: int = 0

    def prefix_tokens(self) -> int:
        """Tokens of the prefixes worth caching, all of them together (for sizing KV against)."""
        if self.name == "multi-tenant":
            return self.tenants * (self.system_len + self.users_per_tenant * self.user_context_len)
        if self.name == "multi-turn":
            return self.conversations * (self.system_len + self.max_turns * (self.question_len + self.reply_len))
        return 0


# Sized against the bench's sim engines (configurations.SIM_ENGINE_ARGS: 8192 tokens of KV each): one replica
# holds about a third of the multi-tenant prefixes, four replicas all of them when each keeps to its own tenants.
WORKLOADS = {
    "multi-tenant": WorkloadShape("multi-tenant", "12 tenants x 2000-token system prompt x 4 users (200-token "
                                  "context each), 100-token questions, 32 output tokens", output_len=32,
                                  tenants=12, users_per_tenant=4, system_len=2000, user_context_len=200,
                                  question_len=100),
    "multi-turn": WorkloadShape("multi-turn", "24 conversations, 400-token system prompt, up to 10 turns of a "
                                "150-token question and 100-token reply, 32 output tokens", output_len=32,
                                conversations=24, system_len=400, question_len=150, reply_len=100, max_turns=10),
    "no-reuse": WorkloadShape("no-reuse", "random 1200-token prompts sharing nothing, 32 output tokens",
                              output_len=32, prompt_len=1200),
}


@dataclass(frozen=True)
class BenchRequest:
    at: float  # seconds after the run's start
    prompt: str
    key: str  # tenant/user or conversation/turn: which prefix it reuses
    foreign: int | None = None  # the replica another gateway sends it to (not the router under test); None: ours


def prompts(shape: WorkloadShape, n: int, seed: int) -> list[tuple[str, str]]:
    """`n` (key, prompt) pairs in arrival order."""
    rng = random.Random(seed)
    if shape.name == "multi-tenant":
        systems = [random_text(rng, shape.system_len) for _ in range(shape.tenants)]
        contexts = [[random_text(rng, shape.user_context_len) for _ in range(shape.users_per_tenant)]
                    for _ in range(shape.tenants)]
        out = []
        for _ in range(n):
            t, u = rng.randrange(shape.tenants), rng.randrange(shape.users_per_tenant)
            out.append((f"t{t}/u{u}", systems[t] + contexts[t][u] + random_text(rng, shape.question_len)))
        return out
    if shape.name == "multi-turn":
        histories = [random_text(rng, shape.system_len) for _ in range(shape.conversations)]
        turns = [0] * shape.conversations
        out = []
        for _ in range(n):
            c = rng.randrange(shape.conversations)
            if turns[c] == shape.max_turns:  # finished: a new conversation takes its place
                histories[c], turns[c] = random_text(rng, shape.system_len), 0
            prompt = histories[c] + random_text(rng, shape.question_len)
            out.append((f"c{c}/turn{turns[c]}", prompt))
            histories[c] = prompt + random_text(rng, shape.reply_len)
            turns[c] += 1
        return out
    if shape.name == "no-reuse":
        return [(f"r{i}", random_text(rng, shape.prompt_len)) for i in range(n)]
    raise ValueError(f"unknown workload {shape.name!r}")


def arrivals(shape: WorkloadShape, rate: float, duration_s: float, seed: int) -> list[BenchRequest]:
    """Poisson arrivals at `rate` per second for `duration_s`; the prompts depend on the seed only (not the
    rate), so every rate sends the same prompts in the same order, just faster."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=max(1, int(rate * duration_s * 2) + 16))
    times = np.cumsum(gaps)
    times = times[times <= duration_s] if times[0] <= duration_s else times[:1]
    return [BenchRequest(float(at), prompt, key)
            for at, (key, prompt) in zip(times, prompts(shape, len(times), seed))]


FOREIGN_KEY_CHARS = 256


def with_foreign(requests: list[BenchRequest], share: float, replicas: int, seed: int) -> list[BenchRequest]:
    """`requests` with a `share` of them (each with probability `share`, from `seed`) sent by a foreign gateway
    to replica xxh3(prompt[:FOREIGN_KEY_CHARS]) mod `replicas`."""
    if share <= 0:
        return requests
    rng = random.Random(f"foreign-{seed}")
    return [replace(r, foreign=xxhash.xxh3_64_intdigest(r.prompt[:FOREIGN_KEY_CHARS].encode()) % replicas)
            if rng.random() < share else r for r in requests]
