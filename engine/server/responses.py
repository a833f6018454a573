"""How the routes answer: OpenAI-shaped errors, large JSON serialized off the event loop, SSE streams closed
however they end, and non-streaming work cancelled when its client goes away."""

from __future__ import annotations

import asyncio
import json
import weakref

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvgate.engine.server.openai_serving import OpenAIServing, Prepared
from kvgate.engine.server.protocol import error_body

# Nginx's "client closed request": logged for requests whose client went away before the answer.
CLIENT_CLOSED = 499


def error_response(status: int, message: str, err_type: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, status, param), status_code=status)


def _json_bytes(body) -> bytes:
    """What JSONResponse would send (compact, UTF-8, no NaN)."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


async def json_off_loop(serving: OpenAIServing, body, param: str) -> Response:
    """An answer that may be large (token ids), serialized in the tokenizer pool: on the event loop, millions of
    ids take seconds, and every other request (/health too) would wait."""
    return Response(await serving.off_loop(_json_bytes, body, param=param), media_type="application/json")


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, coro, prep: Prepared):
    """Run a non-streaming handler; if the client disconnects first, cancel it (aborting its requests)."""
    work = asyncio.ensure_future(coro)
    listener = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
        if work.done():
            return work.result()
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        return Response(status_code=CLIENT_CLOSED)
    finally:
        listener.cancel()
        prep.tracker.close()  # no-op when the handler closed it


class ClosingStreamingResponse(StreamingResponse):
    """Closes its generator however the response ends (a send that failed or stalled included), so the
    generator's `finally` aborts its requests in the engine now, not whenever it is garbage-collected."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


def event_stream(body, prep: Prepared) -> StreamingResponse:
    # A response dropped before its body is iterated never runs the generator's `finally`: release then.
    weakref.finalize(body, prep.tracker.close)
    return ClosingStreamingResponse(body, media_type="text/event-stream")
