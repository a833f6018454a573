"""The workloads of `kvgate bench routing`, as fixed request sequences: the same seed gives the same prompts in the
same order with the same arrival times, so every routing configuration is driven by the identical stream.

A workload is a shape: a kind (how prompts reuse each other) and its knobs. Prompts are text whose length in
characters is its length in tokens (the sim backend's byte tokenizer).
- multi-tenant: T tenants, each a long system prompt; U users per tenant, each with a context of their own; every
  request is tenant system prompt + user context + a fresh question (llm-d's shared-prefix benchmark, scaled
  down). Which tenant asks is uniform at random, or Zipf-skewed (`tenant_skew` s: weights 1/(i+1)^s); the user
  uniform within it. With `skew_rotate_every` N the popularity moves on every N requests: the ranking rotates by one
  place, so the second most popular tenant becomes the hottest and the hottest the least asked (a tenant mix that
  shifts while the cell runs; counted in requests, not seconds, so every rate still sends the same prompts).
- multi-turn: C conversations; a request is a conversation's next turn: its whole history so far (system, every
  earlier question and a stand-in reply) + a new question, so each conversation's prompt grows. The reply in the
  history is text of the turn's output length, not what the engine answered: what a router can reuse is the
  previous prompt, which the engine cached either way.
- no-reuse: random prompts that share nothing (routing must not lose to round-robin here).

Knobs every kind has: `length_spread` (question / prompt lengths drawn lognormal around their set length with this
sigma; 0: fixed), `output_len` and `output_spread` (each request's max_tokens, likewise), `burstiness` (the
coefficient of variation of the gaps between arrivals: 1 is Poisson, above 1 Gamma-distributed gaps, i.e. bursts
and lulls at the same mean rate), `kv_tokens` (the KV cache of each sim replica, in tokens), `slow_replicas` and
`slowdown` (the last `slow_replicas` replicas run `slowdown` times slower — every cost of the sim's timing model,
`--sim-slowdown` — a pool of mixed hardware, e.g. two GPU generations behind one InferencePool) and `slow_kv_tokens`
(those replicas' KV cache, when it differs: 0 = kv_tokens; with slowdown 1 they differ in memory only), and
`prefill_chunk` (every replica's `--long-prefill-token-threshold`: a prompt computes at most this many tokens a
step, so cached requests get their first token between a cold prompt's chunks; 0: up to the step's budget).

Shapes are named (SHAPES), grouped in sets (SHAPE_SETS: the tuning set the default profile may be tuned on, and
held-out sets never used to choose weights), or written on the command line as
`KIND:knob=value,...` (`parse_shape`).

Foreign traffic (`with_foreign`): a share of the requests, drawn by the seed and so the same for every
configuration, reaches the replicas through another gateway sharing the pool — one that hashes the prompt's first
FOREIGN_KEY_CHARS characters to a replica (session affinity by prefix, as a consistent-hash gateway or another
router's placement would give). The router under test never sees them: an index built from its own picks cannot
know what they put in the caches; one fed by the engines' KV events can.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, fields, replace

import numpy as np
import xxhash

from kvgate.bench.serve import random_text

KINDS = ("multi-tenant", "multi-turn", "no-reuse")
DEFAULT_KV_TOKENS = 8192  # the sim replicas' KV cache (configurations.SIM_ENGINE_ARGS sizes it the same)
MAX_LENGTH_FACTOR = 4.0  # a drawn length stays within [1/4, 4] × the set length
MAX_SLOWDOWN = 100.0


@dataclass(frozen=True)
class WorkloadShape:
    name: str
    what: str
    output_len: int
    kind: str = ""  # KINDS; "" means `name` is the kind (the three base shapes)
    # multi-tenant
    tenants: int = 0
    users_per_tenant: int = 0
    system_len: int = 0
    user_context_len: int = 0
    question_len: int = 0
    tenant_skew: float = 0.0
    skew_rotate_every: int = 0  # requests between rotations of the popularity ranking; 0: it never moves
    # multi-turn
    conversations: int = 0
    reply_len: int = 0
    max_turns: int = 0
    # no-reuse
    prompt_len: int = 0
    # every kind
    length_spread: float = 0.0
    output_spread: float = 0.0
    burstiness: float = 1.0
    kv_tokens: int = DEFAULT_KV_TOKENS
    slow_replicas: int = 0
    slowdown: float = 1.0
    slow_kv_tokens: int = 0
    prefill_chunk: int = 0
    # each request states a TTFT objective (llm-d's x-slo-ttft-ms header) of this many ms; 0: none
    ttft_objective_ms: float = 0.0
    # the share of the requests that state it (drawn by the seed: interactive traffic among batch); 1: every one
    objective_share: float = 1.0

    def __post_init__(self) -> None:
        if self.generator not in KINDS:
            raise ValueError(f"unknown workload kind {self.generator!r}; known: {', '.join(KINDS)}")
        if self.output_len < 1 or self.kv_tokens < 256 or self.burstiness <= 0 or self.length_spread < 0 \
                or self.output_spread < 0 or self.tenant_skew < 0 or self.skew_rotate_every < 0 \
                or self.ttft_objective_ms < 0 \
                or not 0.0 <= self.objective_share <= 1.0 \
                or self.slow_replicas < 0 or not 1.0 <= self.slowdown <= MAX_SLOWDOWN \
                or 0 < self.slow_kv_tokens < 256 or self.slow_kv_tokens < 0 or self.prefill_chunk < 0:
            raise ValueError(f"workload {self.name!r}: output_len ≥ 1, kv_tokens and slow_kv_tokens ≥ 256 (0: "
                             "kv_tokens), burstiness > 0, the spreads, skew, TTFT objective, slow_replicas and "
                             "prefill_chunk and skew_rotate_every ≥ 0, objective_share in [0, 1], "
                             f"1 ≤ slowdown ≤ {MAX_SLOWDOWN:g}")

    @property
    def generator(self) -> str:
        return self.kind or self.name

    def prefix_tokens(self) -> int:
        """Tokens of the prefixes worth caching, all of them together (for sizing KV against)."""
        if self.generator == "multi-tenant":
            return self.tenants * (self.system_len + self.users_per_tenant * self.user_context_len)
        if self.generator == "multi-turn":
            return self.conversations * (self.system_len + self.max_turns * (self.question_len + self.reply_len))
        return 0

    def context_tokens(self) -> int:
        """The longest request (prompt + output) every replica takes: min(8192, the smallest KV cache)."""
        smallest = min(self.kv_tokens, self.slow_kv_tokens) if self.slow_replicas and self.slow_kv_tokens else \
            self.kv_tokens
        return min(8192, smallest)

    def knobs(self) -> dict:
        """The shape's settings (for the result file)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("name", "what")}


# Sized against the bench's sim engines (DEFAULT_KV_TOKENS each): one replica holds about a third of the
# multi-tenant prefixes, four replicas all of them when each keeps to its own tenants.
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


def _shape(name: str, base: str, what: str, **knobs) -> WorkloadShape:
    return replace(WORKLOADS[base], name=name, what=what, kind=base, **knobs)


# Shapes beyond the three base workloads. The held-out sets are not used to tune kvgate's profile: a profile is
# judged on them, never tuned on them.
SHAPES = {
    **WORKLOADS,
    "many-tenants": _shape("many-tenants", "multi-tenant", "32 tenants x 1000-token system prompt x 2 users "
                           "(100-token context), questions ~100 tokens (spread 0.5), 32 output tokens (spread "
                           "0.5)", tenants=32, users_per_tenant=2, system_len=1000, user_context_len=100,
                           length_spread=0.5, output_spread=0.5),
    "hot-tenant": _shape("hot-tenant", "multi-tenant", "12 tenants, Zipf-skewed (s=1.2: the first asks ~40%), "
                         "otherwise multi-tenant", tenant_skew=1.2),
    "bursty-tenants": _shape("bursty-tenants", "multi-tenant", "multi-tenant with bursty arrivals (gaps' CV 3)",
                             burstiness=3.0),
    "long-output": _shape("long-output", "multi-tenant", "multi-tenant with ~128 output tokens (spread 0.7)",
                          output_len=128, output_spread=0.7),
    "small-kv": _shape("small-kv", "multi-tenant", "multi-tenant on replicas with half the KV (4096 tokens)",
                       kv_tokens=4096),
    "deep-chat": _shape("deep-chat", "multi-turn", "16 conversations of up to 16 turns, 120-token questions "
                        "(spread 0.5) and 80-token replies, 48 output tokens", conversations=16, max_turns=16,
                        question_len=120, reply_len=80, length_spread=0.5, output_len=48),
    "mixed-lengths": _shape("mixed-lengths", "no-reuse", "random prompts ~1200 tokens (spread 0.8), ~64 output "
                            "tokens (spread 0.8), bursty (CV 2)", length_spread=0.8, output_len=64,
                            output_spread=0.8, burstiness=2.0),
    # mixed hardware, for the speed-aware load signals (loadUnit: seconds): a tuning set of its own, not held out
    "mixed-speed": _shape("mixed-speed", "multi-tenant", "multi-tenant on a pool of mixed hardware: 2 of the 4 "
                          "replicas 2x slower", slow_replicas=2, slowdown=2.0),
    "mixed-speed-no-reuse": _shape("mixed-speed-no-reuse", "no-reuse", "no-reuse on a pool of mixed hardware: 2 of "
                                   "the 4 replicas 2x slower", slow_replicas=2, slowdown=2.0),
    "mixed-generations": _shape("mixed-generations", "multi-tenant", "multi-tenant on two GPU generations: 2 of the "
                                "4 replicas 2x slower with half the KV (4096 tokens)", slow_replicas=2, slowdown=2.0,
                                slow_kv_tokens=4096),
    "mixed-kv": _shape("mixed-kv", "multi-tenant", "multi-tenant on cards of two memory sizes: 2 of the 4 replicas "
                       "with half the KV (4096 tokens), as fast as the others", slow_replicas=2, slow_kv_tokens=4096),
    # held-out-2: the capacity-aware group balance was designed against small-kv, so small-kv no longer judges it
    # cleanly; this one does
    "small-kv-turns": _shape("small-kv-turns", "multi-turn", "multi-turn on replicas with half the KV (4096 tokens)",
                             kv_tokens=4096),
    # held-out-3: the prefill-interference scorer was designed against hot-tenant, so hot-tenant no longer judges it
    # cleanly; this one does
    "skewed-tenants": _shape("skewed-tenants", "multi-tenant", "16 tenants, Zipf-skewed (s=0.8: the first asks "
                             "~23%, the second ~13%), 1500-token system prompts, 6 users each", tenants=16,
                             tenant_skew=0.8, system_len=1500, users_per_tenant=6),
    # held-out-4: chosen and frozen before any routing change of its round was run on it; round-robin alone found
    # their saturation rates
    "agent-sessions": _shape("agent-sessions", "multi-turn", "12 agent sessions, each a 1000-token tool prompt of "
                             "its own, up to 8 steps of a ~60-token instruction (spread 0.5) and a 500-token tool "
                             "output, ~64 output tokens (spread 0.5): a context that grows fast", conversations=12,
                             system_len=1000, max_turns=8, question_len=60, reply_len=500, length_spread=0.5,
                             output_len=64, output_spread=0.5),
    "shifting-tenants": _shape("shifting-tenants", "multi-tenant", "10 tenants, Zipf-skewed (s=1.0: the hottest "
                               "asks ~34%), 1500-token system prompts, whose ranking rotates every 80 requests (the "
                               "second becomes the hottest, the hottest the least asked)", tenants=10,
                               tenant_skew=1.0, skew_rotate_every=80, system_len=1500),
    "user-documents": _shape("user-documents", "multi-tenant", "12 tenants x short 400-token system prompts x 2 "
                             "users, each with a 1000-token document of their own, ~200-token questions (spread "
                             "0.5): what is reused is the user's, not the tenant's", tenants=12, system_len=400,
                             users_per_tenant=2, user_context_len=1000, question_len=200, length_spread=0.5),
}

SHAPE_SETS = {
    "base": ("multi-tenant", "multi-turn", "no-reuse"),
    "tuning": ("multi-tenant", "multi-turn", "no-reuse", "many-tenants", "bursty-tenants"),
    "held-out": ("hot-tenant", "long-output", "small-kv", "deep-chat", "mixed-lengths"),
    "held-out-2": ("small-kv-turns",),
    "held-out-3": ("skewed-tenants",),
    "held-out-4": ("agent-sessions", "shifting-tenants", "user-documents"),
    "mixed-hardware": ("mixed-speed", "mixed-speed-no-reuse", "mixed-generations", "mixed-kv"),
}


def parse_shape(text: str) -> WorkloadShape:
    """A named shape, or `KIND:knob=value,...` (a base shape of that kind with those knobs); ValueError names the
    problem."""
    if ":" not in text:
        if text not in SHAPES:
            raise ValueError(f"unknown workload {text!r}; known: {', '.join(SHAPES)}")
        return SHAPES[text]
    base, _, spec = text.partition(":")
    if base not in SHAPES:
        raise ValueError(f"unknown workload {base!r} in {text!r}; known: {', '.join(SHAPES)}")
    types = {f.name: f.type for f in fields(WorkloadShape)}
    knobs: dict = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in types or key in ("name", "what", "kind"):
            raise ValueError(f"{text!r}: {item!r} is not knob=value; knobs: "
                             f"{', '.join(k for k in types if k not in ('name', 'what', 'kind'))}")
        try:
            knobs[key] = float(value) if "float" in str(types[key]) else int(value)
        except ValueError:
            raise ValueError(f"{text!r}: {key} needs a number, got {value!r}") from None
    shape = SHAPES[base]
    return replace(shape, name=text, what=f"{shape.what}; {spec}", kind=shape.generator, **knobs)


@dataclass(frozen=True)
class BenchRequest:
    at: float  # seconds after the run's start
    prompt: str
    key: str  # tenant/user or conversation/turn: which prefix it reuses
    max_tokens: int = 32
    foreign: int | None = None  # the replica another gateway sends it to (not the router under test); None: ours
    ttft_objective_ms: float = 0.0  # sent as x-slo-ttft-ms when > 0


def _length(rng: random.Random, mean: int, spread: float) -> int:
    """`mean`, or with a spread a lognormal draw whose mean is `mean`, kept within MAX_LENGTH_FACTOR of it."""
    if spread <= 0 or mean <= 0:
        return mean
    drawn = mean * np.exp(rng.gauss(-spread * spread / 2, spread))
    return int(round(min(max(drawn, mean / MAX_LENGTH_FACTOR), mean * MAX_LENGTH_FACTOR))) or 1


def prompts(shape: WorkloadShape, n: int, seed: int) -> list[tuple[str, str]]:
    """`n` (key, prompt) pairs in arrival order."""
    rng = random.Random(seed)
    kind = shape.generator
    if kind == "multi-tenant":
        systems = [random_text(rng, shape.system_len) for _ in range(shape.tenants)]
        contexts = [[random_text(rng, shape.user_context_len) for _ in range(shape.users_per_tenant)]
                    for _ in range(shape.tenants)]
        weights = [1.0 / (i + 1) ** shape.tenant_skew for i in range(shape.tenants)] if shape.tenant_skew else None
        out = []
        for i in range(n):
            t = rng.choices(range(shape.tenants), weights)[0] if weights else rng.randrange(shape.tenants)
            if shape.skew_rotate_every:  # the draw is a rank; the tenant holding it moves on every N requests
                t = (t + i // shape.skew_rotate_every) % shape.tenants
            u = rng.randrange(shape.users_per_tenant)
            question = random_text(rng, _length(rng, shape.question_len, shape.length_spread))
            out.append((f"t{t}/u{u}", systems[t] + contexts[t][u] + question))
        return out
    if kind == "multi-turn":
        histories = [random_text(rng, shape.system_len) for _ in range(shape.conversations)]
        turns = [0] * shape.conversations
        out = []
        for _ in range(n):
            c = rng.randrange(shape.conversations)
            if turns[c] == shape.max_turns:  # finished: a new conversation takes its place
                histories[c], turns[c] = random_text(rng, shape.system_len), 0
            prompt = histories[c] + random_text(rng, _length(rng, shape.question_len, shape.length_spread))
            out.append((f"c{c}/turn{turns[c]}", prompt))
            histories[c] = prompt + random_text(rng, shape.reply_len)
            turns[c] += 1
        return out
    return [(f"r{i}", random_text(rng, _length(rng, shape.prompt_len, shape.length_spread))) for i in range(n)]


def output_lengths(shape: WorkloadShape, n: int, seed: int) -> list[int]:
    """Each request's max_tokens (its own generator: the prompts do not change with the output knobs)."""
    rng = random.Random(f"output-{seed}")
    return [_length(rng, shape.output_len, shape.output_spread) for _ in range(n)]


def arrival_times(shape: WorkloadShape, rate: float, duration_s: float, seed: int) -> np.ndarray:
    """Arrival times at `rate` per second for `duration_s`: Poisson (burstiness 1), else gaps drawn from a Gamma
    distribution with the same mean and a coefficient of variation of `burstiness`."""
    size = max(1, int(rate * duration_s * 2) + 16)
    gen = np.random.default_rng(seed)
    k = 1.0 / shape.burstiness ** 2

    def gaps() -> np.ndarray:
        if shape.burstiness == 1.0:
            return gen.exponential(1.0 / rate, size=size)
        return gen.gamma(k, 1.0 / (rate * k), size=size)

    times = np.cumsum(gaps())
    while times[-1] <= duration_s:  # bursty gaps may fall short of the duration: draw on
        times = np.concatenate([times, times[-1] + np.cumsum(gaps())])
    return times[times <= duration_s] if times[0] <= duration_s else times[:1]


def arrivals(shape: WorkloadShape, rate: float, duration_s: float, seed: int) -> list[BenchRequest]:
    """The requests of one cell; the prompts depend on the seed only (not the rate), so every rate sends the same
    prompts in the same order, just faster."""
    times = arrival_times(shape, rate, duration_s, seed)
    outputs = output_lengths(shape, len(times), seed)
    stating = random.Random(f"objective-{seed}")
    objectives = [shape.ttft_objective_ms if stating.random() < shape.objective_share else 0.0 for _ in times]
    return [BenchRequest(float(at), prompt, key, max_tokens, ttft_objective_ms=objective)
            for at, (key, prompt), max_tokens, objective in zip(times, prompts(shape, len(times), seed), outputs,
                                                                  objectives)]


FOREIGN_KEY_CHARS = 256


def with_foreign(requests: list[BenchRequest], share: float, replicas: int, seed: int) -> list[BenchRequest]:
    """`requests` with a `share` of them (each with probability `share`, from `seed`) sent by a foreign gateway
    to replica xxh3(prompt[:FOREIGN_KEY_CHARS]) mod `replicas`."""
    if share <= 0:
        return requests
    rng = random.Random(f"foreign-{seed}")
    return [replace(r, foreign=xxhash.xxh3_64_intdigest(r.prompt[:FOREIGN_KEY_CHARS].encode()) % replicas)
            if rng.random() < share else r for r in requests]
