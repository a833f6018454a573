"""Incremental detokenization and stop strings for one request's output.

Text comes from the tokenizers library's DecodeStream, which holds back partial UTF-8 sequences.
Stop strings are matched on the text (so they can span token boundaries) and cut from it; while a
request runs, the last `len(longest stop) - 1` characters are held back from deltas, because they may
still turn out to be the start of a stop string.

Without stop strings nothing needs the text until an output is built, so tokens wait in a list and reach the
stream when the text is read (the offline engine reads it once, at the end): the per-token work leaves the step's
update. They are still given one at a time: DecodeStream.step with a list returns nothing at all when the list
ends inside a character, where token by token it returns the text before that character.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from kvgate.engine.sampling_params import SamplingParams

# Prompt tokens given to the stream as left context, so the first output token decodes as it would
# after its prompt (e.g. SentencePiece's leading-space handling).
_PROMPT_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams, prompt_token_ids: list[int]) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(ids=list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]),
                                    skip_special_tokens=params.skip_special_tokens)
        self.stops = list(params.stop or [])
        self.include_stop = params.include_stop_str_in_output
        self._max_stop = max((len(s) for s in self.stops), default=0)
        self._text = ""
        self._pending: list[int] = []  # tokens not yet decoded (no stop strings: decoded when the text is read)
        self._emitted = 0

    @property
    def output_text(self) -> str:
        if self._pending:
            pending, self._pending = self._pending, []
            stream, backend = self._stream, self._backend
            self._text += "".join([stream.step(backend, t) or "" for t in pending])
        return self._text

    def add_token(self, token_id: int) -> str | None:
        """Append one token's text; returns the stop string that matched (text then ends before it)."""
        if not self.stops:
            self._pending.append(token_id)
            return None
        chunk = self._stream.step(self._backend, token_id)
        if not chunk:
            return None
        prev_len = len(self._text)
        self._text += chunk
        search_from = max(0, prev_len - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            idx = self._text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self._text = self._text[: idx + len(stop) if self.include_stop else idx]
        return stop

    def next_delta(self, finished: bool) -> str:
        """Text not yet handed out that can no longer change."""
        hold = 0 if finished or self.include_stop else max(self._max_stop - 1, 0)
        text = self.output_text
        end = max(len(text) - hold, self._emitted)
        delta = text[self._emitted : end]
        self._emitted = end
        return delta
