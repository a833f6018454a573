"""What every tool-call parser shares: the parsed call, the bounds on what a model's text may make into calls, and
the stream that splits text into content and calls as it comes.

A parser reads one family's syntax. Its text has two parts: content, then calls (an opener starts them: a marker
such as `<tool_call>` anywhere, or for the leading formats a first character such as `{` or `[`). The calls part
is cut into segments, one or more calls each, by the parser's incremental scanner (scanners.py), and each segment
is parsed once, when it closes: the work is linear in the output however finely it is streamed.

Streaming sends content as it comes, holding back only what may still become an opener, and each call whole once
its segment closes. A segment that does not parse, a call over `max_call_chars`, or a call past `max_calls` ends
the parsing: that text and all that follows go out as content (calls already sent stay sent). `extract`, on a
finished output, is the same stream run once: all or nothing, so an output whose calls do not all parse is text,
as vLLM answers for a malformed call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from kvgate.common import bounded_json
from kvgate.engine.server.tool_parsers.scanners import partial_marker

# A model's calls are small: a few names and argument values. Generous bounds, far above real calls, that keep a
# runaway output from becoming megabytes of arguments or thousands of calls in one message.
MAX_TOOL_CALLS = 64  # calls in one message
MAX_CALL_CHARS = 256 << 10  # the text of one call (its markup, name and arguments)


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI's `function.arguments`


@dataclass(frozen=True)
class ToolCallLimits:
    max_calls: int = MAX_TOOL_CALLS
    max_call_chars: int = MAX_CALL_CHARS


def json_call(name, arguments) -> ParsedCall | None:
    """A call from a decoded name and arguments; None unless the name is a non-empty string and the arguments an
    object."""
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def loads_json(text: str):
    """The JSON value of a model's text (bounded nesting); ValueError when it is not one."""
    bounded_json.check_depth(text)  # the model's text: deep nesting is not a call, and must not recurse
    return json.loads(text)


def default_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolParser:
    """A family's tool-call syntax. `tools`: the request's tool definitions (as dicts), for parsers that type the
    arguments by their schemas."""

    name = ""
    # The opener of the calls part: a marker found anywhere (content may come before it), or with `leading`,
    # prefixes of which one must start the output (after whitespace).
    opener = ""
    leading: tuple[str, ...] = ()
    # The calls are written with special tokens that must stay in the decoded text.
    needs_special_tokens = False

    def __init__(self, tools: list[dict] | None = None, limits: ToolCallLimits | None = None) -> None:
        self.tools = tools or []
        self.limits = limits or ToolCallLimits()

    def call_id(self) -> str:
        """The id of a parsed call (the family's own form where its template checks them)."""
        return default_call_id()

    def extract(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content, calls) of a finished output; (text, []) when it holds no calls or they do not all parse."""
        stream = self.stream()
        content, calls = stream.feed(text)
        rest, last = stream.finish()
        calls += last
        if stream.broken or not calls:
            return text, []
        content += rest
        return (content if content.strip() else None), calls

    def stream(self) -> "CallStream":
        return CallStream(self)

    # -- the calls part: one scanner state per segment ------------------------------------------------------

    def new_segment(self):
        """A fresh scanner for the next segment (whatever `scan` needs)."""
        raise NotImplementedError

    def scan(self, state, text: str) -> int | None:
        """The index in `text` just past the end of the current segment; None while it goes on."""
        raise NotImplementedError

    def parse(self, segment: str, last: bool) -> list[ParsedCall] | None:
        """The calls of a segment ([] for text between calls, which is dropped); None when it does not parse.
        `last`: the output ended inside this segment (it may be unclosed)."""
        raise NotImplementedError


class CallStream:
    """One output's incremental split: text in, (content to send now, calls completed now) out."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.mode = "text"  # text (content), calls, plain (no calls: all text), broken (all text from here)
        self.held = ""  # text mode: what may still become the opener
        self.segment: list[str] = []  # calls mode: the text of the segment being read
        self.segment_chars = 0
        self.state = None
        self.calls: list[ParsedCall] = []

    @property
    def broken(self) -> bool:
        return self.mode == "broken"

    def feed(self, text: str) -> tuple[str, list[ParsedCall]]:
        out: list[str] = []
        done: list[ParsedCall] = []
        if self.mode == "text":
            text = self._text(text, out)
        if self.mode == "calls" and text:
            self._calls(text, out, done)
        elif self.mode in ("plain", "broken") and text:
            out.append(text)
        return "".join(out), done

    def finish(self) -> tuple[str, list[ParsedCall]]:
        """At the output's end: the last segment (maybe unclosed) is parsed; what is held goes out."""
        if self.mode == "text":
            rest, self.held = self.held, ""
            return rest, []
        if self.mode != "calls":
            return "", []
        segment = "".join(self.segment)
        self.segment = []
        calls = self.parser.parse(segment, last=True)
        if calls is None or not self._admit(calls):
            self.mode = "broken"
            return segment, []
        if not self.calls:  # an opener and then no call (Llama's <|python_tag|> before code): all of it was text
            self.mode = "plain"
            return segment, []
        return "", calls

    # -- content before the calls ---------------------------------------------------------------------------

    def _text(self, text: str, out: list[str]) -> str:
        """Content up to the opener; returns the text that starts the calls part ("" when it has not come)."""
        window = self.held + text
        self.held = ""
        parser = self.parser
        if parser.leading:
            body = window.lstrip()
            if not body:
                if len(window) > parser.limits.max_call_chars:  # whitespace only, without end: it is text
                    self.mode = "plain"
                    out.append(window)
                else:
                    self.held = window
                return ""
            if any(body.startswith(o) for o in parser.leading):
                self._open()
                return window  # the whitespace too: it is content again if no call follows
            if any(o.startswith(body) for o in parser.leading):
                self.held = window
                return ""
            self.mode = "plain"
            out.append(window)
            return ""
        at = window.find(parser.opener)
        if at >= 0:
            out.append(window[:at])
            self._open()
            return window[at:]
        keep = partial_marker(parser.opener, window)
        out.append(window[:len(window) - keep])
        self.held = window[len(window) - keep:]
        return ""

    def _open(self) -> None:
        self.mode = "calls"
        self.state = self.parser.new_segment()

    # -- the calls part ---------------------------------------------------------------------------------------

    def _calls(self, text: str, out: list[str], done: list[ParsedCall]) -> None:
        parser, limit = self.parser, self.parser.limits.max_call_chars
        while text:
            end = parser.scan(self.state, text)
            piece = text if end is None else text[:end]
            self.segment.append(piece)
            self.segment_chars += len(piece)
            if self.segment_chars > limit:  # one call's text past the bound: not a call
                self._break(text[len(piece):], out)
                return
            if end is None:
                return
            text = text[end:]
            segment = "".join(self.segment)
            self.segment, self.segment_chars = [], 0
            calls = parser.parse(segment, last=False)
            if calls is None or not self._admit(calls):
                self.segment = [segment]
                self._break(text, out)
                return
            done += calls
            self.state = parser.new_segment()

    def _admit(self, calls: list[ParsedCall]) -> bool:
        if len(self.calls) + len(calls) > self.parser.limits.max_calls:
            return False
        self.calls += calls
        return True

    def _break(self, rest: str, out: list[str]) -> None:
        out.append("".join(self.segment) + rest)
        self.segment, self.segment_chars = [], 0
        self.mode = "broken"

