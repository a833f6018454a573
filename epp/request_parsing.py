"""Turn an OpenAI request body into the scheduler's LLMRequest (or a clear 400)."""

from __future__ import annotations

import json
from collections.abc import Mapping

from kvgate.epp.types import LLMRequest


MAX_TOKEN_ID = 2**31  # token ids are ints in [0, MAX_TOKEN_ID): every vocabulary fits, and so do int32 arrays


class BadRequest(ValueError):
    """The body cannot be routed; answered with HTTP 400."""


def valid_token_ids(value) -> bool:
    """A non-empty list of ints in [0, MAX_TOKEN_ID) (a bool is an int to Python, never a token id)."""
    return (isinstance(value, list) and bool(value)
            and all(type(t) is int and 0 <= t < MAX_TOKEN_ID for t in value))


def _token_ids(value: list) -> list:
    if not valid_token_ids(value):
        raise BadRequest(f"'prompt' token ids must be integers in [0, {MAX_TOKEN_ID})")
    return value


def prompt_text(body: Mapping) -> str:
    """What prefix affinity hashes: the completions prompt, or the chat messages in order."""
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty list")
        parts = []
        for m in messages:
            if not isinstance(m, Mapping):
                raise BadRequest("each message must be an object")
            content = m.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
            parts.append(f"<|{m.get('role', '')}|>{content or ''}")
        return "".join(parts)
    if "input" in body and "prompt" not in body:  # embeddings and the Responses API
        value = body["input"]
        if isinstance(value, str):
            return value
        if isinstance(value, list):
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False)[:1 << 20]
        raise BadRequest("'input' must be a string or a list")
    if "prompt" in body:
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and prompt:
            if all(isinstance(x, str) for x in prompt):
                return "".join(prompt)
            if all(isinstance(x, int) for x in prompt):  # token ids: hash their text form
                return " ".join(map(str, _token_ids(prompt)))
            if all(isinstance(x, list) for x in prompt):
                return " ".join(" ".join(map(str, _token_ids(p))) for p in prompt)
        raise BadRequest("'prompt' must be a string, a list of strings or token ids")
    raise BadRequest("the body has none of 'prompt', 'messages' or 'input'")


def parse_request(request_id: str, raw: bytes, headers: Mapping[str, str]) -> tuple[LLMRequest, dict]:
    """Parse a completions / chat body; returns the request and the decoded JSON."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the request body is not valid JSON: {exc.msg if hasattr(exc, 'msg') else exc}") from exc
    except RecursionError:  # nesting deeper than the parser's stack: hostile, not an inference request
        raise BadRequest("the request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    salt = body.get("cache_salt")
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    request = LLMRequest(
        request_id=request_id,
        model=model or "",
        target_model=model or "",
        prompt=prompt_text(body),
        headers=headers,
        cache_salt=salt if isinstance(salt, str) else None,
        max_tokens=max_tokens if isinstance(max_tokens, int) else None,
        body=body,
    )
    return request, body
