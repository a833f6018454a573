"""What the Responses and Anthropic Messages APIs share with chat: each request becomes a ChatCompletionRequest
and runs through OpenAIServingChat (the same checks, limits, admission, template, tool-call parsing and engine
path), and the chat answer is read back — whole, or chunk by chunk from chat's own SSE stream — and rewritten in
the API's shape (serving_responses.py, serving_messages.py)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Protocol

from pydantic import ValidationError

from kvgate.common import bounded_json
from kvgate.common.errors import InvalidRequestError
from kvgate.engine.server.protocol import ChatCompletionRequest, SamplingFields

# vLLM's sampling extensions (chat's fields) that a Responses or Messages request may carry as extra fields: passed
# on to chat as they are, after the API's own fields (which win)
PASSED_ON = frozenset({"top_k", "min_p", "seed", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
                       "repetition_penalty", "ignore_eos", "min_tokens", "skip_special_tokens", "cache_salt",
                       "priority", "logit_bias", "structured_outputs"}) & frozenset(SamplingFields.model_fields)


def chat_request(fields: dict) -> ChatCompletionRequest:
    """The chat request `fields` make; a field of the wrong type is a 400 naming it, as chat's own are."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = [str(x) for x in first.get("loc", ())]
        raise InvalidRequestError(f"Invalid request: {'.'.join(loc) or 'body'}: {first.get('msg', 'invalid')}",
                                  param=loc[0] if loc else None) from None


def renamed(exc: InvalidRequestError, names: dict[str, str]) -> InvalidRequestError:
    """`exc` with its param under the API's own name (chat's `max_tokens` is the Responses API's
    `max_output_tokens`, ...)."""
    if exc.param in names:
        return InvalidRequestError(str(exc), param=names[exc.param])
    return exc


def passed_on(extra: dict | None) -> dict:
    return {key: value for key, value in (extra or {}).items() if key in PASSED_ON}


async def chat_chunks(stream: AsyncIterator[str]) -> AsyncIterator[dict]:
    """Chat's SSE stream as its chunk objects (an in-band error is a chunk with `error`), up to `[DONE]`. Closing
    this generator closes chat's, which aborts the request in the engine."""
    try:
        async for event in stream:
            data = event[len("data: "):].strip()
            if data == "[DONE]":
                return
            yield json.loads(data)
    finally:
        await stream.aclose()


class EventShaper(Protocol):
    """What turns chat's chunks into another API's stream events (serving_responses' ResponseEvents,
    serving_messages' MessageEvents)."""

    failed: bool

    def start(self) -> list[dict]: ...

    def feed(self, chunk: dict) -> list[dict]: ...

    def finish(self) -> list[dict]: ...


def sse_event(event: dict) -> str:
    """One event as SSE with its `event:` line, as the Responses and Anthropic streams send them."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


async def relay_events(events: EventShaper, stream: AsyncIterator[str]) -> AsyncIterator[str]:
    """Chat's SSE `stream` re-sent as `events` shapes it; ends early once `events.failed` (an in-band error was
    sent). However it ends, chat's stream is closed, which aborts the request in the engine."""
    for event in events.start():
        yield sse_event(event)
    chunks = chat_chunks(stream)
    try:
        async for chunk in chunks:
            for event in events.feed(chunk):
                yield sse_event(event)
            if events.failed:
                return
    finally:
        await chunks.aclose()
    for event in events.finish():
        yield sse_event(event)


def arguments_object(arguments: str) -> dict:
    """A tool call's `arguments` JSON text as an object (Anthropic's `input`); {} when it is not one (an output
    cut short). The model's text: nesting is bounded before it is parsed."""
    try:
        bounded_json.check_depth(arguments)
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def text_of(parts, param: str, text_types: tuple[str, ...], joiner: str = "") -> str:
    """A content value (a string, or a list of text parts of `text_types`, joined by `joiner`) as one string."""
    if isinstance(parts, str):
        return parts
    if not isinstance(parts, list):
        raise InvalidRequestError(f"{param} must be a string or a list of text parts", param=param.split("[")[0])
    out = []
    for k, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") not in text_types or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise InvalidRequestError(f"{param}[{k}]: content of type {kind!r} is not supported (text only: "
                                      f"{', '.join(text_types)})", param=param.split("[")[0].split(".")[0])
        out.append(part["text"])
    return joiner.join(out)
