"""Reasoning parsers (`--reasoning-parser NAME`, vLLM's flag and names): a thinking model's `<think>...</think>`
text is split from its answer, into the chat message's `reasoning` (vLLM's field) and `reasoning_content` (the
same text under DeepSeek's and older vLLM's name, which many clients read), whole or as streaming deltas.

`qwen3` (Qwen3, QwQ) and `deepseek_r1` (DeepSeek-R1 and its distills) read the same text, as vLLM's parsers of
those names do: everything before `</think>` is reasoning (a `<think>` that opens the output is dropped: newer
templates put it in the prompt, so the output holds only the closing tag), everything after it is the answer;
an output that never closes its thinking (cut by max_tokens) is all reasoning. For `qwen3` a `<tool_call>`
written while thinking ends the thinking too, and the answer starts with it (vLLM 0.32's qwen3 parser reads it so:
Qwen3 models may call a tool without closing their thinking). `qwen3` honours the template's
switch: with `chat_template_kwargs: {"enable_thinking": false}` the template closes the thinking in the prompt,
and the whole output is the answer.

An output generated under a constraint from its first token (response_format, structured_outputs, guided_*)
is thinking only when it opens with `<think>`: its grammar, not the model, chose its first characters, so an
output that starts otherwise is the answer (vLLM holds the grammar back until the thinking ends; kvgate's
constraints start at once, and a JSON answer must not become "reasoning").

Streaming holds back only what may still become a tag; the work is linear in the output.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.engine.server.tool_parsers.scanners import partial_marker

START, END = "<think>", "</think>"


class ThinkReasoningParser:
    name = ""
    honours_enable_thinking = False
    answer_starts: tuple[str, ...] = ()  # markers that end the thinking and begin the answer (kept in it)

    def __init__(self, chat_template_kwargs: dict | None = None, constrained: bool = False) -> None:
        kwargs = chat_template_kwargs or {}
        self.thinking = not (self.honours_enable_thinking and kwargs.get("enable_thinking", True) is False)
        self.constrained = constrained  # thinking only when the output opens with <think>

    def extract(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output; each None when empty."""
        stream = self.stream()
        reasoning, content = stream.feed(text)
        more_reasoning, more_content = stream.finish()
        reasoning, content = reasoning + more_reasoning, content + more_content
        return (reasoning or None), (content or None)

    def stream(self) -> "ReasoningStream":
        return ReasoningStream("start" if self.thinking else "content", opened_only=self.constrained,
                               answer_starts=self.answer_starts)


class Qwen3ReasoningParser(ThinkReasoningParser):
    name = "qwen3"
    honours_enable_thinking = True
    answer_starts = ("<tool_call>",)


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"


@dataclass
class ReasoningStream:
    """One output's split: text in, (reasoning to send now, content to send now) out."""

    mode: str  # start (a <think> may open the output), reasoning, content
    opened_only: bool = False  # thinking only when <think> opens the output
    answer_starts: tuple[str, ...] = ()
    held: str = ""

    def feed(self, text: str) -> tuple[str, str]:
        window, self.held = self.held + text, ""
        if self.mode == "start":
            if START.startswith(window) and len(window) < len(START):
                self.held = window  # may still become the opening tag
                return "", ""
            if window.startswith(START):
                window = window[len(START):]
                self.mode = "reasoning"
            else:
                self.mode = "content" if self.opened_only else "reasoning"
        if self.mode == "content":
            return "", window
        at, skip = window.find(END), len(END)
        for marker in self.answer_starts:
            found = window.find(marker)
            if found >= 0 and (at < 0 or found < at):
                at, skip = found, 0
        if at >= 0:
            self.mode = "content"
            return window[:at], window[at + skip:]
        keep = max(partial_marker(m, window) for m in (END, *self.answer_starts))
        self.held = window[len(window) - keep:]
        return window[:len(window) - keep], ""

    def finish(self) -> tuple[str, str]:
        """What is held back goes out: reasoning while the thinking is open."""
        held, self.held = self.held, ""
        if self.mode == "start" and self.opened_only:  # never opened with <think>: the answer
            return "", held
        return ("", held) if self.mode == "content" else (held, "")


REASONING_PARSERS: dict[str, type[ThinkReasoningParser]] = {
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
}


def reasoning_parser(name: str, chat_template_kwargs: dict | None = None,
                     constrained: bool = False) -> ThinkReasoningParser:
    """The parser `name` (a key of REASONING_PARSERS) for a request; `constrained`: its output is generated under
    a constraint from the first token."""
    return REASONING_PARSERS[name](chat_template_kwargs, constrained)
