"""The Anthropic Messages API: POST /v1/messages (streamed as Anthropic's SSE events or answered whole) and POST
/v1/messages/count_tokens (the prompt's token count, generating nothing), on chat's engine path
(serving_messages.py); their errors in Anthropic's shape (anthropic_errors.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvgate.common.errors import InvalidRequestError
from kvgate.engine.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from kvgate.engine.server.chat_bridge import renamed
from kvgate.engine.server.responses import event_stream, unless_disconnected
from kvgate.engine.server.serving_messages import PARAM_NAMES
from kvgate.engine.server.state import server_state

router = APIRouter()


@router.post("/v1/messages")
async def create_message(req: MessagesRequest, raw: Request):
    server = server_state(raw)
    server.require_ready()
    try:
        chat_req = server.messages.chat_request(req)
        prep = await server.chat.prepare(chat_req)
    except InvalidRequestError as exc:
        raise renamed(exc, PARAM_NAMES) from None
    if server.tracing is not None:
        server.tracing.start(raw.headers, "messages", server.serving.response_model(chat_req), prep)
    if req.stream:
        return event_stream(server.messages.stream(req, chat_req, prep), prep)
    return await unless_disconnected(raw, server.messages.response(req, chat_req, prep), prep)


@router.post("/v1/messages/count_tokens")
async def count_tokens(req: CountTokensRequest, raw: Request):
    """The conversation's prompt tokens, as /v1/messages would count them (the same checks, nothing admitted)."""
    server = server_state(raw)
    server.require_ready()
    try:
        ids, _ = await server.chat.render(server.messages.chat_request(req))
    except InvalidRequestError as exc:
        raise renamed(exc, PARAM_NAMES) from None
    return {"input_tokens": len(ids)}
