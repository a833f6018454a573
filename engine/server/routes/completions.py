"""The OpenAI generation APIs, POST /v1/completions and /v1/chat/completions (streamed as SSE or answered whole),
and vLLM's render endpoints for each (render.py: the request the engine would get, without generating)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvgate.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from kvgate.engine.server.render import generate_request
from kvgate.engine.server.responses import event_stream, json_off_loop, unless_disconnected
from kvgate.engine.server.state import server_state

router = APIRouter()


@router.post("/v1/completions/render")
async def render_completions(req: CompletionRequest, request: Request):
    server = server_state(request)
    server.require_ready()
    prompts, params = await server.completion.render(req)  # each prompt < max_model_len tokens
    return await json_off_loop(server.serving,
                               [generate_request("cmpl", ids, p, req) for ids, p in zip(prompts, params)], "prompt")


@router.post("/v1/chat/completions/render")
async def render_chat_completions(req: ChatCompletionRequest, request: Request):
    server = server_state(request)
    server.require_ready()
    ids, params = await server.chat.render(req)
    return await json_off_loop(server.serving, generate_request("chatcmpl", ids, params, req), "messages")


@router.post("/v1/completions")
async def completions(req: CompletionRequest, raw: Request):
    server = server_state(raw)
    server.require_ready()
    prep = await server.completion.prepare(req)
    if server.tracing is not None:
        server.tracing.start(raw.headers, "text_completion", server.serving.response_model(req), prep)
    if req.stream:
        return event_stream(server.completion.stream(req, prep), prep)
    return await unless_disconnected(raw, server.completion.response(req, prep), prep)


@router.post("/v1/chat/completions")
async def chat_completions(req: ChatCompletionRequest, raw: Request):
    server = server_state(raw)
    server.require_ready()
    prep = await server.chat.prepare(req)
    if server.tracing is not None:
        server.tracing.start(raw.headers, "chat", server.serving.response_model(req), prep)
    if req.stream:
        return event_stream(server.chat.stream(req, prep), prep)
    return await unless_disconnected(raw, server.chat.response(req, prep), prep)
