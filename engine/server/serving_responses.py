"""POST /v1/responses (the OpenAI Responses API) on chat's engine path (chat_bridge.py): the request's
`instructions`, `input` (a string, or message / function_call / function_call_output items) and, with
`previous_response_id`, the stored conversation before it (response_store.py) become a chat conversation; its
`tools` (function tools), `tool_choice`, `max_output_tokens`, `temperature`, `top_p` and `text.format` become
chat's fields. The chat answer comes back as Response output items — `reasoning` (when the chat message has
reasoning_content), `message` (its text), one `function_call` per tool call — whole, or streamed as the
Responses events (response.created, response.in_progress, response.output_item.added,
response.content_part.added, response.output_text.delta, ..., response.completed; response.incomplete when
max_output_tokens cut it). Errors are OpenAI's shape, with the Responses API's field names.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator

from kvgate.common.errors import InvalidRequestError
from kvgate.common.response_ids import new_response_id
from kvgate.engine.server.chat_bridge import chat_request, passed_on, relay_events, text_of
from kvgate.engine.server.openai_serving import Prepared
from kvgate.engine.server.protocol import ChatCompletionRequest
from kvgate.engine.server.response_store import ResponseStore
from kvgate.engine.server.responses_protocol import ResponsesRequest
from kvgate.engine.server.serving_chat import OpenAIServingChat

# chat's parameter names in errors, as the Responses API names them
PARAM_NAMES = {"max_tokens": "max_output_tokens", "messages": "input", "prompt": "input",
               "response_format": "text", "structured_outputs": "structured_outputs"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class PreviousResponseNotFound(Exception):
    """`previous_response_id` names no stored response (404)."""


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def conversation_of(req: ResponsesRequest, before: list[dict]) -> list[dict]:
    """The chat messages of `before` (a stored conversation) and then the request's input (instructions apart)."""
    messages = list(before)
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for k, item in enumerate(req.input):
        where = f"input[{k}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise InvalidRequestError(f"{where}.role must be user, assistant, system or developer",
                                          param="input")
            messages.append({"role": role, "content": text_of(item.get("content", ""), f"{where}.content",
                                                               _TEXT_PARTS)})
        elif kind == "function_call":
            fields = {f: item.get(f) for f in ("call_id", "name", "arguments")}
            if not all(isinstance(v, str) and v for v in fields.values()):
                raise InvalidRequestError(f"{where}: a function_call needs call_id, name and arguments strings",
                                          param="input")
            call = {"id": fields["call_id"], "type": "function",
                    "function": {"name": fields["name"], "arguments": fields["arguments"]}}
            if messages and messages[-1]["role"] == "assistant":  # the same turn's text, or its other calls
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not call_id:
                raise InvalidRequestError(f"{where}: a function_call_output needs a call_id string", param="input")
            messages.append({"role": "tool", "tool_call_id": call_id,
                             "content": text_of(output, f"{where}.output", _TEXT_PARTS)})
        elif kind == "reasoning":  # earlier reasoning: not part of the prompt (chat templates drop it too)
            continue
        else:
            raise InvalidRequestError(f"{where}: input items of type {kind!r} are not supported (message, "
                                      "function_call, function_call_output, reasoning)", param="input")
    return messages


def _tools(req: ResponsesRequest) -> list[dict] | None:
    if req.tools is None:
        return None
    tools = []
    for k, tool in enumerate(req.tools):
        if tool.get("type") != "function":
            raise InvalidRequestError(f"tools[{k}]: tools of type {tool.get('type')!r} are not supported (function "
                                      "tools only)", param="tools")
        tools.append({"type": "function", "function": {
            key: tool[key] for key in ("name", "description", "parameters", "strict") if tool.get(key) is not None}})
    return tools


def _tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise InvalidRequestError("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                              param="tool_choice")


def _response_format(text: dict | None):
    fmt = (text or {}).get("format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {
            key: fmt[key] for key in ("name", "description", "schema", "strict") if fmt.get(key) is not None}}
    raise InvalidRequestError("text.format.type must be text, json_object or json_schema", param="text")


def chat_fields(req: ResponsesRequest, messages: list[dict]) -> dict:
    """The chat request's body for a Responses request whose conversation is `messages`."""
    if req.instructions:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    fields = passed_on(req.model_extra)
    fields.update(model=req.model, messages=messages, max_tokens=req.max_output_tokens, temperature=req.temperature,
                  top_p=req.top_p, stream=req.stream, tools=_tools(req), tool_choice=_tool_choice(req.tool_choice),
                  parallel_tool_calls=req.parallel_tool_calls, response_format=_response_format(req.text))
    if req.stream:
        fields["stream_options"] = {"include_usage": True}
    return {k: v for k, v in fields.items() if v is not None}


def response_usage(usage: dict | None) -> dict | None:
    if usage is None:
        return None
    # cache_write_tokens is OpenAI's count of tokens written to a cache kept on request; kvgate has no such cache
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def message_item(text: str, status: str = "completed") -> dict:
    return {"id": _id("msg"), "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"id": _id("rs"), "type": "reasoning", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}


def function_call_item(call: dict, status: str = "completed") -> dict:
    return {"id": _id("fc"), "type": "function_call", "status": status, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"]}


def output_items(message: dict) -> list[dict]:
    """A chat message as Response output items: its reasoning, its text, its tool calls."""
    items = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")  # vLLM's newer name
    if reasoning:
        items.append(reasoning_item(reasoning))
    if message.get("content"):
        items.append(message_item(message["content"]))
    items += [function_call_item(call) for call in message.get("tool_calls") or ()]
    return items


def answer_message(output: list[dict]) -> dict:
    """The chat message a response's output continues as (what a follow-up's conversation holds)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


class ResponseShape:
    """The Response object's fields that come from the request, and the finished object."""

    def __init__(self, req: ResponsesRequest, model: str, stored: bool, endpoint: str = "") -> None:
        self.id = new_response_id(endpoint)  # tagged with the answering engine (response_ids.py)
        self.created_at = int(time.time())
        self.req = req
        self.model = model
        self.stored = stored

    def object(self, status: str, output: list[dict], usage: dict | None = None,
               finish_reason: str | None = None) -> dict:
        req = self.req
        incomplete = status == "in_progress" or finish_reason != "length"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status if incomplete else "incomplete", "background": False, "error": None,
            "incomplete_details": None if incomplete else {"reason": "max_output_tokens"},
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": None, "store": self.stored,
            "temperature": req.temperature, "top_p": req.top_p, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.tools or [], "truncation": "disabled",
            "usage": response_usage(usage), "user": req.user, "metadata": req.metadata or {},
        }


class ResponseEvents:
    """Chat's stream chunks in, Responses stream events out (each a dict with `type` and `sequence_number`)."""

    def __init__(self, shape: ResponseShape) -> None:
        self.shape = shape
        self.seq = 0
        self.output: list[dict] = []
        self.open: dict | None = None  # the output item being streamed
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self.failed = False

    def _event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def start(self) -> list[dict]:
        in_progress = self.shape.object("in_progress", [])
        return [self._event("response.created", response=in_progress),
                self._event("response.in_progress", response=in_progress)]

    def feed(self, chunk: dict) -> list[dict]:
        if "error" in chunk:
            self.failed = True
            error = chunk["error"]
            return [*self._close(), self._event("error", code=error.get("type"), message=error.get("message"),
                                                param=error.get("param"))]
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                out += self._text("reasoning", reasoning)
            if delta.get("content"):
                out += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def finish(self) -> list[dict]:
        """The last events: the open item closed, then response.completed (or .incomplete)."""
        out = self._close()
        final = self.final()
        return [*out, self._event(f"response.{final['status']}", response=final)]

    def final(self) -> dict:
        return self.shape.object("completed", self.output, self.usage, self.finish_reason)

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def _text(self, kind: str, text: str) -> list[dict]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self._close()
            item = message_item("", "in_progress") if kind == "message" else reasoning_item("", "in_progress")
            part = item["content"][0]
            self.open = {**item, "content": []}
            out.append(self._event("response.output_item.added", output_index=len(self.output), item=self.open))
            self.open = {**item}
            out.append(self._event("response.content_part.added", **self._where(), content_index=0,
                                   part=dict(part)))
        part = self.open["content"][0]
        part["text"] += text
        if kind == "message":
            out.append(self._event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                   logprobs=[]))
        else:
            out.append(self._event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text))
        return out

    def _call(self, call: dict) -> list[dict]:
        out = []
        arguments = (call.get("function") or {}).get("arguments") or ""
        if call.get("id"):  # a new call
            out += self._close()
            self.open = function_call_item({"id": call["id"], "function": {
                "name": call["function"]["name"], "arguments": ""}}, "in_progress")
            out.append(self._event("response.output_item.added", output_index=len(self.output), item=dict(self.open)))
        if arguments and self.open is not None and self.open["type"] == "function_call":
            self.open["arguments"] += arguments
            out.append(self._event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return out

    def _close(self) -> list[dict]:
        item, out = self.open, []
        if item is None:
            return out
        where = self._where()
        if item["type"] == "function_call":
            out.append(self._event("response.function_call_arguments.done", **where, name=item["name"],
                                   arguments=item["arguments"]))
        else:
            part = item["content"][0]
            kind = "output_text" if item["type"] == "message" else "reasoning_text"
            extra = {"logprobs": []} if item["type"] == "message" else {}
            out.append(self._event(f"response.{kind}.done", **where, content_index=0, text=part["text"], **extra))
            out.append(self._event("response.content_part.done", **where, content_index=0, part=dict(part)))
        item["status"] = "completed"
        out.append(self._event("response.output_item.done", output_index=where["output_index"], item=item))
        self.output.append(item)
        self.open = None
        return out


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.store = store

    def previous(self, req: ResponsesRequest) -> list[dict]:
        """The stored conversation `previous_response_id` continues ([] without one)."""
        if req.previous_response_id is None:
            return []
        if not self.store.enabled:
            raise InvalidRequestError("previous_response_id needs stored responses, and this server stores none "
                                      "(--responses-store-entries 0): send the whole conversation as input",
                                      param="previous_response_id")
        stored = self.store.get(req.previous_response_id)
        if stored is None:
            raise PreviousResponseNotFound(f"Response with id '{req.previous_response_id}' not found (never "
                                           "stored here, or dropped: --responses-store-entries, -bytes, -ttl).")
        return stored.conversation

    def chat_request(self, req: ResponsesRequest) -> tuple[ChatCompletionRequest, list[dict]]:
        """(the chat request, the conversation a stored answer continues from)."""
        conversation = conversation_of(req, self.previous(req))
        return chat_request(chat_fields(req, conversation)), conversation

    def shape(self, req: ResponsesRequest, chat_req: ChatCompletionRequest, endpoint: str) -> ResponseShape:
        """`endpoint`: this engine's address as the request reached it (its id's tag)."""
        return ResponseShape(req, self.chat.serving.response_model(chat_req), req.store and self.store.enabled,
                             endpoint)

    async def _keep(self, shape: ResponseShape, response: dict, conversation: list[dict]) -> None:
        if not shape.stored:
            return
        kept = [*conversation, answer_message(response["output"])]
        size = await self.chat.serving.off_loop(lambda: len(json.dumps([response, kept]).encode()))
        self.store.put(shape.id, response, kept, size)

    async def response(self, req: ResponsesRequest, chat_req: ChatCompletionRequest, conversation: list[dict],
                       prep: Prepared, endpoint: str = "") -> dict:
        shape = self.shape(req, chat_req, endpoint)
        answer = await self.chat.response(chat_req, prep)
        choice = answer["choices"][0]
        response = shape.object("completed", output_items(choice["message"]), answer["usage"],
                                choice["finish_reason"])
        await self._keep(shape, response, conversation)
        return response

    async def stream(self, req: ResponsesRequest, chat_req: ChatCompletionRequest, conversation: list[dict],
                     prep: Prepared, endpoint: str = "") -> AsyncIterator[str]:
        events = ResponseEvents(self.shape(req, chat_req, endpoint))
        async for event in relay_events(events, self.chat.stream(chat_req, prep)):
            yield event
        if not events.failed:
            await self._keep(events.shape, events.final(), conversation)

    def retrieve(self, response_id: str) -> dict:
        stored = self.store.get(response_id)
        if stored is None:
            raise PreviousResponseNotFound(f"Response with id '{response_id}' not found.")
        return stored.response
