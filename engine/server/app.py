"""The HTTP server: routes, OpenAI-shaped errors, /health, /metrics; `kvgate serve` runs it with uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import weakref
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.errors import EngineError, InvalidRequestError
from kvgate.engine.server.metrics import ServerMetrics
from kvgate.engine.server.openai_serving import ModelNotFound, OpenAIServing, Overloaded, Prepared
from kvgate.engine.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                           TokenizeRequest, error_body)

log = logging.getLogger(__name__)

# Nginx's "client closed request": logged for requests whose client went away before the answer.
CLIENT_CLOSED = 499


def _error(status: int, message: str, err_type: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, status, param), status_code=status)


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro, prep: Prepared):
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


def _stream(body, prep: Prepared) -> StreamingResponse:
    # A response dropped before its body is iterated never runs the generator's `finally`: release then.
    weakref.finalize(body, prep.tracker.close)
    return StreamingResponse(body, media_type="text/event-stream")


SERVER_ID_HEADER = "x-kvgate-endpoint"


@functools.lru_cache(maxsize=64)
def _endpoint_header(host: str, port: int | None, fallback: str) -> tuple[bytes, bytes]:
    """(header name, "ip:port") for a connection's local address; an IPv4-mapped IPv6 address as plain IPv4."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:  # not an IP (a Unix socket path): what the server was told to listen on
        return SERVER_ID_HEADER.encode(), fallback.encode()
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    address = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
    return SERVER_ID_HEADER.encode(), address.encode()


class ServerIdMiddleware:
    """Adds which replica answered to every response (plain ASGI: streaming and disconnects untouched): the
    address this connection reached (its socket's local address, ASGI's scope["server"]), so a server listening
    on 0.0.0.0 (every pod the operator makes) names its pod IP, not the any-address it was told."""

    def __init__(self, app, server_id: str) -> None:
        self.app = app
        self.fallback = server_id

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        local = scope.get("server")
        header = _endpoint_header(str(local[0]), local[1], self.fallback) if local else \
            (SERVER_ID_HEADER.encode(), self.fallback.encode())

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(llm: AsyncLLM, served_model_name: str, max_queued_requests: int | None = None,
               on_fatal: Callable[[BaseException], None] | None = None, server_id: str | None = None) -> FastAPI:
    metrics = ServerMetrics(llm, served_model_name)
    serving = OpenAIServing(llm, served_model_name, metrics, max_queued_requests)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def start():
            try:
                await llm.start()
            except BaseException as exc:  # noqa: BLE001 - reported, then the server stops
                log.error("engine failed to start: %s", exc)
                app.state.startup_error = exc
                if on_fatal:
                    on_fatal(exc)

        app.state.startup_error = None
        starter = asyncio.create_task(start())
        try:
            yield
        finally:
            starter.cancel()
            await asyncio.gather(starter, return_exceptions=True)
            await llm.shutdown()

    app = FastAPI(title="kvgate engine", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.state.metrics = metrics

    if server_id:
        app.add_middleware(ServerIdMiddleware, server_id=server_id)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return _error(400, "The request body is not valid JSON.", "invalid_request_error")
        where = ".".join(loc) or "body"
        return _error(400, f"Invalid request: {where}: {first.get('msg', 'invalid value')}",
                      "invalid_request_error", loc[0] if loc else None)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, exc: InvalidRequestError):
        return _error(400, str(exc), "invalid_request_error", exc.param)

    @app.exception_handler(ModelNotFound)
    async def model_not_found(_: Request, exc: ModelNotFound):
        return _error(404, str(exc), "not_found_error", "model")

    @app.exception_handler(Overloaded)
    async def overloaded(_: Request, exc: Overloaded):
        return _error(503, str(exc), "overloaded_error")

    @app.exception_handler(EngineError)
    async def engine_error(_: Request, exc: EngineError):
        return _error(503, str(exc), "server_error")

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception):
        log.exception("unhandled error")
        return _error(500, f"Internal server error ({type(exc).__name__}).", "server_error")

    def require_ready() -> None:
        if not llm.ready:
            raise EngineError("the engine is not ready yet" if llm.error is None else f"the engine stopped: {llm.error}")

    @app.get("/health")
    async def health():
        if llm.ready:
            return Response(status_code=200)
        why = app.state.startup_error or llm.error
        return _error(503, f"engine not ready: {why}" if why else "engine is starting", "server_error")

    @app.get("/metrics")
    async def prometheus_metrics(request: Request):
        # ?name[]=... narrows the page to those samples, as prometheus_client's own exposition does (SGLang's,
        # some vLLM versions'): the EPP asks for only the families it reads, every 50 ms.
        names = request.query_params.getlist("name[]")
        registry = metrics.registry.restricted_registry(names) if names else metrics.registry
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        require_ready()
        return {"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": 0, "owned_by": "kvgate",
            "root": llm.config.model, "max_model_len": llm.info.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        require_ready()
        serving.check_model(req.model)
        if req.messages is not None:
            ids = serving.chat_prompt(ChatCompletionRequest(messages=req.messages,
                                                            add_generation_prompt=req.add_generation_prompt))
        elif req.prompt is not None:
            ids = llm.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            raise InvalidRequestError("give prompt or messages", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": llm.info.max_model_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        require_ready()
        serving.check_model(req.model)
        if any(not 0 <= t < llm.info.vocab_size for t in req.tokens):
            raise InvalidRequestError("tokens must be token ids of this model", param="tokens")
        return {"prompt": llm.tokenizer.decode(req.tokens)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        require_ready()
        prep = serving.prepare_completion(req)
        if req.stream:
            return _stream(serving.completion_stream(req, prep), prep)
        return await _unless_disconnected(raw, serving.completion(req, prep), prep)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        require_ready()
        prep = serving.prepare_chat(req)
        if req.stream:
            return _stream(serving.chat_stream(req, prep), prep)
        return await _unless_disconnected(raw, serving.chat(req, prep), prep)

    return app
