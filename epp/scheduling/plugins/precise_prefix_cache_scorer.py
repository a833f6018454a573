"""precise-prefix-cache-scorer: prefix affinity from what each engine really caches (llm-d's name and idea).

Each endpoint's engine publishes KV-cache events (vLLM's format, `kvgate serve --kv-events-config`); the EPP
subscribes per endpoint (epp/kv_events/subscriber.py) and keeps an index of the blocks each one holds, keyed by
hashes of token-id blocks it computes itself (epp/prefix/precise_index.py). A request is tokenized in the EPP as the
engine would (epp/kv_events/tokenize.py) and hashed the same way, in blocks of the endpoint's engine block size
(from its events; else its scraped `kv_block_size`; else `blockSize`). Then, per endpoint e:

    n          = prompt tokens (exact)
    blocks(e)  = leading prompt blocks e holds, of the first ⌊(n - 1) / block_size⌋ (the engine always computes
                 the last prompt token, so it never reuses more: engine/kv_cache_manager.py)
    cached(e)  = blocks(e) × block_size                      (PrefixMatch.cached)
    score(e)   = cached(e) / n                               in [0, 1)

`pre_request` holds the picked endpoint's blocks of the prompt (speculative entries, epp/prefix/request_holds.py)
until the engine's events announce them, else while the request is in flight (at most `maxSpeculativeHold`,
default 60 s) and `speculativeTTL` seconds (default 2 s) after its response ends. `remove_endpoint` drops the
endpoint's blocks, speculative ones included, and closes its event socket.

Where the parts live: the events into the index, epp/kv_events/feed.py (started, fed endpoints and stopped through
the plugin lifecycle); tokens within a time budget, epp/prefix/budgeted_tokenizer.py; the index and the holds,
epp/prefix/. This plugin matches, scores and records.

Long prompts. Only the first max_prefix_blocks × block size tokens can ever match (131072 by default), so only
a character prefix that surely holds them is tokenized. A long prompt is tokenized before the decision by
`prepare` (Director.prepare, awaited by the ext-proc stream), off the event loop, within `tokenizeTimeout` seconds
(default 0.5); past the budget, that request alone is scored by an approximate prefix-cache-scorer (characters;
fed with the picks of long prompts, in 1/16 of `indexMaxBytes`), and
`kvgate_epp_kv_events_total{event="tokenize_timeouts"}` counts it (tests/epp/test_tokenize_budget.py bounds what
other decisions wait meanwhile). Token ids outside [0, 2^31) never get here: the request is refused with a 400
where it enters (epp/request_parsing.py).

It produces the cycle's prefix match (PREFIX_MATCH, epp/scheduling/prefix_match.py): `prompt_tokens` is the exact token count (the tokenizer's;
estimated from the characters per token of the part tokenized for a prompt past the limit, and len(prompt)/4
when the request cannot be tokenized, e.g. several prompts, or when it degraded); `cached`
is cached(e) above, 0 for endpoints without events. Both are computed once per cycle (tokens, hashes and the
index match are memoized in the CycleState under this plugin) and reused by `score` and `pre_request`.

Cost per request, on the EPP's loop: tokenizing the prompt dominates, hashing its blocks and matching them are a
small part (tests/epp/test_precise_scorer.py::test_tokenize_and_hash_cost prints each). The engine's render
endpoint gives the same ids, but an HTTP round trip to a busy engine costs far more than tokenizing in-process
(tests/epp/test_precise_serve.py prints it): the EPP tokenizes locally.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from kvgate.epp.kv_events.feed import EventFeed
from kvgate.epp.kv_events.tokenize import PromptTokens
from kvgate.epp.prefix.approx_index import MIN_INDEX_BYTES
from kvgate.epp.prefix.budgeted_tokenizer import DEGRADED, BudgetedTokenizer
from kvgate.epp.prefix.hashing import chain, root_hash
from kvgate.epp.prefix.precise_index import PreciseIndex
from kvgate.epp.prefix.request_holds import RequestHolds
from kvgate.epp.scheduling.framework import CycleState, PluginContext, Scorer
from kvgate.epp.scheduling.plugins._params import check_keys, float_param, int_param
from kvgate.epp.scheduling.plugins.prefix_cache_scorer import PrefixCacheScorer
from kvgate.epp.scheduling.prefix_match import PREFIX_MATCH, PrefixMatch
from kvgate.epp.types import EndpointState, LLMRequest

DEFAULT_BLOCK_SIZE = 16  # kvgate's and vLLM's default KV block size, in tokens
DEFAULT_SPECULATIVE_TTL_S = 2.0
DEFAULT_MAX_SPECULATIVE_HOLD_S = 60.0  # an in-flight request's entries at most (its response end shortens it)
DEFAULT_MAX_PREFIX_BLOCKS = 8192
DEFAULT_MAX_SPECULATIVE = 100_000
DEFAULT_INDEX_MAX_BYTES = 256 * 1024 * 1024
DEFAULT_TOKENIZE_TIMEOUT_S = 0.5
_PEER = "\0peer:"  # a peer's pick in RequestHolds: never a request id of this replica's (those come from headers)


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
    produces = (PREFIX_MATCH,)  # from the same tokens, hashes and index match as its score

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S,
                 tokenizer: str | None = None, max_prefix_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS,
                 index_max_bytes: int = DEFAULT_INDEX_MAX_BYTES,
                 max_speculative: int = DEFAULT_MAX_SPECULATIVE,
                 max_speculative_hold_s: float = DEFAULT_MAX_SPECULATIVE_HOLD_S,
                 tokenize_timeout_s: float = DEFAULT_TOKENIZE_TIMEOUT_S) -> None:
        super().__init__()
        # What a long prompt's decision degrades to: approximate prefix affinity (characters), fed with the picks
        # of long prompts only (the only ones that can degrade), in a sixteenth of the index's budget.
        self.approximate = PrefixCacheScorer(index_max_bytes=max(MIN_INDEX_BYTES, index_max_bytes // 16))
        self.max_speculative_hold_s = max_speculative_hold_s
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.index_max_bytes = index_max_bytes
        self.tokens = BudgetedTokenizer(tokenizer, tokenize_timeout_s)
        self.index = PreciseIndex(speculative_ttl_s, max_speculative)
        self._held = RequestHolds(self.index, max_speculative_hold_s)  # picks in flight
        self.feed = EventFeed(self.index)
        self._event_sources = None  # PluginContext.kv_event_sources: the pool's endpoints → their sources

    # -- lifecycle (framework.Plugin) -------------------------------------------------------------------------------

    def start(self, ctx: PluginContext) -> None:
        """Take the EPP's options, load the tokenizer (a bad path fails the start, not the first request) and, with
        a way back onto the scheduler's thread, start reading the engines' events."""
        if ctx.prefix_index_max_bytes is not None:
            self.index_max_bytes = ctx.prefix_index_max_bytes
        self.tokens.load(ctx.tokenizer)
        self._event_sources = ctx.kv_event_sources
        if ctx.deliver is not None:
            self.feed.start(ctx.deliver, self.index_max_bytes)

    def set_endpoints(self, endpoints) -> None:
        if self._event_sources is not None:
            self.set_sources(self._event_sources(endpoints))

    def set_sources(self, sources) -> None:
        """The pool's event sources now (an EventSource per endpoint that publishes events)."""
        self.feed.set_sources(sources)

    def remove_endpoint(self, address: str) -> None:
        self.index.remove(address)
        self.approximate.remove_endpoint(address)
        self._held.forget_endpoint(address)
        self.feed.remove(address)

    def stop(self) -> None:
        self.feed.stop()
        self.tokens.close()

    @property
    def subscriber(self):
        """The KV-event subscriber while started (its stats and streams, for tests and tools)."""
        return self.feed.subscriber

    # -- tokens ---------------------------------------------------------------------------------------------------

    def load_tokenizer(self, path: str | None = None) -> None:
        self.tokens.load(path)

    @property
    def tokenizer(self):
        return self.tokens.tokenizer

    @property
    def tokenizer_path(self) -> str | None:
        """The tokenizer folder configured (`tokenizer` parameter or --tokenizer); None: the EPP's default."""
        return self.tokens.path

    def _token_limit(self) -> int:
        """The most prompt tokens any endpoint's match can use: max_prefix_blocks of the largest block size known
        (an endpoint with larger blocks, known only from its scrape, matches fewer: a shorter hit, never a
        wrong one)."""
        return self.max_prefix_blocks * max([self.block_size, *self.index.block_sizes.values()])

    def needs_prepare(self, request: LLMRequest) -> bool:
        return self.tokens.is_long(request) and self not in request.prepared

    async def prepare(self, request: LLMRequest) -> None:
        """A long prompt's tokens within tokenizeTimeout (DEGRADED past it: the approximate scorer answers)."""
        request.prepared[self] = await self.tokens.tokenize_long(request, self._token_limit())

    # -- the math -------------------------------------------------------------------------------------------------

    def _analysis(self, request: LLMRequest, cycle: CycleState | None) -> _Match:
        found = cycle.get(self) if cycle is not None else None
        if found is None:
            if self in request.prepared:
                tokens = request.prepared[self]
            else:  # short, or a caller without Director.prepare: bounded work, here
                tokens = self.tokens.tokenize(request, self._token_limit())
            lora = request.target_model if request.target_model in self.index.loras else None
            root = root_hash(lora, request.cache_salt)
            if tokens is DEGRADED:
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

    def produce(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState) -> None:
        cycle.put(self, PREFIX_MATCH, PrefixMatch.over(self.prompt_tokens(request, cycle), endpoints,
                                                       self.cached_tokens(request, endpoints, cycle)))

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
        if self.tokens.is_long(request):  # for the next long prompt that degrades
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

    # Active-active (epp/peer_sync.py): a peer's pick holds its prompt's blocks here too, until its response ends,
    # so that a burst to a new prefix split over two replicas goes where the first pick went.
    def share_pick(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None
                   ) -> list[int] | None:
        m = self._analysis(request, cycle)
        if m.degraded or m.tokens is None or self.index.speculative_ttl_s <= 0:
            return None
        block_size = self.block_size_of(endpoint)
        hashes = self._hashes(m, block_size)
        return [block_size, *hashes] if hashes else None

    def peer_pick(self, pick_id: str, address: str, shared: list[int]) -> None:
        if self.index.speculative_ttl_s <= 0 or len(shared) < 2 or len(shared) > self.max_prefix_blocks + 1:
            return
        if self.index.block_sizes.get(address, shared[0]) != shared[0]:
            return  # blocks of another size than the endpoint's events announce: they could never match
        self._held.hold(_PEER + pick_id, shared[1:], address)

    def peer_done(self, pick_id: str, address: str) -> None:
        self._held.end(_PEER + pick_id)

    def stats(self) -> dict[str, float]:
        return {"index_size": self.index.size(), "speculative_entries": self.index.speculative_size(),
                "tokenize_timeouts": self.tokens.timeouts, **self.feed.stats()}


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
