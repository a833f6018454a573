"""precise-prefix-cache-scorer: prefix affinity from what each engine really caches (llm-d's name and idea).

Each endpoint's engine publishes KV-cache events (vLLM's format, `kvgate serve --kv-events-config`); the EPP
subscribes per endpoint (epp/kv_events/subscriber.py) and keeps an index of the blocks each one holds, keyed by
hashes of token-id blocks it computes itself (epp/prefix/precise_index.py). A request is tokenized in the EPP as the
engine would (epp/kv_events/tokenize.py) and hashed the same way, in blocks of the endpoint's engine block size
(from its events; else its scraped `kv_block_size`; else `blockSize`). Then, per endpoint e:

    n          = prompt tokens (exact)
    blocks(e)  = leading prompt blocks e holds, of the first ⌊(n - 1) / block_size⌋ (the engine always computes
                 the last prompt token, so it never reuses more: engine/kv_cache_manager.py)
    cached(e)  = blocks(e) × block_size                      (PrefixMatchSource.cached_tokens)
    score(e)   = cached(e) / n                               in [0, 1)

`pre_request` holds the picked endpoint's blocks of the prompt (speculative entries, epp/prefix/request_holds.py)
until the engine's events announce them, else while the request is in flight (at most `maxSpeculativeHold`,
default 60 s) and `speculativeTTL` seconds (default 2 s) after its response ends. `remove_endpoint` drops the
endpoint's blocks, speculative ones included, and closes its event socket.

Long prompts. Only the first max_prefix_blocks × block size tokens can ever match (131072 by default), so only
a character prefix that surely holds them is tokenized (epp/kv_events/tokenize.py prefix_tokens: the ids kept
are exactly the whole prompt's). A prompt over INLINE_TOKENIZE_CHARS (8192) characters is tokenized before the
decision by `prepare` (Director.prepare, awaited by the ext-proc stream), in this plugin's two threads, within
`tokenizeTimeout` seconds (default 0.5): no other decision waits meanwhile. Past the budget, that request alone
is scored by an approximate prefix-cache-scorer (characters; fed with the picks of long prompts, in 1/16 of
`indexMaxBytes`), and `kvgate_epp_kv_events_total{event="tokenize_timeouts"}` counts it: small decisions
meanwhile wait at most for the big body's JSON parse (tests/epp/test_tokenize_budget.py bounds it). Token ids outside [0, 2^31) never get here: the request is
refused with a 400 where it enters (epp/request_parsing.py).

PrefixMatchSource (epp/scheduling/prefix_match.py): `prompt_tokens` is the exact token count (the tokenizer's;
estimated from the characters per token of the part tokenized for a prompt past the limit, and len(prompt)/4
when the request cannot be tokenized, e.g. several prompts, or when it degraded); `cached_tokens`
is cached(e) above, 0 for endpoints without events. Both are computed once per cycle (tokens, hashes and the
index match are memoized in the CycleState under this plugin) and reused by `score` and `pre_request`.

Cost per request, on the EPP's loop (best of 200, shared 2-core box; tests/epp/test_precise_scorer.py
::test_tokenize_and_hash_cost prints the first three): a 1k-token prompt with the byte tokenizer costs
~240 µs to tokenize (a chat ~310 µs with its template), ~30 µs to hash its 63 blocks, ~290 µs for the whole
score; a BPE tokenizer (8k vocabulary, trained locally) took ~1 ms for 800 tokens. The engine's render
endpoint gives the same ids but took ~31 ms per call (median, loopback, engines busy;
tests/epp/test_precise_serve.py prints it), 30-100× more: the EPP tokenizes locally.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from kvgate.epp.kv_events.tokenize import PromptTokens
from kvgate.epp.prefix.approx_index import MIN_INDEX_BYTES
from kvgate.epp.prefix.hashing import chain, root_hash
from kvgate.epp.prefix.precise_index import Delta, PreciseIndex
from kvgate.epp.prefix.request_holds import RequestHolds
from kvgate.epp.scheduling.framework import CycleState, PluginContext, Scorer
from kvgate.epp.scheduling.plugins._params import check_keys, float_param, int_param
from kvgate.epp.scheduling.plugins.prefix_cache_scorer import PrefixCacheScorer
from kvgate.epp.types import EndpointState, LLMRequest

DEFAULT_BLOCK_SIZE = 16  # kvgate's and vLLM's default KV block size, in tokens
DEFAULT_SPECULATIVE_TTL_S = 2.0
DEFAULT_MAX_SPECULATIVE_HOLD_S = 60.0  # an in-flight request's entries at most (its response end shortens it)
DEFAULT_MAX_PREFIX_BLOCKS = 8192
DEFAULT_MAX_SPECULATIVE = 100_000
DEFAULT_INDEX_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_TOKENIZE_TIMEOUT_S = 0.5
INLINE_TOKENIZE_CHARS = 8192  # longer prompts are tokenized off the event loop (≲ 5 ms of work inline)
TOKENIZE_THREADS = 2  # what a burst of long prompts may take of the EPP's CPU
_DEGRADED = object()  # request.prepared[scorer]: not tokenized within tokenizeTimeout


@dataclass
class _Match:
    """One request's work, memoized in the cycle."""

    tokens: PromptTokens | None
    prompt_tokens: int
    root: int
    degraded: bool = False  # the approximate scorer answers for this request
    hashes: dict[int, list[int]] = field(default_factory=dict)  # block size → chain
    matched: dict[int, dict[str, int]] = field(default_factory=dict)  # block size → {address: blocks}


class PrecisePrefixCacheScorer(Scorer):
    type_name = "precise-prefix-cache-scorer"
    stats_group = "kv_events"

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S,
                 tokenizer: str | None = None, max_prefix_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS,
                 index_max_bytes: int = DEFAULT_INDEX_MAX_BYTES,
                 max_speculative: int = DEFAULT_MAX_SPECULATIVE,
                 max_speculative_hold_s: float = DEFAULT_MAX_SPECULATIVE_HOLD_S,
                 tokenize_timeout_s: float = DEFAULT_TOKENIZE_TIMEOUT_S) -> None:
        super().__init__()
        self.tokenize_timeout_s = tokenize_timeout_s
        self._pool: ThreadPoolExecutor | None = None
        self.tokenize_timeouts = 0
        # What a long prompt's decision degrades to: approximate prefix affinity (characters), fed with the picks
        # of long prompts only (the only ones that can degrade), in a sixteenth of the index's budget.
        self.approximate = PrefixCacheScorer(index_max_bytes=max(MIN_INDEX_BYTES, index_max_bytes // 16))
        self.max_speculative_hold_s = max_speculative_hold_s
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.index_max_bytes = index_max_bytes
        self.tokenizer_path = tokenizer
        self._tokenizer = None
        self.index = PreciseIndex(speculative_ttl_s, max_speculative)
        self._held = RequestHolds(self.index, max_speculative_hold_s)  # picks in flight
        self.subscriber = None
        self._sources: dict[str, object] = {}  # address → its EventSource, while subscribed
        self._event_sources = None  # PluginContext.kv_event_sources: the pool's endpoints → their sources

    # -- lifecycle (framework.Plugin) -------------------------------------------------------------------------------

    def start(self, ctx: PluginContext) -> None:
        """Take the EPP's options, load the tokenizer (a bad path fails the start, not the first request) and, with
        a way back onto the scheduler's thread, start the KV-event subscriber."""
        if ctx.prefix_index_max_bytes is not None:
            self.index_max_bytes = ctx.prefix_index_max_bytes
        self.load_tokenizer(ctx.tokenizer)
        self._event_sources = ctx.kv_event_sources
        if ctx.deliver is not None and self.subscriber is None:
            from kvgate.epp.kv_events.subscriber import KVEventSubscriber

            # deliver(fn, deltas) runs fn(deltas) on the scheduler's thread (the EPP's loop.call_soon_threadsafe)
            self.subscriber = KVEventSubscriber(lambda deltas: ctx.deliver(self.apply_deltas, deltas),
                                                self.index_max_bytes)

    def set_endpoints(self, endpoints) -> None:
        if self._event_sources is not None:
            self.set_sources(self._event_sources(endpoints))

    def stop(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
            self.subscriber = None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # -- tokenizer ------------------------------------------------------------------------------------------------

    def load_tokenizer(self, path: str | None = None) -> None:
        """Load now (the EPP's start: a bad path fails there, not on the first request)."""
        from kvgate.epp.kv_events.tokenize import PromptTokenizer

        if path:
            self.tokenizer_path = path
        self._tokenizer = PromptTokenizer(self.tokenizer_path)

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self.load_tokenizer()
        return self._tokenizer

    def _token_limit(self) -> int:
        """The most prompt tokens any endpoint's match can use: max_prefix_blocks of the largest block size known
        (an endpoint with larger blocks, known only from its scrape, matches fewer: a shorter hit, never a
        wrong one)."""
        return self.max_prefix_blocks * max([self.block_size, *self.index.block_sizes.values()])

    @staticmethod
    def _long(request: LLMRequest) -> bool:
        """Text long enough to tokenize off the loop (token-id prompts need no tokenizing)."""
        body = request.body
        if isinstance(body, Mapping) and isinstance(body.get("prompt"), list) and body["prompt"] \
                and type(body["prompt"][0]) is int:
            return False
        return len(request.prompt) > INLINE_TOKENIZE_CHARS

    def needs_prepare(self, request: LLMRequest) -> bool:
        return self._long(request) and self not in request.prepared

    async def prepare(self, request: LLMRequest) -> None:
        """Tokenize a long prompt's prefix in this plugin's threads, within tokenizeTimeout; past it the request
        is scored by the approximate scorer (`_DEGRADED`), and no other decision waited meanwhile."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="kvgate-epp-tokenize")
        future = asyncio.get_running_loop().run_in_executor(self._pool, self.tokenizer.prefix_tokens, request,
                                                            self._token_limit())
        try:
            request.prepared[self] = await asyncio.wait_for(future, self.tokenize_timeout_s)
        except asyncio.TimeoutError:  # (a queued call is cancelled; a running one finishes unused)
            request.prepared[self] = _DEGRADED
            self.tokenize_timeouts += 1

    # -- events ---------------------------------------------------------------------------------------------------

    def apply_deltas(self, deltas: list[Delta]) -> None:
        for delta in deltas:
            self.index.apply(delta)

    def set_sources(self, sources) -> None:
        """The pool's event sources now (EventSource per endpoint that publishes events); new or changed ones
        are subscribed. Endpoints leaving the pool are dropped by remove_endpoint."""
        if self.subscriber is None:
            return
        for source in sources:
            if self._sources.get(source.address) != source:
                generation = self.subscriber.next_generation()
                self.index.watch(source.address, generation)
                self.subscriber.subscribe(source, generation)
                self._sources[source.address] = source

    def remove_endpoint(self, address: str) -> None:
        self.index.remove(address)
        self.approximate.remove_endpoint(address)
        self._held.forget_endpoint(address)
        if self._sources.pop(address, None) is not None and self.subscriber is not None:
            self.subscriber.unsubscribe(address)

    # -- the math -------------------------------------------------------------------------------------------------

    def _analysis(self, request: LLMRequest, cycle: CycleState | None) -> _Match:
        found = cycle.get(self) if cycle is not None else None
        if found is None:
            if self in request.prepared:
                tokens = request.prepared[self]
            else:  # short, or a caller without Director.prepare: bounded work, here
                tokens = self.tokenizer.prefix_tokens(request, self._token_limit())
            lora = request.target_model if request.target_model in self.index.loras else None
            root = root_hash(lora, request.cache_salt)
            if tokens is _DEGRADED:
                found = _Match(None, self.approximate.prompt_tokens(request), root, degraded=True)
            else:
                found = _Match(tokens, tokens.count if tokens is not None else request.estimated_prompt_tokens,
                               root)
            if cycle is not None:
                cycle[self] = found
        return found

    def block_size_of(self, endpoint: EndpointState) -> int:
        return (self.index.block_sizes.get(endpoint.address) or endpoint.metrics.kv_block_size
                or self.block_size)

    def _hashes(self, m: _Match, block_size: int) -> list[int]:
        hashes = m.hashes.get(block_size)
        if hashes is None:
            ids = m.tokens.ids if m.tokens is not None else []
            # the engine always computes a prompt's last token; a cut prompt goes on past its last full block
            usable = max(0, (len(ids) - 1) // block_size if m.tokens.complete else len(ids) // block_size) \
                if ids else 0
            hashes = m.hashes[block_size] = chain(ids[:usable * block_size], block_size, m.root,
                                                  self.max_prefix_blocks) if usable else []
        return hashes

    def _matched(self, m: _Match, block_size: int) -> dict[str, int]:
        found = m.matched.get(block_size)
        if found is None:
            found = m.matched[block_size] = self.index.match(self._hashes(m, block_size))
        return found

    def prompt_tokens(self, request: LLMRequest, cycle: CycleState | None) -> int:
        return self._analysis(request, cycle).prompt_tokens

    def cached_tokens(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None
                      ) -> np.ndarray:
        self._held.sweep()
        m = self._analysis(request, cycle)
        if m.degraded:
            return self.approximate.cached_tokens(request, endpoints, cycle)
        out = np.zeros(len(endpoints))
        if m.tokens is None:
            return out
        for i, e in enumerate(endpoints):
            bs = self.block_size_of(e)
            out[i] = self._matched(m, bs).get(e.address, 0) * bs
        return out

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> np.ndarray:
        if cycle is None:
            cycle = CycleState()
        if self._analysis(request, cycle).degraded:
            return self.approximate.score(request, endpoints, cycle)
        cached = self.cached_tokens(request, endpoints, cycle)
        return cached / max(1, self.prompt_tokens(request, cycle))

    def pre_request(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None) -> None:
        if self._long(request):  # for the next long prompt that degrades
            self.approximate.pre_request(request, endpoint, cycle)
        m = self._analysis(request, cycle)
        if m.tokens is None or self.index.speculative_ttl_s <= 0:
            return
        hashes = self._hashes(m, self.block_size_of(endpoint))
        if self.max_speculative_hold_s <= 0:  # no holding: the TTL from the pick
            self.index.add_speculative(hashes, endpoint.address)
            return
        self._held.hold(request.request_id, hashes, endpoint.address)

    def response_complete(self, request: LLMRequest, endpoint_address: str, prompt_tokens: int,
                          completion_tokens: int) -> None:
        self._held.end(request.request_id)

    def stats(self) -> dict[str, float]:
        out = {"index_size": self.index.size(), "speculative_entries": self.index.speculative_size(),
               "subscribed_endpoints": len(self._sources), "tokenize_timeouts": self.tokenize_timeouts}
        if self.subscriber is not None:
            out.update(self.subscriber.stats)
        return out


def _seconds(params, key: str, default: float, t: str) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 3600:
        raise ValueError(f"{t}: parameter {key} must be a number of seconds in [0, 3600], got {value!r}")
    return float(value)


def factory(parameters: dict | None) -> PrecisePrefixCacheScorer:
    t = PrecisePrefixCacheScorer.type_name
    params = check_keys(parameters, {"blockSize", "speculativeTTL", "tokenizer", "maxPrefixBlocksToMatch",
                                     "indexMaxBytes", "maxSpeculativeEntries", "maxSpeculativeHold",
                                     "tokenizeTimeout"}, t)
    tokenizer = params.get("tokenizer")
    if tokenizer is not None and (not isinstance(tokenizer, str) or not tokenizer):
        raise ValueError(f"{t}: parameter tokenizer must be a folder path (the model's tokenizer files), "
                         f"got {tokenizer!r}")
    return PrecisePrefixCacheScorer(
        block_size=int_param(params, "blockSize", DEFAULT_BLOCK_SIZE, t, minimum=1),
        speculative_ttl_s=_seconds(params, "speculativeTTL", DEFAULT_SPECULATIVE_TTL_S, t),
        tokenizer=tokenizer,
        max_prefix_blocks=int_param(params, "maxPrefixBlocksToMatch", DEFAULT_MAX_PREFIX_BLOCKS, t, minimum=1),
        index_max_bytes=int_param(params, "indexMaxBytes", DEFAULT_INDEX_MAX_BYTES, t, minimum=64 * 1024),
        max_speculative=int_param(params, "maxSpeculativeEntries", DEFAULT_MAX_SPECULATIVE, t, minimum=1),
        max_speculative_hold_s=_seconds(params, "maxSpeculativeHold", DEFAULT_MAX_SPECULATIVE_HOLD_S, t),
        tokenize_timeout_s=float_param(params, "tokenizeTimeout", DEFAULT_TOKENIZE_TIMEOUT_S, t, maximum=60,
                                       min_inclusive=False),
    )
