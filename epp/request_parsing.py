"""Turn a request body into the scheduler's LLMRequest (or a clear 400): OpenAI's completions and chat bodies, and
the Responses (/v1/responses) and Anthropic Messages (/v1/messages) bodies, read by their path. The last two are
seen as the chat conversation the engine makes of them (engine/server/serving_responses.py, serving_messages.py):
a Responses request's `instructions` and an Anthropic `system` are the conversation's system message, so a chat,
a Responses and a Messages request with the same long system prompt share a prefix hash (and the precise scorer
tokenizes the same rendered conversation)."""

from __future__ import annotations

import json
from collections.abc import Mapping

from kvgate.common.anthropic_system import system_prompt
from kvgate.common.api_errors import is_anthropic_path
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


RESPONSES_PATH = "/v1/responses"
_RESPONSES_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _text(content, where: str, joiner: str = "") -> str:
    """A content value: a string, or a list of parts whose text ones are kept (joined as the engine joins them)."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        return joiner.join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    raise BadRequest(f"{where} must be a string or a list of content parts")


def _call_text(name, arguments) -> str:
    """A tool call as text in the hashed conversation (what matters is that the same call hashes the same)."""
    return json.dumps({"name": name, "arguments": arguments}, separators=(",", ":"), ensure_ascii=False)


def responses_messages(body: Mapping) -> list[dict]:
    """A Responses body's conversation, as chat messages."""
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string")
    messages = [{"role": "system", "content": instructions}] if instructions else []
    value = body.get("input")
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}]
    if not isinstance(value, list):
        raise BadRequest("'input' must be a string or a list of items")
    for k, item in enumerate(value):
        if not isinstance(item, Mapping):
            raise BadRequest(f"input[{k}] must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _RESPONSES_ROLES.get(item.get("role"))
            if role is None:
                raise BadRequest(f"input[{k}].role must be user, assistant, system or developer")
            messages.append({"role": role, "content": _text(item.get("content"), f"input[{k}].content")})
        elif kind == "function_call":
            messages.append({"role": "assistant", "content": _call_text(item.get("name"), item.get("arguments"))})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "content": _text(item.get("output"), f"input[{k}].output")})
        elif kind != "reasoning":
            raise BadRequest(f"input[{k}]: items of type {kind!r} are not supported")
    return messages


def anthropic_messages(body: Mapping) -> list[dict]:
    """An Anthropic Messages body's conversation, as chat messages."""
    value = body.get("messages")
    if not isinstance(value, list) or not value:
        raise BadRequest("'messages' must be a non-empty list")
    for i, m in enumerate(value):
        if not isinstance(m, Mapping) or m.get("role") not in ("user", "assistant", "system"):
            raise BadRequest(f"messages[{i}] must be an object with role user, assistant or system")
    try:
        system = system_prompt(body.get("system"), ((m["role"], m.get("content")) for m in value))
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
    messages = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(value):
        if m["role"] == "system":
            continue
        content = m.get("content")
        if isinstance(content, str):
            messages.append({"role": m["role"], "content": content})
            continue
        if not isinstance(content, list):
            raise BadRequest(f"messages[{i}].content must be a string or a list of content blocks")
        text = []
        for block in content:
            if not isinstance(block, Mapping):
                raise BadRequest(f"messages[{i}].content blocks must be objects")
            kind = block.get("type")
            if kind == "text":
                text.append(str(block.get("text", "")))
            elif kind == "tool_use":
                text.append(_call_text(block.get("name"), block.get("input")))
            elif kind == "tool_result":
                messages.append({"role": "tool", "content": _text(block.get("content"), f"messages[{i}] tool_result",
                                                                  "\n")})
        if text or m["role"] == "assistant" or not content:
            messages.append({"role": m["role"], "content": "".join(text)})
    return messages


def chat_view(path: str, body: dict) -> dict:
    """The body as chat sees it: a Responses or Messages body (by its path) as a chat body of its conversation;
    any other body as it is."""
    path = path.split("?", 1)[0]
    if path == RESPONSES_PATH:
        previous = body.get("previous_response_id")  # the stored response's engine: previous_response_filter.py
        return {"messages": responses_messages(body),
                **({"previous_response_id": previous} if isinstance(previous, str) else {})}
    if is_anthropic_path(path):
        return {"messages": anthropic_messages(body)}
    return body


def parse_request(request_id: str, raw: bytes, headers: Mapping[str, str]) -> tuple[LLMRequest, dict]:
    """Parse a completions / chat / Responses / Messages body (which one: the `:path` header); returns the request
    and the decoded JSON. The request's prompt and `body` are the chat view's (chat_view); the JSON is what goes
    on to the engine."""
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
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens", body.get("max_output_tokens")))
    view = chat_view(headers.get(":path", ""), body)
    request = LLMRequest(
        request_id=request_id,
        model=model or "",
        target_model=model or "",
        prompt=prompt_text(view),
        headers=headers,
        cache_salt=salt if isinstance(salt, str) else None,
        max_tokens=max_tokens if isinstance(max_tokens, int) else None,
        body=view,
    )
    return request, body
