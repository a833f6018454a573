"""The HTTP server: routes, OpenAI-shaped errors, /health, /live, /metrics; `kvgate serve` runs it with uvicorn.

Health has three answers, for three readers:
- `/health` (readiness; what the EPP and a readiness probe ask): 200 only while the engine is ready and the
  server is not draining. 503 while loading, after SIGTERM (draining) and once the engine loop has died.
- `/live` (liveness): 200 unless the engine loop has died — loading and draining are alive — so a liveness
  probe restarts a server whose engine is gone but never one that is busy loading or finishing its streams.
- `/metrics`: the Prometheus text always, with status 503 whenever `/health` is 503 for a reason other than
  loading (draining, engine dead): a scraper that checks the status (the EPP) counts a failed scrape and
  stops routing there, instead of reading gauges that no longer move.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import json
import logging
import os
import time
import urllib.parse
import weakref
from collections.abc import Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvgate.engine.async_llm import AsyncLLM
from kvgate.common.errors import EngineError, InvalidRequestError
from kvgate.engine.generation_defaults import GenerationDefaults
from kvgate.engine.server.auth import PUBLIC_PATHS, ApiKeyAuth
from kvgate.engine.server.guards import RequestBodyLimit, StalledClientGuard
from kvgate.engine.server.limits import RequestLimits
from kvgate.engine.server.metrics import ServerMetrics
from kvgate.engine.server.openai_serving import (ModelNotFound, OpenAIServing, Overloaded, Prepared,
                                                 ShuttingDown)
from kvgate.engine.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                           LoadLoRAAdapterRequest, TokenizeRequest, UnloadLoRAAdapterRequest,
                                           error_body)
from kvgate.engine.server.render import generate_request
from kvgate.engine.server.serving_chat import OpenAIServingChat
from kvgate.engine.server.serving_completion import OpenAIServingCompletion

log = logging.getLogger(__name__)

# Nginx's "client closed request": logged for requests whose client went away before the answer.
CLIENT_CLOSED = 499

# vLLM's switch for POST /v1/load_lora_adapter and /v1/unload_lora_adapter ("1" or "true"; off by default).
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def _names_in(query_string: bytes) -> frozenset[str]:
    return frozenset(urllib.parse.parse_qs(query_string.decode("latin-1")).get("name[]", ()))  # as Starlette decodes


_cached_names_in = functools.lru_cache(maxsize=64)(_names_in)
_CACHED_QUERY_BYTES = 4096  # a scraper's query (the EPP's: ~600 bytes); a longer one is parsed every time


def scrape_names(query_string: bytes) -> frozenset[str]:
    """The `name[]` values of a /metrics query string. Cached: a scraper sends the same query every time, and
    parsing its dozen URL-encoded names was a quarter of a scrape's cost (cProfile); the cache holds at most 64
    queries of at most 4 KiB, so varied queries only evict each other."""
    if not query_string:
        return frozenset()
    if len(query_string) > _CACHED_QUERY_BYTES:
        return _names_in(query_string)
    return _cached_names_in(query_string)


def runtime_lora_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


def _json_bytes(body) -> bytes:
    """What JSONResponse would send (compact, UTF-8, no NaN)."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()


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


class ClosingStreamingResponse(StreamingResponse):
    """Closes its generator however the response ends (a send that failed or stalled included), so the
    generator's `finally` aborts its requests in the engine now, not whenever it is garbage-collected."""

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


def _stream(body, prep: Prepared) -> StreamingResponse:
    # A response dropped before its body is iterated never runs the generator's `finally`: release then.
    weakref.finalize(body, prep.tracker.close)
    return ClosingStreamingResponse(body, media_type="text/event-stream")


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


class MetricsPage:
    """GET (and HEAD) /metrics answered before the rest of the stack: `render(query string)` gives the status and
    the Prometheus text. Plain ASGI; every other request goes on to `app`."""

    def __init__(self, app, render: Callable[[bytes], tuple[int, bytes]]) -> None:
        self.app = app
        self.render = render

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/metrics" or scope["method"] not in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        status, body = self.render(scope.get("query_string", b""))
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", CONTENT_TYPE_LATEST.encode()), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body if scope["method"] == "GET" else b""})


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


def create_app(llm: AsyncLLM, served_model_name: str, limits: RequestLimits | None = None,
               on_fatal: Callable[[BaseException], None] | None = None, server_id: str | None = None,
               tool_parser: str | None = None, chat_template: str | None = None,
               response_role: str = "assistant", generation_defaults: GenerationDefaults | None = None,
               api_keys: Sequence[str] = ()) -> FastAPI:
    """`on_fatal(exc)`: the engine failed to start, or its loop died later (the caller decides to exit).
    `tool_parser`: the tool-call parser that serves `tool_choice: auto` (None: auto is refused).
    `chat_template`: the server's template (--chat-template, already checked: chat_template.load_server_template),
    used instead of the model's; `response_role`: the role chat answers name (--response-role).
    `generation_defaults`: the model's sampling defaults (None: read as the engine's config says).
    `api_keys`: when given, every request but the probes' and the scrape's needs one of them (auth.py)."""
    limits = limits or RequestLimits()
    metrics = ServerMetrics(llm, served_model_name)
    # shared: one admission for both APIs
    serving = OpenAIServing(llm, served_model_name, metrics, limits, chat_template=chat_template,
                            generation_defaults=generation_defaults)
    serving_completion = OpenAIServingCompletion(serving)
    serving_chat = OpenAIServingChat(serving, tool_parser, response_role)
    llm.on_dead = on_fatal

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
        app.state.loop = asyncio.get_running_loop()
        starter = asyncio.create_task(start())
        try:
            yield
        finally:
            starter.cancel()
            await asyncio.gather(starter, return_exceptions=True)
            await llm.shutdown()
            serving.close()

    app = FastAPI(title="kvgate engine", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.state.metrics = metrics

    # Outermost last: the body limit answers before anything else reads the body.
    app.add_middleware(StalledClientGuard, timeout=limits.client_stall_timeout)
    if server_id:
        app.add_middleware(ServerIdMiddleware, server_id=server_id)
    app.add_middleware(RequestBodyLimit, max_bytes=limits.max_request_body_bytes)

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

    @app.exception_handler(ShuttingDown)
    async def shutting_down(_: Request, exc: ShuttingDown):
        return _error(503, str(exc), "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException):
        # Framework errors (unknown path, wrong method, a body that cannot be parsed) in OpenAI's shape too.
        err_type = "not_found_error" if exc.status_code == 404 else (
            "invalid_request_error" if exc.status_code < 500 else "server_error")
        return JSONResponse(error_body(str(exc.detail), err_type, exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

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
        serving.check_accepting()

    def not_serving_reason() -> str | None:
        """Why /health is 503 (None: healthy)."""
        if llm.error is not None:
            return f"engine not ready: the engine stopped: {llm.error}"
        if serving.shutting_down:
            return serving.shutting_down
        if not llm.ready:
            why = app.state.startup_error
            return f"engine not ready: {why}" if why else "engine is starting"
        return None

    @app.get("/health")
    async def health():
        why = not_serving_reason()
        return Response(status_code=200) if why is None else _error(503, why, "server_error")

    @app.get("/live")
    async def live():
        if llm.error is not None:
            return _error(503, f"the engine stopped: {llm.error}", "server_error")
        return Response(status_code=200)

    def metrics_page(query_string: bytes) -> tuple[int, bytes]:
        # ?name[]=... narrows the page to those samples, as prometheus_client's own exposition does (SGLang's,
        # some vLLM versions'): the EPP asks for only the families it reads, every 50 ms.
        names = scrape_names(query_string)
        # 503 while the engine is starting, draining or dead: the EPP counts that as a failed scrape, so an engine
        # gets requests only while it can serve them (vLLM's server does not answer at all until it is ready).
        return 200 if not_serving_reason() is None else 503, metrics.page(names or None)

    # Outermost but for the API-key check: every EPP scrapes every replica every 50 ms, and the stack below
    # (FastAPI's dependency solving, which parses the query string too, and five middlewares) cost more than the
    # page itself. Measured with the EPP's filtered scrape on a `--backend sim` server, httptools + uvloop, 1000
    # scrapes, server CPU per scrape: 0.90 ms as a FastAPI route, 0.55 ms answered here (median of 5 runs,
    # 0.51-0.65), three quarters of it then generate_latest (cProfile; the stats families are now written by
    # exposition.py).
    app.add_middleware(MetricsPage, render=metrics_page)
    if api_keys:
        # Outermost of all (added last): a client without a key is answered before any middleware reads its body.
        # /metrics is public, so the scrape costs one more ASGI call and a set lookup.
        app.add_middleware(ApiKeyAuth, keys=list(api_keys))
        log.info("API keys required (%d accepted) on every request but GET/HEAD %s and OPTIONS", len(api_keys),
                 ", ".join(sorted(PUBLIC_PATHS)))

    # MetricsPage answers GET and HEAD before they get here; the route is what makes other methods a 405
    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics(request: Request):
        status, body = metrics_page(request.scope.get("query_string", b""))
        return Response(body, media_type=CONTENT_TYPE_LATEST, status_code=status)

    @app.get("/v1/models")
    async def models():
        require_ready()
        base = {"id": served_model_name, "object": "model", "created": 0, "owned_by": "kvgate",
                "root": llm.config.model, "parent": None, "max_model_len": llm.info.max_model_len}
        adapters = [{"id": lora.lora_name, "object": "model", "created": 0, "owned_by": "kvgate",
                     "root": lora.lora_path, "parent": lora.base_model_name or served_model_name,
                     "max_model_len": llm.info.max_model_len}
                    for lora in sorted(llm.loras.values(), key=lambda lora: lora.lora_int_id)]
        return {"object": "list", "data": [base, *adapters]}

    if runtime_lora_updating_allowed():
        # vLLM's endpoints, behind vLLM's switch (off by default): the path is read by this server with its own
        # permissions, so only trusted callers may reach them.
        log.warning("runtime LoRA updating is on (%s): any caller of this server can load adapters from its "
                    "file system", RUNTIME_LORA_ENV)

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(req: LoadLoRAAdapterRequest):
            require_ready()
            if req.lora_name == served_model_name:
                raise InvalidRequestError(f"{req.lora_name!r} is the base model's name", param="lora_name")
            await llm.add_lora(req.lora_name, req.lora_path)
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(req: UnloadLoRAAdapterRequest):
            require_ready()
            if not await llm.remove_lora(req.lora_name):
                return _error(404, f"The lora adapter '{req.lora_name}' cannot be found.", "not_found_error",
                              "lora_name")
            return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    async def json_off_loop(body, param: str) -> Response:
        """An answer that may be large (token ids), serialized in the tokenizer pool: on the event loop, 2M ids
        took seconds, and every other request (/health too) waited."""
        return Response(await serving.off_loop(_json_bytes, body, param=param), media_type="application/json")

    def within_max_model_len(count: int, what: str, param: str) -> None:
        """/tokenize and /detokenize answer at most max_model_len tokens: no prompt the model can take is longer."""
        limit = llm.info.max_model_len
        if count > limit:
            raise InvalidRequestError(f"{what} {count} tokens, more than this model's max_model_len ({limit}): "
                                      f"this endpoint takes at most max_model_len tokens", param=param)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        require_ready()
        serving.check_model(req.model)
        if req.messages is not None:
            param = "messages"
            chat = ChatCompletionRequest(messages=req.messages, add_generation_prompt=req.add_generation_prompt)
            kwargs = serving.template_kwargs(req.chat_template, req.chat_template_kwargs)
            ids = await serving.off_loop(serving.chat_prompt, chat, kwargs, param=param)
        elif req.prompt is not None:
            param = "prompt"
            def encode() -> list[int]:  # a prompt over max_model_len is refused before it is tokenized whole
                serving.refuse_over_long(req.prompt, special=req.add_special_tokens)
                return llm.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
            ids = await serving.off_loop(encode)
        else:
            raise InvalidRequestError("give prompt or messages", param="prompt")
        within_max_model_len(len(ids), "the prompt is", param)
        return await json_off_loop({"tokens": ids, "count": len(ids), "max_model_len": llm.info.max_model_len},
                                   param)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        require_ready()
        serving.check_model(req.model)
        within_max_model_len(len(req.tokens), "tokens has", "tokens")
        if any(not 0 <= t < llm.info.vocab_size for t in req.tokens):
            raise InvalidRequestError(f"tokens must be token ids of this model, in [0, {llm.info.vocab_size})",
                                      param="tokens")
        text = await serving.off_loop(llm.tokenizer.decode, req.tokens, param="tokens")
        return await json_off_loop({"prompt": text}, "tokens")

    @app.post("/v1/completions/render")
    async def render_completions(req: CompletionRequest):
        require_ready()
        prompts, params = await serving_completion.render(req)  # each prompt < max_model_len tokens
        return await json_off_loop([generate_request("cmpl", ids, p, req) for ids, p in zip(prompts, params)],
                                   "prompt")

    @app.post("/v1/chat/completions/render")
    async def render_chat_completions(req: ChatCompletionRequest):
        require_ready()
        ids, params = await serving_chat.render(req)
        return await json_off_loop(generate_request("chatcmpl", ids, params, req), "messages")

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        require_ready()
        prep = await serving_completion.prepare(req)
        if req.stream:
            return _stream(serving_completion.stream(req, prep), prep)
        return await _unless_disconnected(raw, serving_completion.response(req, prep), prep)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        require_ready()
        prep = await serving_chat.prepare(req)
        if req.stream:
            return _stream(serving_chat.stream(req, prep), prep)
        return await _unless_disconnected(raw, serving_chat.response(req, prep), prep)

    def drain(shutdown_timeout: float, then: Callable[[], None]) -> None:
        """SIGTERM: refuse new requests (503) and fail /health at once; let running requests finish for up to
        `shutdown_timeout` s, fail what is left with a clean error, then call `then` (the server exits).
        Safe to call from a signal handler."""

        async def run():
            serving.shutting_down = "the server is shutting down"
            open_now = serving.open_requests
            log.info("draining: %d requests running, up to %g s (--shutdown-timeout)", open_now, shutdown_timeout)
            deadline = time.monotonic() + shutdown_timeout
            while serving.open_requests and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if serving.open_requests:
                cut = llm.abort_all(f"the server is shutting down: the request did not finish within "
                                    f"{shutdown_timeout:g} s (--shutdown-timeout)")
                log.warning("drain: %d requests did not finish in %g s; failed them", cut, shutdown_timeout)
                await asyncio.sleep(0.1)  # let their error events be written
            else:
                log.info("drained: every running request finished")
            then()

        app.state.loop.call_soon_threadsafe(lambda: app.state.__setattr__("drain_task", asyncio.ensure_future(run())))

    app.state.drain = drain
    return app
