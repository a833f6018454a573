"""Prompts to token ids in the EPP, exactly as the pool's engine tokenizes them.

The engine (engine/server/openai_serving.py) loads its tokenizer with transformers' AutoTokenizer from local
files (engine/loader.py load_tokenizer; the sim backend without a tokenizer of its own uses kvgate's byte-level
tokenizer, engine/demo.py ensure_byte_tokenizer) and then:
  - completions: `tokenizer.encode(prompt)` (special tokens added as the tokenizer's post-processor says), or the
    token ids as given;
  - chat: `tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=...)` with each message's
    text parts joined.
The EPP loads the same files with the same function and does the same, except that a completion prompt is
encoded by the fast tokenizer's Rust backend directly (`backend_tokenizer.encode(...).ids`, the same ids
without transformers' Python wrapper; the unit test checks they agree). Which files: `kvgate epp --tokenizer
PATH` (the model folder, or any folder with tokenizer.json), else the precise scorer's `tokenizer` parameter, else
the byte tokenizer that `kvgate serve --backend sim` uses when given none.

Not supported (the request then hashes nothing and scores 0 everywhere: a miss, never a wrong hit): a request's
own `chat_template` or `chat_template_kwargs` (the engine applies them only when trusted) and non-text content.
The engine's render endpoints (`/v1/*/render`) would give the same ids, but over a network round trip per
request from a synchronous scorer; the local tokenizer costs less (numbers in the scorer's docstring).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvgate.epp.types import LLMRequest

log = logging.getLogger(__name__)


def default_tokenizer_path() -> str:
    from kvgate.engine.demo import ensure_byte_tokenizer

    return str(ensure_byte_tokenizer())


class PromptTokenizer:
    def __init__(self, path: str | None = None) -> None:
        from kvgate.engine.loader import load_tokenizer

        self.path = path or default_tokenizer_path()
        self.tokenizer = load_tokenizer(self.path)  # ModelLoadError when the folder has no usable tokenizer
        self._backend = self.tokenizer.backend_tokenizer

    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text).ids

    def tokens(self, request: LLMRequest) -> list[int] | None:
        """The prompt's token ids as the engine would make them; None when this cannot be known."""
        body = request.body
        if isinstance(body, Mapping):
            if "messages" in body:
                return self._chat(body)
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                return self.encode(prompt)
            if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
                return prompt
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                return self.encode(prompt[0])
            return None  # several prompts, or the embeddings/Responses shapes: no single prefix
        return self.encode(request.prompt)

    def _chat(self, body: Mapping) -> list[int] | None:
        if body.get("chat_template") is not None or body.get("chat_template_kwargs"):
            return None
        messages = []
        for m in body["messages"]:
            content = m.get("content")
            if isinstance(content, list):
                if any(not isinstance(p, Mapping) or p.get("type") != "text" for p in content):
                    return None
                content = "".join(str(p.get("text", "")) for p in content)
            messages.append({"role": m.get("role"), "content": content or ""})
        try:
            ids = self.tokenizer.apply_chat_template(
                messages, tokenize=True, add_generation_prompt=body.get("add_generation_prompt", True))
        except Exception as exc:  # noqa: BLE001 - the engine will answer this request with a 400
            log.debug("chat template failed for a request: %s", exc)
            return None
        if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
