"""The OpenAI Responses API: POST /v1/responses (streamed as its SSE events or answered whole) and GET
/v1/responses/{id} (a stored response), on chat's engine path (serving_responses.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvgate.common.errors import InvalidRequestError
from kvgate.engine.server.chat_bridge import renamed
from kvgate.engine.server.responses import error_response, event_stream, unless_disconnected
from kvgate.engine.server.responses_protocol import MAX_RESPONSE_ID_CHARS, ResponsesRequest
from kvgate.engine.server.server_id import local_address
from kvgate.engine.server.serving_responses import PARAM_NAMES, PreviousResponseNotFound
from kvgate.engine.server.state import server_state

router = APIRouter()


@router.post("/v1/responses")
async def create_response(req: ResponsesRequest, raw: Request):
    server = server_state(raw)
    server.require_ready()
    try:
        chat_req, conversation = server.responses.chat_request(req)
        prep = await server.chat.prepare(chat_req)
    except InvalidRequestError as exc:
        raise renamed(exc, PARAM_NAMES) from None
    except PreviousResponseNotFound as exc:
        return error_response(404, str(exc), "invalid_request_error", "previous_response_id")
    if server.tracing is not None:
        server.tracing.start(raw.headers, "responses", server.serving.response_model(chat_req), prep)
    endpoint = local_address(raw.scope)
    if req.stream:
        return event_stream(server.responses.stream(req, chat_req, conversation, prep, endpoint), prep)
    return await unless_disconnected(raw, server.responses.response(req, chat_req, conversation, prep, endpoint),
                                     prep)


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request):
    if len(response_id) > MAX_RESPONSE_ID_CHARS:
        return error_response(404, "Response not found.", "invalid_request_error", "response_id")
    try:
        return server_state(request).responses.retrieve(response_id)
    except PreviousResponseNotFound as exc:
        return error_response(404, str(exc), "invalid_request_error", "response_id")
