"""Prompts to token ids in the EPP, exactly as the pool's engine tokenizes them.

The engine (engine/server/openai_serving.py) loads its tokenizer with transformers' AutoTokenizer from local
files (engine/loader.py load_tokenizer; the sim backend without a tokenizer of its own uses kvgate's byte-level
tokenizer, engine/demo.py ensure_byte_tokenizer) and then:
  - completions: `tokenizer.encode(prompt)` (special tokens added as the tokenizer's post-processor says), or the
    token ids as given;
  - chat: `tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=...)` with each message's
    text parts joined.
The EPP loads the same files with the same function and does the same, except that a completion prompt is
encoded by the fast tokenizer's Rust backend directly (`backend_tokenizer.encode_batch(...)`, the same ids
without transformers' Python wrapper; the unit test checks they agree). Which files: `kvgate epp --tokenizer
PATH` (the model folder, or any folder with tokenizer.json), else the precise scorer's `tokenizer` parameter, else
the byte tokenizer that `kvgate serve --backend sim` uses when given none.

Not supported (the request then hashes nothing and scores 0 everywhere: a miss, never a wrong hit): a request's
own `chat_template` or `chat_template_kwargs` (the engine applies them only when trusted) and non-text content.
The engine's render endpoints (`/v1/*/render`) would give the same ids, but over a network round trip per
request from a synchronous scorer; the local tokenizer costs less (numbers in the scorer's docstring).

Bounded work (`prefix_tokens`): the scorer matches at most max_prefix_blocks × block_size tokens, so only a
character prefix of a long prompt is tokenized (a chat is rendered whole, which is cheap, then its text is cut):

    cut   = limit × chars_per_token + margin            chars_per_token: the mean length of a vocabulary entry
    kept  = the tokens of text[:cut] that end at or before cut - margin
            (margin = 4 × the longest vocabulary entry + 16 characters: a cut changes only the tokens of the
            word it falls in and the whitespace before it, never anything that far back)
    kept ≥ limit: those ids, the first `limit` of them; else the cut doubles, up to the whole text

The kept ids are exactly the whole prompt's first ids (tests/epp/test_bounded_tokenize.py checks that against
full tokenization on random and real text, for the byte tokenizer and byte-level BPEs with and without
pre-splitting); the scorer hashes only their full blocks. The prompt's token count is then estimated from the
characters per token of the part tokenized.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from kvgate.epp.request_parsing import valid_token_ids
from kvgate.epp.types import LLMRequest

log = logging.getLogger(__name__)


def default_tokenizer_path() -> str:
    from kvgate.engine.demo import ensure_byte_tokenizer

    return str(ensure_byte_tokenizer())


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """The first token ids of a prompt, exactly as the engine makes them."""

    ids: list[int]
    complete: bool  # `ids` is the whole prompt
    count: int  # the prompt's length in tokens: len(ids) when complete, else an estimate above it


class PromptTokenizer:
    def __init__(self, path: str | None = None) -> None:
        from kvgate.engine.loader import load_tokenizer

        self.path = path or default_tokenizer_path()
        self.tokenizer = load_tokenizer(self.path)  # ModelLoadError when the folder has no usable tokenizer
        self._backend = self.tokenizer.backend_tokenizer
        # Characters per token, for the cut of a long prompt (module docstring): vocabulary entries are at least
        # as long as the text they stand for (byte-level entries spell one character per byte).
        regular = self._backend.get_vocab(with_added_tokens=False)
        added = [t.content for t in self._backend.get_added_tokens_decoder().values()]
        lengths = [len(t) for t in regular] or [1]
        self.chars_per_token = min(8.0, max(1.0, sum(lengths) / len(lengths)))
        self.cut_margin = 4 * max([*lengths, *map(len, added)]) + 16

    def encode(self, text: str) -> list[int]:
        return self._encode(text).ids

    def _encode(self, text: str, special: bool = True):
        # encode_batch, not encode: it lets go of the GIL while it works (encode holds it throughout: a worker
        # thread tokenizing with it stalled the event loop just the same; measured, tokenizers 0.23)
        return self._backend.encode_batch([text], add_special_tokens=special)[0]

    def tokens(self, request: LLMRequest) -> list[int] | None:
        """The prompt's token ids as the engine would make them (all of them); None when this cannot be known."""
        found = self.prefix_tokens(request, None)
        return None if found is None else found.ids

    def prefix_tokens(self, request: LLMRequest, limit: int | None) -> PromptTokens | None:
        """At least the first `limit` token ids of the prompt (all when None or when the prompt is shorter),
        tokenizing only a character prefix of a long one; None when they cannot be known."""
        body = request.body
        if isinstance(body, Mapping):
            if "messages" in body:
                text = self._chat_text(body)
                return None if text is None else self._bounded(text, limit, special=False)
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return self._bounded(prompt, limit)
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                if not valid_token_ids(prompt):  # refused with a 400 where the request entered (request_parsing)
                    return None
                ids = prompt if limit is None else prompt[:limit]
                return PromptTokens(ids, len(ids) == len(prompt), len(prompt))
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                return self._bounded(prompt[0], limit)
            return None  # several prompts, or the embeddings/Responses shapes: no single prefix
        return self._bounded(request.prompt, limit)

    def _bounded(self, text: str, limit: int | None, special: bool = True) -> PromptTokens:
        encode, margin = self._encode, self.cut_margin
        cut = len(text) if limit is None else int(limit * self.chars_per_token) + margin
        while cut < len(text):
            enc = encode(text[:cut], special)
            kept = _tokens_ending_by(enc, cut - margin, cut)
            if kept >= limit:
                estimate = round(kept * len(text) / (cut - margin))
                return PromptTokens(enc.ids[:limit], False, max(kept + 1, estimate))
            cut *= 2
        ids = encode(text, special).ids
        return PromptTokens(ids, True, len(ids))

    def _chat_text(self, body: Mapping) -> str | None:
        """The conversation rendered by the model's template: the engine tokenizes exactly this string (without
        adding special tokens: transformers' apply_chat_template(tokenize=True) does the same)."""
        if body.get("chat_template") is not None or body.get("chat_template_kwargs"):
            return None
        messages = []
        for m in body["messages"]:
            if not isinstance(m, Mapping):
                return None
            content = m.get("content")
            if isinstance(content, list):
                if any(not isinstance(p, Mapping) or p.get("type") != "text" for p in content):
                    return None
                content = "".join(str(p.get("text", "")) for p in content)
            messages.append({"role": m.get("role"), "content": content or ""})
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=body.get("add_generation_prompt", True))
        except Exception as exc:  # noqa: BLE001 - the engine will answer this request with a 400
            log.debug("chat template failed for a request: %s", exc)
            return None
        return text if isinstance(text, str) else None


def _tokens_ending_by(enc, end: int, cut: int) -> int:
    """How many leading tokens of `enc` (the encoding of text[:cut]) surely end at or before character `end`:
    those before the token that holds the first character at or after `end` that any token holds (0 when none
    does, e.g. whitespace the tokenizer drops: the caller then cuts further)."""
    for pos in range(end, cut):
        index = enc.char_to_token(pos)
        if index is not None:
            return index
    return 0
