"""POST /v1/messages (the Anthropic Messages API) on chat's engine path (chat_bridge.py): `system` (a string or
text blocks) and `messages` (text, tool_use and tool_result blocks) become a chat conversation — a user
message's tool_result blocks become chat's `tool` messages, an assistant's tool_use blocks its `tool_calls` —
and `tools` (with `input_schema`), `tool_choice` (auto, any, tool, none), `max_tokens` (required),
`stop_sequences`, `temperature`, `top_p` and `top_k` become chat's fields. The chat answer comes back as content
blocks (`thinking` when the chat message has reasoning_content, `text`, `tool_use`) with Anthropic's stop_reason
(end_turn, max_tokens, stop_sequence with the sequence, tool_use) and usage, whole or streamed as Anthropic's
events (message_start, ping, content_block_start / _delta / _stop, message_delta, message_stop; `error` for a
failure after the stream began). Errors before the answer are Anthropic's shape (anthropic_errors.py).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator

from kvgate.common.anthropic_system import system_prompt
from kvgate.common.api_errors import anthropic_error_type
from kvgate.common.errors import InvalidRequestError
from kvgate.engine.server.anthropic_protocol import MessagesRequest
from kvgate.engine.server.chat_bridge import arguments_object, chat_request, passed_on, relay_events, text_of
from kvgate.engine.server.openai_serving import Prepared
from kvgate.engine.server.protocol import ChatCompletionRequest
from kvgate.engine.server.serving_chat import OpenAIServingChat

_TEXT = ("text",)
# chat's parameter names in errors, as the Messages API names them
PARAM_NAMES = {"stop": "stop_sequences", "prompt": "messages"}


def conversation_of(req: MessagesRequest) -> list[dict]:
    """The request's system prompt and messages as chat messages."""
    messages = []
    try:
        system = system_prompt(req.system, ((m.role, m.content) for m in req.messages))
    except ValueError as exc:
        raise InvalidRequestError(str(exc), param="system") from None
    if system:
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        if m.role == "system":  # part of the system prompt above
            continue
        if isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content})
            continue
        text, calls, results = [], [], []
        for k, block in enumerate(m.content):
            where, kind = f"messages[{i}].content[{k}]", block.get("type")
            if kind == "text" and isinstance(block.get("text"), str):
                text.append(block["text"])
            elif kind == "tool_use" and m.role == "assistant":
                if not (isinstance(block.get("id"), str) and isinstance(block.get("name"), str)
                        and isinstance(block.get("input", {}), dict)):
                    raise InvalidRequestError(f"{where}: a tool_use block needs an id, a name and an input object",
                                              param="messages")
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input", {}), ensure_ascii=False)}})
            elif kind == "tool_result" and m.role == "user":
                if not isinstance(block.get("tool_use_id"), str):
                    raise InvalidRequestError(f"{where}: a tool_result block needs a tool_use_id", param="messages")
                results.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                                "content": text_of(block.get("content", ""), f"{where}.content", _TEXT, "\n")})
            elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
                continue  # earlier thinking: not part of the prompt (chat templates drop it too)
            else:
                raise InvalidRequestError(f"{where}: a {m.role} message's block of type {kind!r} is not supported "
                                          "(text; tool_use from the assistant; tool_result from the user)",
                                          param="messages")
        messages += results  # the results answer the calls of the turn before, so they come first
        if text or calls or not results:
            messages.append({"role": m.role, "content": "".join(text), **({"tool_calls": calls} if calls else {})})
    return messages


def _tools(req: MessagesRequest) -> list[dict] | None:
    if req.tools is None:
        return None
    tools = []
    for k, tool in enumerate(req.tools):
        if tool.type not in (None, "custom"):
            raise InvalidRequestError(f"tools[{k}]: server tools ({tool.type!r}) are not supported (client tools "
                                      "with an input_schema only)", param="tools")
        tools.append({"type": "function", "function": {"name": tool.name, "parameters": tool.input_schema,
                                                       **({"description": tool.description}
                                                          if tool.description is not None else {})}})
    return tools


def _tool_choice(req: MessagesRequest):
    choice = req.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise InvalidRequestError('tool_choice of type "tool" needs a name', param="tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_fields(req: MessagesRequest) -> dict:
    fields = passed_on(req.model_extra)
    parallel = None if req.tool_choice is None or req.tool_choice.disable_parallel_tool_use is None \
        else not req.tool_choice.disable_parallel_tool_use
    fields.update(model=req.model, messages=conversation_of(req), max_tokens=req.max_tokens, stop=req.stop_sequences,
                  temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, stream=req.stream,
                  tools=_tools(req), tool_choice=_tool_choice(req), parallel_tool_calls=parallel)
    if req.stream:
        fields["stream_options"] = {"include_usage": True}
    return {k: v for k, v in fields.items() if v is not None}


def stop_reason(finish_reason: str | None, engine_stop, called: bool,
                stop_sequences: list[str] | None) -> tuple[str, str | None]:
    """(Anthropic's stop_reason, stop_sequence) of a chat choice that ended with `finish_reason`; `engine_stop`:
    the stop string (or token id) the engine stopped on, None at the end of the model's turn."""
    if called or finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(engine_stop, str) and engine_stop in (stop_sequences or ()):
        return "stop_sequence", engine_stop
    return "end_turn", None


def reasoning_of(message: dict) -> str | None:
    """A chat message's or delta's reasoning: `reasoning_content`, or `reasoning` (vLLM's newer name)."""
    return message.get("reasoning_content") or message.get("reasoning")


def _signature() -> str:
    """A thinking block's `signature`: Anthropic's verifies the thinking; here an opaque id, as vLLM sends."""
    return uuid.uuid4().hex


def content_blocks(message: dict) -> list[dict]:
    blocks = []
    if reasoning_of(message):
        blocks.append({"type": "thinking", "thinking": reasoning_of(message), "signature": _signature()})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or ():
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": arguments_object(call["function"]["arguments"])})
    return blocks


def message_usage(input_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": input_tokens, "output_tokens": output_tokens}


class MessageEvents:
    """Chat's stream chunks in, Anthropic's stream events out."""

    def __init__(self, message_id: str, model: str, input_tokens: int, stop_sequences: list[str] | None) -> None:
        self.message_id = message_id
        self.model = model
        self.input_tokens = input_tokens
        self.output_tokens = 0
        self.stop_sequences = stop_sequences
        self.index = -1  # the content block being streamed (-1: none yet)
        self.open: str | None = None  # its type
        self.called = False
        self.finish_reason: str | None = None
        self.engine_stop = None
        self.failed = False

    def start(self) -> list[dict]:
        return [{"type": "message_start", "message": {
            "id": self.message_id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": message_usage(self.input_tokens, 0)}},
                {"type": "ping"}]

    def feed(self, chunk: dict) -> list[dict]:
        if "error" in chunk:
            self.failed = True
            error = chunk["error"]
            return [{"type": "error", "error": {"type": anthropic_error_type(int(error.get("code") or 500)),
                                                "message": error.get("message")}}]
        if chunk.get("usage"):
            self.output_tokens = chunk["usage"]["completion_tokens"]
        out = []
        for choice in chunk.get("choices") or ():
            delta = choice.get("delta") or {}
            if reasoning_of(delta):
                out += self._block("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": reasoning_of(delta)}))
            if delta.get("content"):
                out += self._block("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or ():
                if call.get("id"):
                    self.called = True
                    out += self._block("tool_use", {"type": "tool_use", "id": call["id"],
                                                    "name": call["function"]["name"], "input": {}}, new=True)
                arguments = (call.get("function") or {}).get("arguments")
                if arguments and self.open == "tool_use":
                    out.append(self._delta({"type": "input_json_delta", "partial_json": arguments}))
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.engine_stop = choice.get("stop_reason")
        return out

    def finish(self) -> list[dict]:
        reason, sequence = stop_reason(self.finish_reason, self.engine_stop, self.called, self.stop_sequences)
        return [*self._close(), {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                                 "usage": message_usage(self.input_tokens, self.output_tokens)},
                {"type": "message_stop"}]

    def _block(self, kind: str, start: dict, new: bool = False) -> list[dict]:
        if self.open == kind and not new:
            return []
        out = self._close()
        self.index += 1
        self.open = kind
        return [*out, {"type": "content_block_start", "index": self.index, "content_block": start}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.index, "delta": delta}

    def _close(self) -> list[dict]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":  # a thinking block's signature comes last, as Anthropic's stream sends it
            out.append(self._delta({"type": "signature_delta", "signature": _signature()}))
        self.open = None
        return [*out, {"type": "content_block_stop", "index": self.index}]


class AnthropicServingMessages:
    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def chat_request(self, req: MessagesRequest) -> ChatCompletionRequest:
        return chat_request(chat_fields(req))

    async def response(self, req: MessagesRequest, chat_req: ChatCompletionRequest, prep: Prepared) -> dict:
        answer = await self.chat.response(chat_req, prep)
        choice = answer["choices"][0]
        message = choice["message"]
        reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"),
                                       bool(message.get("tool_calls")), req.stop_sequences)
        usage = answer["usage"]
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                "model": self.chat.serving.response_model(chat_req), "content": content_blocks(message),
                "stop_reason": reason, "stop_sequence": sequence,
                "usage": message_usage(usage["prompt_tokens"], usage["completion_tokens"])}

    async def stream(self, req: MessagesRequest, chat_req: ChatCompletionRequest,
                     prep: Prepared) -> AsyncIterator[str]:
        events = MessageEvents(f"msg_{uuid.uuid4().hex}", self.chat.serving.response_model(chat_req),
                               sum(map(len, prep.prompts)), req.stop_sequences)
        async for event in relay_events(events, self.chat.stream(chat_req, prep)):
            yield event
