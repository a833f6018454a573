"""The system prompt of an Anthropic Messages request, read one way by the engine (serving_messages.py) and the
EPP (request_parsing.py), so both see the same conversation prefix: the top-level `system` (a string or text
blocks) and any system-role messages inside `messages` (vLLM takes those too), their texts joined in order.
Claude Code's attribution block (`x-anthropic-billing-header...`, a per-request hash) is left out, as vLLM leaves
it out: kept, it would make every request's prefix differ and defeat prefix caching and prefix routing."""

from __future__ import annotations

from collections.abc import Iterable

BILLING_HEADER_PREFIX = "x-anthropic-billing-header"


def _texts(value, where: str) -> list[str]:
    if value is None or isinstance(value, str):
        return [value] if value and not value.startswith(BILLING_HEADER_PREFIX) else []
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a string or a list of text blocks")
    out = []
    for k, block in enumerate(value):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise ValueError(f"{where}[{k}] must be a text block")
        if not block["text"].startswith(BILLING_HEADER_PREFIX):
            out.append(block["text"])
    return out


def system_prompt(system, messages: Iterable[tuple[str, object]]) -> str:
    """The system prompt of `system` and the (role, content) pairs of `messages` ("" when there is none);
    ValueError naming the field for a value that is not text."""
    parts = _texts(system, "system")
    for i, (role, content) in enumerate(messages):
        if role == "system":
            parts += _texts(content, f"messages[{i}].content")
    return "".join(parts)
