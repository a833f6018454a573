"""precise-prefix-cache-scorer: prefix affinity from what each engine really caches (llm-d's name and idea).

Each endpoint's engine publishes KV-cache events (vLLM's format, `kvgate serve --kv-events-config`); the EPP
subscribes per endpoint (epp/kv_events/subscriber.py) and keeps an index of the blocks each one holds, keyed by
hashes of token-id blocks it computes itself (epp/kv_events/index.py). A request is tokenized in the EPP as the
engine would (epp/kv_events/tokenize.py) and hashed the same way, in blocks of the endpoint's engine block size
(from its events; else its scraped `kv_block_size`; else `blockSize`). Then, per endpoint e:

    n          = prompt tokens (exact)
    blocks(e)  = leading prompt blocks e holds, of the first ⌊(n - 1) / block_size⌋ (the engine always computes
                 the last prompt token, so it never reuses more: engine/kv_cache_manager.py)
    cached(e)  = blocks(e) × block_size                      (PrefixMatchSource.cached_tokens)
    score(e)   = cached(e) / n                               in [0, 1)

`pre_request` marks the picked endpoint's blocks of the prompt as held (speculative entries): the engine
announces blocks only once it has prefilled them, and a burst to a fresh prefix must not spread over the pool
meanwhile. A block counts until the engine's events announce it (from then on they decide: an eviction while
the request still decodes counts at once), else while the request is in flight (at most `maxSpeculativeHold`,
default 60 s) and `speculativeTTL` seconds (default 2 s) after its response ends:

    held until  the block's BlockStored,  or  min(pick + maxSpeculativeHold, response end) + speculativeTTL

A fixed TTL from the pick is not enough under load: at 24 req/s on the bench's 4 replicas a request waited
3-5 s in the engine's queue before its prefill, the 2 s entries expired before the events came, the prefix
looked cold, the queue scorer spread it, and precise fell behind approximate (whose history never forgets):
TTFT p90 5.8 vs 3.1 s, hit rate 59% vs 66% (`kvgate bench routing --workloads multi-tenant --rates 24
--duration 20 --seed 0`, llm-d's precise weights; 2.2 s with the hold). `remove_endpoint` drops the endpoint's
blocks, speculative ones included, and closes its event socket.

PrefixMatchSource (epp/scheduling/prefix_match.py): `prompt_tokens` is the exact token count (the tokenizer's;
an estimate of len(prompt)/4 only when the request cannot be tokenized, e.g. several prompts); `cached_tokens`
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

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from kvgate.epp.kv_events.index import Delta, PreciseIndex, chain, root_hash
from kvgate.epp.scheduling.framework import CycleState, Scorer
from kvgate.epp.scheduling.plugins._params import check_keys, int_param
from kvgate.epp.types import EndpointState, LLMRequest

DEFAULT_BLOCK_SIZE = 16  # kvgate's and vLLM's default KV block size, in tokens
DEFAULT_SPECULATIVE_TTL_S = 2.0
DEFAULT_MAX_SPECULATIVE_HOLD_S = 60.0  # an in-flight request's entries at most (its response end shortens it)
DEFAULT_MAX_PREFIX_BLOCKS = 8192
DEFAULT_MAX_SPECULATIVE = 100_000
DEFAULT_INDEX_MAX_BYTES = 256 * 1024 * 1024


@dataclass
class _Match:
    """One request's work, memoized in the cycle."""

    tokens: list[int] | None
    prompt_tokens: int
    root: int
    hashes: dict[int, list[int]] = field(default_factory=dict)  # block size → chain
    matched: dict[int, dict[str, int]] = field(default_factory=dict)  # block size → {address: blocks}


class PrecisePrefixCacheScorer(Scorer):
    type_name = "precise-prefix-cache-scorer"

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, speculative_ttl_s: float = DEFAULT_SPECULATIVE_TTL_S,
                 tokenizer: str | None = None, max_prefix_blocks: int = DEFAULT_MAX_PREFIX_BLOCKS,
                 index_max_bytes: int = DEFAULT_INDEX_MAX_BYTES,
                 max_speculative: int = DEFAULT_MAX_SPECULATIVE,
                 max_speculative_hold_s: float = DEFAULT_MAX_SPECULATIVE_HOLD_S) -> None:
        super().__init__()
        self.max_speculative_hold_s = max_speculative_hold_s
        # request id → (picked at, its block hashes, the endpoint), in pick order: held until the response ends
        self._held: OrderedDict[str, tuple[float, list[int], str]] = OrderedDict()
        self._held_blocks = 0
        self.block_size = block_size
        self.max_prefix_blocks = max_prefix_blocks
        self.index_max_bytes = index_max_bytes
        self.tokenizer_path = tokenizer
        self._tokenizer = None
        self.index = PreciseIndex(speculative_ttl_s, max_speculative)
        self.subscriber = None
        self._sources: dict[str, object] = {}  # address → its EventSource, while subscribed

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

    # -- events ---------------------------------------------------------------------------------------------------

    def start_events(self, deliver) -> None:
        """Start the subscriber thread; `deliver(fn, deltas)` must run fn(deltas) on the scheduler's thread
        (the EPP passes loop.call_soon_threadsafe)."""
        from kvgate.epp.kv_events.subscriber import KVEventSubscriber

        if self.subscriber is None:
            self.subscriber = KVEventSubscriber(lambda deltas: deliver(self.apply_deltas, deltas),
                                                self.index_max_bytes)

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

    def stop_events(self) -> None:
        if self.subscriber is not None:
            self.subscriber.close()
            self.subscriber = None

    def remove_endpoint(self, address: str) -> None:
        self.index.remove(address)
        for rid in [rid for rid, (_, _, a) in self._held.items() if a == address]:
            self._held_blocks -= len(self._held.pop(rid)[1])  # remove() dropped the index's side
        if self._sources.pop(address, None) is not None and self.subscriber is not None:
            self.subscriber.unsubscribe(address)

    # -- the math -------------------------------------------------------------------------------------------------

    def _analysis(self, request: LLMRequest, cycle: CycleState | None) -> _Match:
        found = cycle.get(self) if cycle is not None else None
        if found is None:
            tokens = self.tokenizer.tokens(request)
            lora = request.target_model if request.target_model in self.index.loras else None
            found = _Match(tokens, len(tokens) if tokens is not None else request.estimated_prompt_tokens,
                           root_hash(lora, request.cache_salt))
            if cycle is not None:
                cycle[self] = found
        return found

    def block_size_of(self, endpoint: EndpointState) -> int:
        return (self.index.block_sizes.get(endpoint.address) or endpoint.metrics.kv_block_size
                or self.block_size)

    def _hashes(self, m: _Match, block_size: int) -> list[int]:
        hashes = m.hashes.get(block_size)
        if hashes is None:
            usable = max(0, (len(m.tokens) - 1) // block_size) if m.tokens else 0
            hashes = m.hashes[block_size] = chain(m.tokens[:usable * block_size], block_size, m.root,
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
        self._sweep()
        m = self._analysis(request, cycle)
        out = np.zeros(len(endpoints))
        if not m.tokens:
            return out
        for i, e in enumerate(endpoints):
            bs = self.block_size_of(e)
            out[i] = self._matched(m, bs).get(e.address, 0) * bs
        return out

    def score(self, request: LLMRequest, endpoints: list[EndpointState], cycle: CycleState | None = None
              ) -> np.ndarray:
        if cycle is None:
            cycle = CycleState()
        cached = self.cached_tokens(request, endpoints, cycle)
        return cached / max(1, self.prompt_tokens(request, cycle))

    def pre_request(self, request: LLMRequest, endpoint: EndpointState, cycle: CycleState | None = None) -> None:
        m = self._analysis(request, cycle)
        if not m.tokens or self.index.speculative_ttl_s <= 0:
            return
        hashes = self._hashes(m, self.block_size_of(endpoint))
        if self.max_speculative_hold_s <= 0:  # no holding: the TTL from the pick
            self.index.add_speculative(hashes, endpoint.address)
            return
        self.index.hold(hashes, endpoint.address)
        old = self._held.pop(request.request_id, None)  # the same request picked again (a retry): one hold
        if old is not None:
            self._release(old)
        self._held[request.request_id] = (self.index.clock(), hashes, endpoint.address)
        self._held_blocks += len(hashes)
        self._sweep()

    def response_complete(self, request: LLMRequest, endpoint_address: str, prompt_tokens: int,
                          completion_tokens: int) -> None:
        held = self._held.pop(request.request_id, None)
        if held is not None:  # prefilled by now: the events confirm (or remove) its blocks within the TTL
            self._release(held)

    def _release(self, held: tuple[float, list[int], str], ended_at: float | None = None) -> None:
        self._held_blocks -= len(held[1])
        self.index.release(held[1], held[2], ended_at)

    def _sweep(self) -> None:
        """Holds end at maxSpeculativeHold, and the oldest go first past maxSpeculativeEntries held blocks."""
        held = self._held
        if not held:
            return
        oldest = self.index.clock() - self.max_speculative_hold_s
        while held:
            picked_at = next(iter(held.values()))[0]
            if picked_at <= oldest:  # the hold ran out at pick + maxSpeculativeHold
                self._release(held.popitem(last=False)[1], picked_at + self.max_speculative_hold_s)
            elif self._held_blocks > self.index.max_speculative:
                self._release(held.popitem(last=False)[1])
            else:
                break

    def stats(self) -> dict[str, float]:
        out = {"index_size": self.index.size(), "speculative_entries": self.index.speculative_size(),
               "subscribed_endpoints": len(self._sources)}
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
                                     "indexMaxBytes", "maxSpeculativeEntries", "maxSpeculativeHold"}, t)
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
    )
