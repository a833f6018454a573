"""Parsers of a model's own tool-call syntax, for `tool_choice: "auto"` (`--enable-auto-tool-choice
--tool-call-parser NAME`, vLLM's flags): the model decides whether to call a tool, and its text is split into the
message's `content` and its `tool_calls`.

`hermes` (Hermes 2 Pro, Qwen2.5, Qwen3 and the other models whose chat template wraps calls the same way; vLLM's
parser of that name reads the same text):

    optional text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call><tool_call>...</tool_call>

Every `<tool_call>` block holds one JSON object with a string `name` and an object `arguments`; a last block
the output ended inside (no closing tag) counts when its JSON is whole. The text before the first tag is the
content (None when blank); text between and after the blocks is not part of the message. An output whose blocks do not all parse is text, as vLLM answers. Streaming holds back
only what might still become a tag, so plain text streams as it comes; each call is sent whole, in one delta, once
its block closed; a block that does not parse goes out as text, with all that follows (calls sent before it
stay sent).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from kvgate.common import bounded_json

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|$)", re.DOTALL)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text, as OpenAI's `function.arguments`


def _call(block: str) -> ParsedCall | None:
    try:
        bounded_json.check_depth(block)  # the model's text: deep nesting is not a call, and must not recurse
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesToolParser:
    name = "hermes"

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished output; no calls when it holds none or a block does not parse."""
        first = text.find(START)
        if first < 0:
            return text, []
        calls = [_call(m.group(1)) for m in _BLOCK.finditer(text, first)]
        if not calls or any(c is None for c in calls):
            return text, []
        content = text[:first]
        return (content if content.strip() else None), calls

    def stream(self) -> "HermesStream":
        return HermesStream()


@dataclass
class HermesStream:
    """Incremental `extract`: text in, (content to send now, calls completed now) out."""

    buffer: str = ""  # text not yet sent: a possible tag's start, or an open block
    in_block: bool = False
    broken: bool = False  # a block did not parse: the rest is sent as text
    calls: list[ParsedCall] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        self.buffer += text
        out, done = [], []
        while self.buffer:
            if self.broken:
                out.append(self.buffer)
                self.buffer = ""
            elif self.in_block:
                end = self.buffer.find(END)
                if end < 0:
                    break
                call = _call(self.buffer[:end])
                if call is None:  # not a call after all: what it held goes out as text
                    out.append(START + self.buffer)
                    self.buffer, self.broken = "", True
                    continue
                done.append(call)
                self.calls.append(call)
                self.buffer, self.in_block = self.buffer[end + len(END):], False
            else:  # outside a block; after the first call only calls count (as in extract)
                start = self.buffer.find(START)
                if start >= 0:
                    if not self.calls:
                        out.append(self.buffer[:start])
                    self.buffer, self.in_block = self.buffer[start + len(START):], True
                    continue
                keep = _partial_tag(self.buffer)
                if not self.calls:
                    out.append(self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
        return "".join(out), done

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the output's end: an open block whose JSON is whole is a call; anything else left is text."""
        rest, self.buffer = self.buffer, ""
        if self.in_block and not self.broken:
            self.in_block = False
            call = _call(rest)
            if call is not None:
                self.calls.append(call)
                return "", [call]
            return START + rest, []
        return ("" if self.calls and not self.broken else rest), []


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` could begin the start tag."""
    for n in range(min(len(START) - 1, len(text)), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0


TOOL_PARSERS = {HermesToolParser.name: HermesToolParser}
