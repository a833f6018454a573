"""Structured outputs: a request's output constrained to a JSON schema, any JSON object, a regex, a choice of
strings or a grammar, enforced by a token bitmask per step.

Each constrained request holds one `RequestGrammar` (an llguidance `LLMatcher`) on its `Request`. Before a
step samples, the runner fills one bitmask row per *constrained* row of the batch (unconstrained rows cost
nothing); the sampler sets the logits of disallowed tokens to -inf in those rows only, so constrained and
unconstrained requests share one batch and one forward pass. On an accelerator the torch runner fills the masks
in a thread while the forward pass runs (llguidance drops the GIL); on CPU in line (a thread there fights torch's
own: see model_runner.py). `kvgate bench structured-outputs` prints the cost. After the step, the accepted
token advances the matcher, and `Request.check_stop` ends the request when the grammar is complete.

Library choice, measured by `kvgate bench structured-outputs --compare-libraries` (the table is in
docs/benchmarks.md): llguidance wins where it matters (cheaper per token than xgrammar on a 32k vocabulary, and
no per-schema compile that would stall the engine loop on every new schema), and it is a small
Rust wheel; xgrammar pulls in triton. JSON schemas compile with `whitespace_flexible` off: compact JSON, so a
model cannot spend its whole budget on whitespace (vLLM's `disable_any_whitespace`).

A constraint that can never produce a token with this tokenizer is refused when the request is added (the first
mask is empty: InvalidRequestError, a 400). A matcher that reaches a dead end later (rare: llguidance keeps the
lexer viable) lets only EOS through and the request ends with stop_reason "structured output error: ...".
Nothing is downloaded: the matcher is built from the model's own tokenizer.

Limits: a constraint is the client's program, so its cost is bounded before it is admitted and while it runs.
- Work per matcher: llguidance's own `LLParserLimits` (see `parser_limits`), with the regex-analysis fuel cut
  10x from the library's default: at the default `a{200000}` costs milliseconds per token (and far more for the
  first mask), and here it fails cleanly ("too many expressions constructed"); every schema in tests/engine and
  a 200-field schema need under a tenth of it. A matcher out of fuel is an error, never a stall.
- Admission (`check`, run off the event loop by the server and off the engine loop by the engine): the matcher
  is built with the real tokenizer, its first mask computed and one token walked; a limit hit there is a 400
  naming the field. The engine builds one matcher per request in a worker thread (`submit`), and its `n`
  samples take copies of it.
- Per token: a request whose masks cost more than `MASK_BUDGET_PER_TOKEN_S` on average (after
  `MASK_BUDGET_SLACK_S` of slack for one-off spikes) is ended with stop_reason "structured output error: ...":
  llguidance's fuel bounds most steps, this bounds what fuel does not count (large repeats).
- Compiled grammars are cached by text, bounded in bytes (`GrammarCache`; vLLM bounds xgrammar's cache in
  bytes too, VLLM_XGRAMMAR_CACHE_MB): a 7 MiB schema is compiled but not kept.
"""

from __future__ import annotations

import collections
import logging
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvgate.common.errors import InvalidRequestError
from kvgate.engine.sampling_params import StructuredOutputsParams

log = logging.getLogger(__name__)

# Compact JSON (see the module docstring).
_JSON_OPTIONS = {"whitespace_flexible": False}
# llguidance's initial_lexer_fuel (its default: 1_000_000); see the module docstring.
LEXER_FUEL = 100_000
# Mask cost a constrained request may take per token on average, after a slack for spikes (a busy core).
MASK_BUDGET_PER_TOKEN_S = 0.010
MASK_BUDGET_SLACK_S = 0.5
# Compiled grammars kept, in bytes of constraint text + grammar; one entry may take at most 1/16 of it.
GRAMMAR_CACHE_BYTES = 32 << 20


def _import_llguidance():
    import llguidance
    import llguidance.hf

    return llguidance


def parser_limits():
    """The limits every matcher is built with: llguidance's defaults but for the regex fuel, and errors
    without the grammar's state dump (it would echo the client's schema into logs and answers)."""
    return _import_llguidance().LLParserLimits(initial_lexer_fuel=LEXER_FUEL, verbose_errors=False)


class GrammarCache:
    """Compiled grammars by (kind, constraint text), least recently used first out, bounded in bytes."""

    def __init__(self, max_bytes: int = GRAMMAR_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: collections.OrderedDict[tuple[str, str], tuple[str, int]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, kind: str, key: str) -> str:
        with self._lock:
            hit = self._entries.get((kind, key))
            if hit is not None:
                self._entries.move_to_end((kind, key))
                return hit[0]
        grammar = _compile(kind, key)  # outside the lock: a slow compile holds up no other
        size = sys.getsizeof(key) + sys.getsizeof(grammar)
        if size > self.max_bytes // 16:
            return grammar
        with self._lock:
            if (kind, key) not in self._entries:
                self._entries[(kind, key)] = (grammar, size)
                self.bytes += size
            while self.bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.bytes -= dropped
        return grammar


grammar_cache = GrammarCache()


def compile_grammar(so: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint; InvalidRequestError (naming the request field) when it is bad."""
    return grammar_cache.get(so.kind, so.key)


def _compile(kind: str, key: str) -> str:
    llg = _import_llguidance()
    matcher = llg.LLMatcher
    if kind == "json":
        try:
            grammar = matcher.grammar_from_json_schema(key, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise InvalidRequestError(f"the JSON schema is not a JSON object: {exc}") from None
    elif kind == "regex":
        grammar = matcher.grammar_from_regex(key)
    elif kind == "choice":
        grammar = llg.grammar_from("choice", key)
    else:  # grammar: Lark (llguidance's dialect) or GBNF/EBNF (llama.cpp's, vLLM's xgrammar syntax)
        try:
            grammar = llg.grammar_from("grammar", key)
        except ValueError as exc:
            raise InvalidRequestError(str(exc)) from None
    error = matcher.validate_grammar(grammar, limits=parser_limits())
    if error:
        raise InvalidRequestError(_first_line(error))
    return grammar


def _first_line(message: str) -> str:
    """llguidance's matcher errors end in a multi-line state dump: the first line says what went wrong."""
    return message.strip().splitlines()[0][:300] if message and message.strip() else "unknown error"


def _is_limit_error(message: str) -> bool:
    """llguidance ran out of a ParserLimits budget (fuel, lexer expressions, row items, grammar size)."""
    text = message.lower()
    return any(word in text for word in ("fuel", "too many", "too big", "max is", "limit", "exceed"))


class RequestGrammar:
    """One request's matcher: fills its bitmask row, advances on accepted tokens, says when it is complete."""

    def __init__(self, matcher, eos_token_id: int | None) -> None:
        self.matcher = matcher
        self.eos_token_id = eos_token_id
        self.error: str | None = None  # set once the matcher reached a dead end or went over budget
        self.mask_seconds = 0.0  # what this request's masks cost so far (the per-token budget)
        self.masks = 0

    def copy(self) -> "RequestGrammar":
        """A matcher in the same state (cheap: llguidance shares the compiled lexer), for another sample."""
        return RequestGrammar(self.matcher.deep_copy(), self.eos_token_id)

    def fill_bitmask(self, row: torch.Tensor, budgeted: bool = True) -> None:
        """Write the allowed-token bits into `row` (int32, contiguous, CPU). `budgeted`: count the time against
        the per-token budget (not the first mask, built at admission)."""
        if self.error is None:
            started = time.perf_counter()
            self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
            if budgeted:
                self.mask_seconds += time.perf_counter() - started
                self.masks += 1
            if self.matcher.is_error():
                self.error = _first_line(self.matcher.get_error())
            elif not bool(row.any()):
                self.error = "no token of this tokenizer continues the constraint"
            elif budgeted and self.mask_seconds > MASK_BUDGET_PER_TOKEN_S * self.masks + MASK_BUDGET_SLACK_S:
                self.error = (f"the constraint took {1000 * self.mask_seconds / self.masks:.1f} ms per token to "
                              f"match, over the budget of {1000 * MASK_BUDGET_PER_TOKEN_S:g} ms")
        if self.error is not None:
            row.zero_()
            if self.eos_token_id is not None:  # end it: EOS is the one way out
                bit = self.eos_token_id % 32
                row[self.eos_token_id // 32] = 1 << bit if bit < 31 else -(2**31)  # int32: bit 31 is the sign

    def accept(self, token_id: int) -> None:
        if self.error is None and not self.matcher.consume_token(token_id):
            self.error = _first_line(self.matcher.get_error() or f"token {token_id} is not allowed by the constraint")

    @property
    def is_terminated(self) -> bool:
        """No token other than EOS can follow: the output is complete."""
        return self.error is None and self.matcher.is_stopped()


class StructuredOutputManager:
    """Per engine (and per server, for the admission check): the llguidance view of the tokenizer, and matchers
    for new requests built under the limits.

    The tokenizer view is quick for the demo's byte-level tokenizer but takes a noticeable part of a second for a
    large BPE vocabulary (`kvgate bench structured-outputs --compare-libraries` prints it): `prepare()` builds it
    in a thread at engine start, so the first constrained request does not stall the engine loop for every
    running request (and engines that never see one pay no loop time)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_ids[0] if eos_token_ids else tokenizer.eos_token_id
        self._ll_tokenizer = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def bitmask_width(self) -> int:
        return (self.vocab_size + 31) // 32

    def prepare(self) -> threading.Thread:
        """Build the tokenizer view in a daemon thread (it ends by itself); returns the thread."""
        def build():
            try:
                self._tokenizer()
            except Exception as exc:  # noqa: BLE001 - told again to each constrained request (grammar_for)
                log.warning("structured outputs will be refused: cannot read the tokenizer (%s)", exc)

        thread = threading.Thread(target=build, name="kvgate-grammar-tokenizer", daemon=True)
        thread.start()
        return thread

    def _tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                llg = _import_llguidance()
                self._ll_tokenizer = llg.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                           eos_token=self.eos_token_id)
            return self._ll_tokenizer

    def grammar_for(self, so: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher with its first mask computed and one token walked (all under the limits);
        InvalidRequestError naming the field if the constraint is bad, over the limits, or this tokenizer
        cannot satisfy it. Slow only when the constraint is: call it off any loop (`submit`)."""
        llg = _import_llguidance()
        try:
            ll_tokenizer = self._tokenizer()
        except Exception as exc:  # noqa: BLE001 - e.g. a slow (non-Rust) tokenizer, which llguidance cannot read
            raise InvalidRequestError(f"{so.param}: structured outputs are not available for this model's "
                                      f"tokenizer ({exc})", param=so.param) from None
        try:
            grammar = compile_grammar(so)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"{so.param}: {exc}", param=so.param) from None
        matcher = llg.LLMatcher(ll_tokenizer, grammar, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise InvalidRequestError(f"{so.param}: {_first_line(matcher.get_error())}", param=so.param)
        template = RequestGrammar(matcher, self.eos_token_id)
        row = torch.zeros(self.bitmask_width, dtype=torch.int32)
        template.fill_bitmask(row, budgeted=False)  # kept: the samples' copies start from it
        if template.error is not None:
            raise InvalidRequestError(f"{so.param}: the constraint cannot be satisfied with this model's "
                                      f"tokenizer ({template.error})", param=so.param)
        self._walk_one_token(template.copy(), row, so)
        return template

    def _walk_one_token(self, probe: RequestGrammar, first_mask: torch.Tensor, so: StructuredOutputsParams) -> None:
        """Take one allowed token and compute the next mask: where a large repeat runs out of lexer budget
        (the first mask alone does not). A dead end there is the request's to meet (see RequestGrammar)."""
        allowed = allowed_token_ids(first_mask, self.vocab_size)
        token = next((t for t in allowed if t != self.eos_token_id), None)
        if token is None:
            return
        probe.accept(token)
        if probe.error is None:
            probe.fill_bitmask(first_mask, budgeted=False)
        if probe.error is not None and _is_limit_error(probe.error):
            raise InvalidRequestError(f"{so.param}: the constraint is too complex for this server's limits "
                                      f"({probe.error})", param=so.param)

    def submit(self, so: StructuredOutputsParams) -> Future:
        """`grammar_for` in a worker thread (llguidance drops the GIL while it builds); a Future of it."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=max(1, min(4, (os.cpu_count() or 2) // 2)),
                                            thread_name_prefix="kvgate-grammar-build")
        return self._pool.submit(self.grammar_for, so)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def fill_bitmasks(requests, width: int) -> tuple[list[int], torch.Tensor | None]:
    """(rows of `requests` that are constrained, their bitmasks [rows, width] int32); ([], None) if none is."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return [], None
    bitmask = torch.empty((len(rows), width), dtype=torch.int32)
    for j, i in enumerate(rows):
        requests[i].grammar.fill_bitmask(bitmask[j])
    return rows, bitmask


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 bitmask [rows, ceil(V/32)] -> bool [rows, V] (bit b of word w allows token 32 w + b)."""
    shifts = _BIT_SHIFTS.to(bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def allowed_token_ids(bitmask_row: torch.Tensor, vocab_size: int) -> list[int]:
    return unpack_bitmask(bitmask_row.unsqueeze(0), vocab_size)[0].nonzero().flatten().tolist()
