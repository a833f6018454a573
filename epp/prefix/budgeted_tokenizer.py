"""A prompt's tokens for precise prefix matching, within a time budget (the precise prefix scorer's tokenizer).

Only the first blocks an index can hold ever match, so only a character prefix that surely covers them is tokenized
(epp/kv_events/tokenize.py `prefix_tokens`: the ids kept are exactly the whole prompt's). A prompt longer than
INLINE_TOKENIZE_CHARS is tokenized before the decision, in this tokenizer's own threads and within `timeout_s`, so
that no other decision waits on it (Director.prepare awaits `tokenize_long`); past the budget the answer is
DEGRADED and the caller scores that request another way. Token-id prompts need no tokenizing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

from kvgate.epp.kv_events.tokenize import PromptTokenizer, PromptTokens
from kvgate.epp.types import LLMRequest

INLINE_TOKENIZE_CHARS = 8192  # longer prompts are tokenized off the event loop; shorter ones are cheap inline
TOKENIZE_THREADS = 2  # what a burst of long prompts may take of the EPP's CPU
DEGRADED = object()  # not tokenized within the budget


class BudgetedTokenizer:
    def __init__(self, path: str | None, timeout_s: float) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self.timeouts = 0  # requests that ran out of budget
        self._tokenizer: PromptTokenizer | None = None
        self._pool: ThreadPoolExecutor | None = None

    def load(self, path: str | None = None) -> None:
        """Load now (the EPP's start: a bad path fails there, not on the first request)."""
        if path:
            self.path = path
        self._tokenizer = PromptTokenizer(self.path)

    @property
    def tokenizer(self) -> PromptTokenizer:
        if self._tokenizer is None:
            self.load()
        return self._tokenizer

    @staticmethod
    def is_long(request: LLMRequest) -> bool:
        """Text long enough to tokenize off the loop (token-id prompts need no tokenizing)."""
        body = request.body
        if isinstance(body, Mapping) and isinstance(body.get("prompt"), list) and body["prompt"] \
                and type(body["prompt"][0]) is int:
            return False
        return len(request.prompt) > INLINE_TOKENIZE_CHARS

    def tokenize(self, request: LLMRequest, limit: int) -> PromptTokens | None:
        """Here and now (a short prompt: bounded work); None when the request cannot be tokenized."""
        return self.tokenizer.prefix_tokens(request, limit)

    async def tokenize_long(self, request: LLMRequest, limit: int):
        """In this tokenizer's threads, within the budget: PromptTokens, None, or DEGRADED past the budget (a
        queued call is cancelled; a running one finishes unused)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="kvgate-epp-tokenize")
        future = asyncio.get_running_loop().run_in_executor(self._pool, self.tokenizer.prefix_tokens, request, limit)
        try:
            return await asyncio.wait_for(future, self.timeout_s)
        except asyncio.TimeoutError:
            self.timeouts += 1
            return DEGRADED

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
