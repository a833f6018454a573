"""POST /tokenize (a prompt, or chat messages through the template) and POST /detokenize, as vLLM's: each answers
at most max_model_len tokens, tokenizing and serializing in the tokenizer pool, off the event loop."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvgate.common.errors import InvalidRequestError
from kvgate.engine.server.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from kvgate.engine.server.responses import json_off_loop
from kvgate.engine.server.state import server_state

router = APIRouter()


def within_max_model_len(count: int, limit: int, what: str, param: str) -> None:
    """/tokenize and /detokenize answer at most max_model_len tokens: no prompt the model can take is longer."""
    if count > limit:
        raise InvalidRequestError(f"{what} {count} tokens, more than this model's max_model_len ({limit}): "
                                  f"this endpoint takes at most max_model_len tokens", param=param)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request):
    server = server_state(request)
    server.require_ready()
    serving, llm = server.serving, server.llm
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
    within_max_model_len(len(ids), llm.info.max_model_len, "the prompt is", param)
    return await json_off_loop(serving, {"tokens": ids, "count": len(ids), "max_model_len": llm.info.max_model_len},
                               param)


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request):
    server = server_state(request)
    server.require_ready()
    serving, llm = server.serving, server.llm
    serving.check_model(req.model)
    within_max_model_len(len(req.tokens), llm.info.max_model_len, "tokens has", "tokens")
    if any(not 0 <= t < llm.info.vocab_size for t in req.tokens):
        raise InvalidRequestError(f"tokens must be token ids of this model, in [0, {llm.info.vocab_size})",
                                  param="tokens")
    text = await serving.off_loop(llm.tokenizer.decode, req.tokens, param="tokens")
    return await json_off_loop(serving, {"prompt": text}, "tokens")
