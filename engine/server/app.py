"""The engine's HTTP app: create_app builds the shared state, the middleware stack and the exception handlers,
and includes each group's router (routes/); the lifespan starts the engine in the background and shuts it down.
`kvgate serve` (cli.py) runs the app with uvicorn."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from fastapi import FastAPI

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.generation_defaults import GenerationDefaults
from kvgate.engine.server.anthropic_errors import AnthropicErrorShape
from kvgate.engine.server.auth import PUBLIC_PATHS, ApiKeyAuth
from kvgate.engine.server.exception_handlers import EXCEPTION_HANDLERS
from kvgate.engine.server.guards import RequestBodyLimit, StalledClientGuard
from kvgate.engine.server.limits import RequestLimits
from kvgate.engine.server.metrics import ServerMetrics
from kvgate.engine.server.openai_serving import OpenAIServing
from kvgate.engine.server.response_store import ResponseStore
from kvgate.engine.server.routes import completions, health, lora, messages, models, responses, tokenize
from kvgate.engine.server.server_id import ServerIdMiddleware
from kvgate.engine.server.serving_chat import OpenAIServingChat
from kvgate.engine.server.serving_completion import OpenAIServingCompletion
from kvgate.engine.server.serving_messages import AnthropicServingMessages
from kvgate.engine.server.serving_responses import OpenAIServingResponses
from kvgate.engine.server.tracing import EngineTracing
from kvgate.engine.server.state import ServerState

log = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI):
    """Starts the engine without holding up the server (/health says 503 until it is ready; a start that fails is
    recorded and reported to `on_fatal`), and on the way out stops it and the tokenizer pool."""
    server: ServerState = app.state.server

    async def start():
        try:
            await server.llm.start()
        except BaseException as exc:  # noqa: BLE001 - reported, then the server stops
            log.error("engine failed to start: %s", exc)
            server.startup_error = exc
            if server.on_fatal:
                server.on_fatal(exc)

    server.startup_error = None
    server.loop = asyncio.get_running_loop()
    starter = asyncio.create_task(start())
    try:
        yield
    finally:
        starter.cancel()
        await asyncio.gather(starter, return_exceptions=True)
        await server.llm.shutdown()
        server.serving.close()


def create_app(llm: AsyncLLM, served_model_name: str, limits: RequestLimits | None = None,
               on_fatal: Callable[[BaseException], None] | None = None, server_id: str | None = None,
               tool_parser: str | None = None, chat_template: str | None = None,
               response_role: str = "assistant", generation_defaults: GenerationDefaults | None = None,
               api_keys: Sequence[str] = (), tracing=None, response_store: ResponseStore | None = None,
               reasoning_parser: str | None = None) -> FastAPI:
    """`on_fatal(exc)`: the engine failed to start, or its loop died later (the caller decides to exit).
    `tool_parser`: the tool-call parser that serves `tool_choice: auto` (None: auto is refused).
    `reasoning_parser`: the parser that splits a thinking model's reasoning from its answer (None: not split).
    `chat_template`: the server's template (--chat-template, already checked: chat_template.load_server_template),
    used instead of the model's; `response_role`: the role chat answers name (--response-role).
    `generation_defaults`: the model's sampling defaults (None: read as the engine's config says).
    `api_keys`: when given, every request but the probes' and the scrape's needs one of them (auth.py).
    `tracing`: kvgate.common.tracing.Tracing when request spans are exported (tracing.py), else None.
    `response_store`: the Responses API's stored responses (response_store.py; None: its default bounds)."""
    limits = limits or RequestLimits()
    metrics = ServerMetrics(llm, served_model_name)
    serving = OpenAIServing(llm, served_model_name, metrics, limits, chat_template=chat_template,
                            generation_defaults=generation_defaults)
    server = ServerState(llm, served_model_name, metrics, serving, OpenAIServingCompletion(serving),
                         OpenAIServingChat(serving, tool_parser, response_role, reasoning_parser), on_fatal,
                         tracing=EngineTracing(tracing) if tracing is not None else None)
    server.responses = OpenAIServingResponses(server.chat, response_store or ResponseStore())
    server.messages = AnthropicServingMessages(server.chat)
    llm.on_dead = on_fatal
    app = FastAPI(title="kvgate engine", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server

    # Outermost last: the body limit answers before anything else reads the body.
    app.add_middleware(StalledClientGuard, timeout=limits.client_stall_timeout)
    if server_id:
        app.add_middleware(ServerIdMiddleware, server_id=server_id)
    app.add_middleware(RequestBodyLimit, max_bytes=limits.max_request_body_bytes)
    for exc_class, handler in EXCEPTION_HANDLERS:
        app.add_exception_handler(exc_class, handler)
    # GET and HEAD /metrics answered outside all but the API-key check (routes/health.py says why).
    app.add_middleware(health.MetricsPage, server=server)
    if api_keys:
        # Outermost of all (added last): a client without a key is answered before any middleware reads its body.
        # /metrics is public, so the scrape costs one more ASGI call and a set lookup.
        app.add_middleware(ApiKeyAuth, keys=list(api_keys))
        log.info("API keys required (%d accepted) on every request but GET/HEAD %s and OPTIONS", len(api_keys),
                 ", ".join(sorted(PUBLIC_PATHS)))
    # Outermost: every error answer on the Anthropic API's path, the 401 and 413 included, in Anthropic's shape.
    app.add_middleware(AnthropicErrorShape)

    app.include_router(health.router)
    app.include_router(models.router)
    if lora.runtime_lora_updating_allowed():
        log.warning("runtime LoRA updating is on (%s): any caller of this server can load adapters from its "
                    "file system", lora.RUNTIME_LORA_ENV)
        app.include_router(lora.router)
    app.include_router(tokenize.router)
    app.include_router(completions.router)
    app.include_router(responses.router)
    app.include_router(messages.router)
    return app
