"""API keys (vLLM's `--api-key` / VLLM_API_KEY): with keys set, a request must carry `Authorization: Bearer KEY`
with one of them — or, without an Authorization header, `x-api-key: KEY` (how Anthropic's clients send theirs) —
or it is answered 401.

- Fail closed: every request is guarded except GET and HEAD of PUBLIC_PATHS (the probes and the scrape, exact
  paths) and OPTIONS (CORS preflights, as vLLM). Unknown paths are guarded too (a 401 before the 404), so a route
  added later needs no one to remember it. vLLM guards the prefixes of its registered routes instead.
- The outermost middleware: a refused client gets its 401 before anything reads its body (the body limit, the
  routes), with `connection: close`, so its unread body is not drained either.
- Keys are compared as vLLM does, in constant time: the SHA-256 of the presented token against each key's with
  `secrets.compare_digest`, OR-ed over every key, so neither the time nor the order tells which key was close.
- Neither the presented token nor a key is ever logged or echoed in an answer.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from collections.abc import Mapping, Sequence

from kvgate.common.errors import ConfigError
from kvgate.engine.server.protocol import error_body

API_KEY_ENV = "VLLM_API_KEY"
# What probes and scrapers need without a key: readiness (the kubelet, `kvgate up`), liveness, and the metrics
# every EPP scrapes every 50 ms. The server has no /ping, /load or /version, and no docs pages.
PUBLIC_PATHS = frozenset({"/health", "/live", "/metrics"})
_PUBLIC_METHODS = frozenset({"GET", "HEAD"})

_MISSING = ("No API key: this server requires one, sent as the header 'Authorization: Bearer <key>' (or "
            "'x-api-key: <key>').")
_NOT_BEARER = "The Authorization header is not a Bearer token: send the API key as 'Authorization: Bearer <key>'."
_WRONG = "Invalid API key."


def key_problem(key: str) -> str | None:
    """Why `key` can never be matched (None: it can). An HTTP header value cannot start or end with whitespace
    (the parser strips it) nor hold control characters, so such a key — most often a Secret written from a file
    with its trailing newline — would refuse every client: a start error says so instead."""
    if not key:
        return "is empty"
    if key != key.strip():
        return "starts or ends with whitespace (a trailing newline from a file?)"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in key):
        return "holds a control character"
    return None


def resolve_api_keys(flag_keys: Sequence[str] | None, environ: Mapping[str, str] = os.environ) -> list[str]:
    """The keys to require: `--api-key`'s if given (the flag wins), else VLLM_API_KEY's one (empty: unset), else
    none. Raises ConfigError (one line, naming the source, never the key) for a key that can never match."""
    if flag_keys is not None:
        source, keys = "--api-key", list(flag_keys)
    else:
        source, keys = API_KEY_ENV, [environ[API_KEY_ENV]] if environ.get(API_KEY_ENV) else []
    for i, key in enumerate(keys):
        why = key_problem(key)
        if why is not None:
            which = f"key {i + 1} of {len(keys)}" if len(keys) > 1 else "the key"
            hint = " (an unset shell variable?): give a key, or leave --api-key out" if not key else ""
            raise ConfigError(f"{source}: {which} {why}{hint}")
    return keys


class ApiKeyAuth:
    """Plain ASGI; `keys`: one or more, none empty."""

    def __init__(self, app, keys: Sequence[str]) -> None:
        if not keys or any(key_problem(k) for k in keys):
            raise ValueError("ApiKeyAuth needs one or more keys that can be matched")
        self.app = app
        self._digests = tuple(hashlib.sha256(k.encode()).digest() for k in keys)

    def _matches(self, token: bytes) -> bool:
        presented = hashlib.sha256(token).digest()
        match = False
        for digest in self._digests:  # every key, always: no early exit
            match |= secrets.compare_digest(presented, digest)
        return match

    def _refusal(self, headers) -> tuple[str, bytes] | None:
        """(message, WWW-Authenticate) when the request's credentials do not pass; None when they do. The first
        Authorization header counts (its scheme case-insensitive, RFC 7235); without one, the first x-api-key."""
        value = next((v for k, v in headers if k == b"authorization"), None)  # ASGI header names are lower case
        if value is None:
            api_key = next((v for k, v in headers if k == b"x-api-key"), None)  # Anthropic's header
            if api_key is None:
                return _MISSING, b"Bearer"
            return None if self._matches(api_key.strip(b" ")) else (_WRONG, b'Bearer error="invalid_token"')
        scheme, _, token = value.partition(b" ")
        if scheme.lower() != b"bearer":
            return _NOT_BEARER, b"Bearer"
        # Raw bytes, so a non-ASCII key matches the UTF-8 a client sends (Starlette would decode Latin-1).
        if not self._matches(token.lstrip(b" ")):
            return _WRONG, b'Bearer error="invalid_token"'
        return None

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind not in ("http", "websocket") or scope.get("method") == "OPTIONS" or (
                scope["path"] in PUBLIC_PATHS and scope.get("method") in _PUBLIC_METHODS):
            return await self.app(scope, receive, send)
        refusal = self._refusal(scope.get("headers") or ())
        if refusal is None:
            return await self.app(scope, receive, send)
        if kind == "websocket":  # closing before accepting is a 403 (the server has no websocket routes anyway)
            return await send({"type": "websocket.close", "code": 1008})
        message, challenge = refusal
        body = json.dumps(error_body(message, "invalid_request_error", 401)).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"www-authenticate", challenge), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
