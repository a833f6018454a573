"""Prompts to token ids in the EPP, exactly as the pool's engine tokenizes them.

The engine (engine/server/openai_serving.py) loads its tokenizer with transformers' AutoTokenizer from local
files (common/tokenizer_files.py load_tokenizer; the sim backend without a tokenizer of its own uses kvgate's byte-level
tokenizer, common/demo.py ensure_byte_tokenizer) and then:
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
character prefix of a long prompt is tokenized (a chat is rendered whole, which is cheap, then its text is cut),
by common/bounded_tokenize.py, which the engine's server uses too to refuse an over-long prompt without
tokenizing all of it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvgate.common.bounded_tokenize import BoundedEncoder, PromptTokens
from kvgate.epp.request_parsing import valid_token_ids
from kvgate.epp.types import LLMRequest

log = logging.getLogger(__name__)


def default_tokenizer_path() -> str:
    from kvgate.common.demo import ensure_byte_tokenizer

    return str(ensure_byte_tokenizer())


class PromptTokenizer:
    def __init__(self, path: str | None = None) -> None:
        from kvgate.common.tokenizer_files import load_tokenizer

        self.path = path or default_tokenizer_path()
        self.tokenizer = load_tokenizer(self.path)  # ModelLoadError when the folder has no usable tokenizer
        self._bounded_encoder = BoundedEncoder(self.tokenizer.backend_tokenizer)
        self.cut_margin = self._bounded_encoder.cut_margin

    def encode(self, text: str) -> list[int]:
        return self._bounded_encoder.encode(text).ids

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
        return self._bounded_encoder.prefix(text, limit, special)

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

