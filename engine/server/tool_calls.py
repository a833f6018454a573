"""Tool calling for chat: `tools` + `tool_choice` as OpenAI takes them, with the calls enforced by a schema.

`tool_choice` a named function: the output is that function's arguments, constrained by its `parameters`
schema; `required`: a JSON array of one or more `{"name", "parameters"}` objects, one schema branch per tool
(vLLM's shape for both). Either becomes the message's `tool_calls` (finish_reason `stop` for a named function,
as OpenAI answers a forced call, `tool_calls` for required). `none` generates text. `auto` (the default when
tools are given): the model writes calls in its own syntax, unconstrained, and the server's tool-call parser
(`--enable-auto-tool-choice --tool-call-parser NAME`, engine/server/tool_parsers/) splits them out
(finish_reason `tool_calls` when there are any); without those flags it is a 400, as vLLM answers. Tools reach
the chat template when it reads `tools`.

Streaming follows OpenAI's delta format: a named call's arguments stream as they are generated (the first
delta carries the call's id, type and name); a `required` array streams each call whole once the output ends
(its text is not a call until it parses); `auto` streams text as it comes and each call whole once its block
closes.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from kvgate.common import bounded_json
from kvgate.common.errors import InvalidRequestError
from kvgate.engine.sampling_params import StructuredOutputsParams
from kvgate.engine.server.tool_parsers import ParsedCall, ToolParser, tool_parser

_ANY_OBJECT = {"type": "object"}


@dataclass
class ToolMode:
    """How a chat request's output becomes tool calls: one named function, `required` (an array), or `auto` (the
    model's own syntax, read by `parser`)."""

    name: str | None  # the named function; None: required or auto
    parser: ToolParser | None = None  # auto: the model's syntax

    @property
    def finish_reason(self) -> str:
        return "stop" if self.name else "tool_calls"


def tool_mode(req, auto_parser: str | None = None) -> ToolMode | None:
    """The request's tool mode (None: plain text); InvalidRequestError for tools or a choice kvgate cannot serve.
    `auto_parser`: the server's --tool-call-parser when --enable-auto-tool-choice is on."""
    if "tools" not in type(req).model_fields:  # a completion: `tools` is chat's, an unknown field here (ignored)
        return None
    tools, choice = req.tools, req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tool names must be unique", param="tools")
    if choice == "none":
        return None
    if choice is None or choice == "auto":
        if auto_parser is None:
            raise InvalidRequestError('tool_choice "auto" (the default when tools are given) needs the server '
                                      "started with --enable-auto-tool-choice and --tool-call-parser: set "
                                      'tool_choice to "required", to a named function, or to "none"',
                                      param="tool_choice")
        return ToolMode(None, tool_parser(auto_parser, [t.model_dump(exclude_none=True) for t in tools]))
    if choice == "required":
        return ToolMode(None)
    name = choice.function.name
    if name not in names:
        raise InvalidRequestError(f"tool_choice names {name!r}, which is not among the tools ({names})",
                                  param="tool_choice")
    return ToolMode(name)


def tool_constraint(req, mode: ToolMode) -> StructuredOutputsParams | None:
    """The schema a forced call (named or required) is generated under; None for auto (the model chooses)."""
    if mode.parser is not None:
        return None
    params = {t.function.name: t.function.parameters or _ANY_OBJECT for t in req.tools}
    if mode.name is not None:
        return StructuredOutputsParams(json=params[mode.name], param="tools")
    branches = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": schema},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for name, schema in params.items()]
    return StructuredOutputsParams(json={"type": "array", "minItems": 1, "items": {"anyOf": branches}},
                                   param="tools")


def _call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _openai_call(call: ParsedCall, parser: ToolParser) -> dict:
    return {"id": parser.call_id(), "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_calls(mode: ToolMode, text: str) -> list[dict] | None:
    """The calls in a finished output's text; None when it does not parse (an output cut by max_tokens)."""
    try:
        bounded_json.check_depth(text)  # the model's text: deep nesting is not a call, and must not recurse
        value = json.loads(text)
    except ValueError:
        return None
    if mode.name is not None:
        calls = [(mode.name, value)]
    else:
        calls = [(c["name"], c["parameters"]) for c in value]
    return [{"id": _call_id(), "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
            for name, args in calls]


def message(mode: ToolMode, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """(the assistant message, its finish_reason) for a finished output."""
    if mode.parser is not None:
        content, parsed = mode.parser.extract(text)
        if not parsed:
            return {"role": "assistant", "content": text}, finish_reason
        return ({"role": "assistant", "content": content, "tool_calls": [_openai_call(c, mode.parser) for c in parsed]},
                "tool_calls" if finish_reason == "stop" else finish_reason)
    calls = tool_calls(mode, text) if finish_reason == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": None, "tool_calls": calls}, mode.finish_reason


@dataclass
class ToolCallStream:
    """One choice's streamed tool calls: delta_text in, OpenAI `delta` objects out."""

    mode: ToolMode
    text: str = ""
    started: bool = False
    call_id: str = field(default_factory=_call_id)
    parsing: object | None = None  # auto: the parser's stream
    num_calls: int = 0

    def deltas(self, delta_text: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """(deltas to send, the finish_reason to report)."""
        self.text += delta_text
        if self.mode.parser is not None:
            return self._auto_deltas(delta_text, finish_reason)
        out = []
        if self.mode.name is not None:
            if delta_text and not self.started:
                self.started = True
                out.append({"tool_calls": [{"index": 0, "id": self.call_id, "type": "function",
                                            "function": {"name": self.mode.name, "arguments": ""}}]})
            if delta_text:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": delta_text}}]})
            return out, (self.mode.finish_reason if finish_reason == "stop" else finish_reason)
        if finish_reason is None:
            return [], None
        calls = tool_calls(self.mode, self.text) if finish_reason == "stop" else None
        if calls is None:  # cut short: what was generated, as text
            return ([{"content": self.text}] if self.text else []), finish_reason
        for i, call in enumerate(calls):
            out.append({"tool_calls": [{"index": i, **call}]})
        return out, self.mode.finish_reason

    def _auto_deltas(self, delta_text: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        if self.parsing is None:
            self.parsing = self.mode.parser.stream()
        content, calls = self.parsing.feed(delta_text)
        if finish_reason is not None:
            rest, last = self.parsing.finish()
            content, calls = content + rest, calls + last
        out = [{"content": content}] if content else []
        for call in calls:
            out.append({"tool_calls": [{"index": self.num_calls, **_openai_call(call, self.mode.parser)}]})
            self.num_calls += 1
        if finish_reason == "stop" and self.parsing.calls:
            finish_reason = "tool_calls"
        return out, finish_reason
