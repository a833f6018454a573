"""Incremental detokenization and stop strings for one request's output.

Text comes from the tokenizers library's DecodeStream, which holds back partial UTF-8 sequences.
Stop strings are matched on the text (so they can span token boundaries) and cut from it; while a
request runs, the last `len(longest stop) - 1` characters are held back from deltas, because they may
still turn out to be the start of a stop string.
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
        self.output_text = ""
        self._emitted = 0

    def add_token(self, token_id: int) -> str | None:
        """Append one token's text; returns the stop string that matched (text then ends before it)."""
        chunk = self._stream.step(self._backend, token_id)
        if not chunk:
            return None
        prev_len = len(self.output_text)
        self.output_text += chunk
        if not self.stops:
            return None
        search_from = max(0, prev_len - self._max_stop + 1)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            idx = self.output_text.find(stop, search_from)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.output_text = self.output_text[: idx + len(stop) if self.include_stop else idx]
        return stop

    def next_delta(self, finished: bool) -> str:
        """Text not yet handed out that can no longer change."""
        hold = 0 if finished or self.include_stop else max(self._max_stop - 1, 0)
        end = max(len(self.output_text) - hold, self._emitted)
        delta = self.output_text[self._emitted : end]
        self._emitted = end
        return delta
