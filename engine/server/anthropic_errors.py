"""Anthropic's error shape on the Messages API's paths: every error answer under /v1/messages — from the routes,
the exception handlers, the body limit (413) and the API-key check (401) alike, all of which write OpenAI's
shape — is rewritten as `{"type": "error", "error": {"type", "message"}}` with Anthropic's error type for its
status (common/api_errors.py). Plain ASGI, outermost: only JSON error answers (status >= 400, whole, never a
stream) are buffered; everything else passes through untouched."""

from __future__ import annotations

import json

from kvgate.common.api_errors import anthropic_error_body, is_anthropic_path


def reshaped(status: int, body: bytes) -> bytes:
    """An OpenAI-shaped error body as Anthropic's (a body that is not one keeps its text as the message)."""
    try:
        error = json.loads(body).get("error")
        message = error.get("message") if isinstance(error, dict) else None
    except (ValueError, AttributeError):
        message = None
    if not isinstance(message, str):
        message = body.decode(errors="replace") or f"HTTP {status}"
    return json.dumps(anthropic_error_body(status, message)).encode()


class AnthropicErrorShape:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not is_anthropic_path(scope["path"]):
            return await self.app(scope, receive, send)
        start: dict | None = None
        chunks: list[bytes] = []

        async def reshaping_send(message):
            nonlocal start
            if message["type"] == "http.response.start":
                headers = dict(message.get("headers") or ())
                if message["status"] >= 400 and headers.get(b"content-type", b"").startswith(b"application/json"):
                    start = message  # held until the body is whole
                    return None
                return await send(message)
            if message["type"] == "http.response.body" and start is not None:
                chunks.append(message.get("body", b""))
                if message.get("more_body", False):
                    return None
                body = reshaped(start["status"], b"".join(chunks))
                headers = [(k, v) for k, v in start.get("headers") or () if k != b"content-length"]
                await send({**start, "headers": [*headers, (b"content-length", str(len(body)).encode())]})
                return await send({"type": "http.response.body", "body": body})
            return await send(message)

        await self.app(scope, receive, reshaping_send)
