"""The first `limit` token ids of a text, tokenizing only a character prefix of it: the work a long prompt costs is
bounded by what is needed of it, not by its size. The EPP's precise scorer needs only the blocks its index can
match (epp/kv_events/tokenize.py); the engine's server needs only to know that a prompt is over max_model_len
tokens to refuse it (engine/server/openai_serving.py): a 6 MiB prompt was tokenized whole before, 6.3M ids and
1.7 GB of peak RSS for a 400 (`kvgate bench hostile`'s long-prompt window; before and after in docs/security.md).

    cut   = limit × chars_per_token + margin            chars_per_token: the mean length of a vocabulary entry
    kept  = the tokens of text[:cut] that end at or before cut - margin
            (margin = 4 × the longest vocabulary entry + 16 characters: a cut changes only the tokens of the
            word it falls in and the whitespace before it, never anything that far back)
    kept ≥ limit: those ids, the first `limit` of them; else the cut doubles, up to the whole text

The kept ids are exactly the whole text's first ids (tests/epp/test_bounded_tokenize.py checks that against full
tokenization on random and real text, for the byte tokenizer and byte-level BPEs with and without pre-splitting).
The text's token count is then estimated from the characters per token of the part tokenized (above `kept`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PromptTokens:
    """The first token ids of a prompt, exactly as the whole prompt's tokenization starts."""

    ids: list[int]
    complete: bool  # `ids` is the whole prompt
    count: int  # the prompt's length in tokens: len(ids) when complete, else an estimate above it


class BoundedEncoder:
    def __init__(self, backend) -> None:
        """`backend`: a fast tokenizer's Rust tokenizer (`tokenizer.backend_tokenizer`)."""
        self._backend = backend
        # Characters per token, for the cut of a long text: vocabulary entries are at least as long as the text
        # they stand for (byte-level entries spell one character per byte).
        regular = backend.get_vocab(with_added_tokens=False)
        added = [t.content for t in backend.get_added_tokens_decoder().values()]
        lengths = [len(t) for t in regular] or [1]
        self.chars_per_token = min(8.0, max(1.0, sum(lengths) / len(lengths)))
        self.cut_margin = 4 * max([*lengths, *map(len, added)]) + 16

    def encode(self, text: str, special: bool = True):
        # encode_batch, not encode: it lets go of the GIL while it works (encode holds it throughout: a worker
        # thread tokenizing with it stalls the event loop just the same)
        return self._backend.encode_batch([text], add_special_tokens=special)[0]

    def prefix(self, text: str, limit: int | None, special: bool = True) -> PromptTokens:
        """At least the first `limit` token ids of `text` (all when None or when the text is shorter)."""
        margin = self.cut_margin
        cut = len(text) if limit is None else int(limit * self.chars_per_token) + margin
        while cut < len(text):
            enc = self.encode(text[:cut], special)
            kept = _tokens_ending_by(enc, cut - margin, cut)
            if kept >= limit:
                estimate = round(kept * len(text) / (cut - margin))
                return PromptTokens(enc.ids[:limit], False, max(kept + 1, estimate))
            cut *= 2
        ids = self.encode(text, special).ids
        return PromptTokens(ids, True, len(ids))


def _tokens_ending_by(enc, end: int, cut: int) -> int:
    """How many leading tokens of `enc` (the encoding of text[:cut]) surely end at or before character `end`:
    those before the token that holds the first character at or after `end` that any token holds (0 when none
    does, e.g. whitespace the tokenizer drops: the caller then cuts further)."""
    for pos in range(end, cut):
        index = enc.char_to_token(pos)
        if index is not None:
            return index
    return 0
