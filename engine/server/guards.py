"""Transport-level guards against clients that send too much or read too little (plain ASGI middleware).

- RequestBodyLimit: a body over --max-request-body-bytes is answered 413 before the application sees it —
  at once from Content-Length, or as soon as a chunked body passes the limit — so no request makes the
  server buffer more than the limit.
- StalledClientGuard: every body write must complete within --client-stall-timeout. A write waits only
  when the client has stopped reading (uvicorn pauses the writer once its buffer and the socket buffers are
  full), so a stalled client is one that read nothing for that long. Its response is cut (the connection
  closed) and the generation feeding it is aborted, freeing its KV blocks; without this, a client that
  never reads pins a running request and its queued outputs for as long as the TCP connection lives.
"""

from __future__ import annotations

import asyncio
import json
import logging

from kvgate.engine.server.protocol import error_body

log = logging.getLogger(__name__)


class ClientStalled(Exception):
    """A response write waited longer than the stall timeout."""


async def _send_json(send, status: int, body: dict) -> None:
    data = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": data})


def _is_stall(exc: BaseException) -> bool:
    """ClientStalled, alone or as the only kind in an exception group (a streaming response's task group)."""
    group = getattr(exc, "exceptions", None)
    if group is not None:
        return bool(group) and all(_is_stall(e) for e in group)
    return isinstance(exc, ClientStalled)


class RequestBodyLimit:
    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _too_large(self) -> dict:
        return error_body(f"The request body is larger than {self.max_bytes} bytes (--max-request-body-bytes).",
                          "request_too_large", 413)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                if int(declared) > self.max_bytes:
                    return await _send_json(send, 413, self._too_large())
            except ValueError:  # the HTTP parser rejects these before we get here
                pass
        # Read the body here (the application would buffer it whole anyway), stopping at the limit.
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await _send_json(send, 413, self._too_large())
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then: disconnect notices, as the application expects

        await self.app(scope, replay, send)


class StalledClientGuard:
    def __init__(self, app, timeout: float) -> None:
        self.app = app
        self.timeout = timeout

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def guarded_send(message):
            if message["type"] != "http.response.body":
                return await send(message)
            try:
                await asyncio.wait_for(send(message), self.timeout)
            except asyncio.TimeoutError:
                raise ClientStalled() from None

        try:
            await self.app(scope, receive, guarded_send)
        except Exception as exc:  # noqa: BLE001 - only a stall is handled here; anything else is re-raised
            if not _is_stall(exc):
                raise
            # The response body cannot be completed: returning leaves it unfinished, and the server closes the
            # connection. The streaming response's generator was closed on the way out (its request aborted).
            client = scope.get("client")
            log.warning("client %s read nothing for %g s (--client-stall-timeout): response cut, request aborted",
                        f"{client[0]}:{client[1]}" if client else "?", self.timeout)
