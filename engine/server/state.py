"""What the engine server's routes share: one `ServerState` per app, built by create_app and kept on
`app.state.server`; a route reads it with `server_state(request)`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from kvgate.common.errors import EngineError
from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.server.metrics import ServerMetrics
from kvgate.engine.server.openai_serving import OpenAIServing
from kvgate.engine.server.serving_chat import OpenAIServingChat
from kvgate.engine.server.serving_completion import OpenAIServingCompletion
from kvgate.engine.server.tracing import EngineTracing

if TYPE_CHECKING:
    from kvgate.engine.server.serving_messages import AnthropicServingMessages
    from kvgate.engine.server.serving_responses import OpenAIServingResponses


@dataclass(eq=False)
class ServerState:
    """The engine, the served name, the metrics and the serving objects (one `OpenAIServing`, so one admission for
    both APIs), plus what the app's lifespan records: the engine's start error and the event loop."""

    llm: AsyncLLM
    served_model_name: str
    metrics: ServerMetrics
    serving: OpenAIServing
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    # the engine failed to start, or its loop died later (the caller decides to exit)
    on_fatal: Callable[[BaseException], None] | None = None
    startup_error: BaseException | None = None  # set by the lifespan when the engine fails to start
    loop: asyncio.AbstractEventLoop | None = None  # the server's event loop, once the lifespan runs
    drain_task: asyncio.Task | None = None  # the SIGTERM drain, once started (lifecycle.start_drain)
    tracing: EngineTracing | None = None  # OpenTelemetry request spans (tracing.py); None: tracing is off
    # the Responses and Anthropic Messages APIs, on `chat`'s path (serving_responses.py, serving_messages.py)
    responses: "OpenAIServingResponses | None" = None
    messages: "AnthropicServingMessages | None" = None

    def require_ready(self) -> None:
        """Raise unless the engine is ready and the server accepts requests (EngineError, ShuttingDown: 503)."""
        llm = self.llm
        if not llm.ready:
            raise EngineError("the engine is not ready yet" if llm.error is None
                              else f"the engine stopped: {llm.error}")
        self.serving.check_accepting()

    def not_serving_reason(self) -> str | None:
        """Why /health is 503 (None: healthy)."""
        llm = self.llm
        if llm.error is not None:
            return f"engine not ready: the engine stopped: {llm.error}"
        if self.serving.shutting_down:
            return self.serving.shutting_down
        if not llm.ready:
            why = self.startup_error
            return f"engine not ready: {why}" if why else "engine is starting"
        return None


def server_state(request: Request) -> ServerState:
    return request.app.state.server
