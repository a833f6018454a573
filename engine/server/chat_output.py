"""A chat choice's generated text to its assistant message, whole or as streaming deltas: the reasoning parser
(reasoning_parsers.py, `--reasoning-parser`) takes the thinking off first, then the tool mode (tool_calls.py)
reads the calls from the answer that follows it, as vLLM orders them (a call inside the thinking is not a call).

The thinking goes out as `reasoning` (vLLM's field) and `reasoning_content` (DeepSeek's and older vLLM's name for
the same text), both present (null when there was none) whenever the server has a reasoning parser, unless the
request sets `include_reasoning: false` (vLLM's field), which drops it. A forced call (a named function or
`required`) is constrained from the first token, so its text has no thinking to split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.engine.server import tool_calls
from kvgate.engine.server.reasoning_parsers import ReasoningStream, ThinkReasoningParser


@dataclass
class ChatOutput:
    """How one request's choices are read: its tool mode (None: text) and the server's reasoning parser."""

    mode: tool_calls.ToolMode | None = None
    reasoning: ThinkReasoningParser | None = None
    include_reasoning: bool = True

    def __post_init__(self) -> None:
        self.reports_reasoning = self.reasoning is not None
        if self.mode is not None and self.mode.parser is None:  # a forced call: no thinking to split
            self.reasoning = None

    def _reasoning_fields(self, reasoning: str | None) -> dict:
        if not self.reports_reasoning:
            return {}
        value = reasoning if self.include_reasoning else None
        return {"reasoning": value, "reasoning_content": value}

    def message(self, role: str, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """(the assistant message, its finish_reason) of a finished choice."""
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = self.reasoning.extract(text)
        if self.mode is not None:
            message, finish_reason = tool_calls.message(self.mode, text or "", finish_reason)
            if not message.get("content") and text is None:
                message["content"] = None
        else:
            message = {"content": text}
        message.pop("role", None)  # tool_calls.message names "assistant"; the answer's role is the server's choice
        return {"role": role, **message, **self._reasoning_fields(reasoning)}, finish_reason

    def stream(self) -> "ChatOutputStream":
        return ChatOutputStream(self)


@dataclass
class ChatOutputStream:
    """One choice's deltas: delta_text in, OpenAI `delta` objects out."""

    output: ChatOutput
    thinking: ReasoningStream | None = None
    tools: tool_calls.ToolCallStream | None = None
    reasoning_sent: bool = field(default=False)

    def __post_init__(self) -> None:
        if self.output.reasoning is not None:
            self.thinking = self.output.reasoning.stream()
        if self.output.mode is not None:
            self.tools = tool_calls.ToolCallStream(self.output.mode)

    def deltas(self, delta_text: str, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """(deltas to send, the finish_reason to report)."""
        out = []
        if self.thinking is not None:
            reasoning, delta_text = self.thinking.feed(delta_text)
            if finish_reason is not None:
                more_reasoning, more_text = self.thinking.finish()
                reasoning, delta_text = reasoning + more_reasoning, delta_text + more_text
            if reasoning and self.output.include_reasoning:
                out.append({"reasoning": reasoning, "reasoning_content": reasoning})
        if self.tools is not None:
            deltas, finish_reason = self.tools.deltas(delta_text, finish_reason)
            out += deltas
        elif delta_text:
            out.append({"content": delta_text})
        return out, finish_reason
