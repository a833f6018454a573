"""`mistral` (vLLM's name): Mistral's calls after its `[TOOL_CALLS]` token, in either of its tokenizers' forms:

    optional text[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]     (before v11)
    optional text[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]other[ARGS]{...}    (v11 and later)

(a v11+ call may also be written `name{...}` without `[ARGS]`). The text before the first `[TOOL_CALLS]` is the
content; text after a call's JSON is not part of the message (vLLM drops it too). `[TOOL_CALLS]` and `[ARGS]`
are special tokens, so the server keeps special tokens in the decoded text when this parser reads it (vLLM does
the same). Call ids are Mistral's: nine letters and digits, which its chat templates check when the calls come
back in the conversation."""

from __future__ import annotations

import random
import re
import string
from dataclasses import dataclass, field

from kvgate.engine.server.tool_parsers.base import ParsedCall, ToolParser, json_call, loads_json
from kvgate.engine.server.tool_parsers.scanners import BracketScanner

TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"\s*([^\s\[\]{}]*)\s*(?:\[ARGS\])?\s*\Z")
_ID_CHARS = string.ascii_letters + string.digits
_MAX_HEAD = 1024  # the text between [TOOL_CALLS] and the JSON: a name (OpenAI allows 64 characters)


@dataclass
class MistralSegment:
    head: str = ""  # [TOOL_CALLS] and the name, until the JSON starts
    in_value: bool = False
    brackets: BracketScanner = field(default_factory=BracketScanner)


def _value_start(head: str) -> int | None:
    """Where the JSON starts in a segment's head: the first `{` or `[` after `[TOOL_CALLS]` that does not begin
    `[ARGS]` (None: not yet; a partial `[ARGS` waits)."""
    at = head.find(TOOL_CALLS)
    if at < 0:
        return None
    i = at + len(TOOL_CALLS)
    while True:
        starts = [j for j in (head.find("{", i), head.find("[", i)) if j >= 0]
        if not starts:
            return None
        j = min(starts)
        if head[j] == "[" and ARGS.startswith(head[j:j + len(ARGS)]):
            if len(head) - j < len(ARGS):
                return None  # may still become [ARGS]
            i = j + len(ARGS)
            continue
        return j


class MistralToolParser(ToolParser):
    name = "mistral"
    opener = TOOL_CALLS
    needs_special_tokens = True

    def call_id(self) -> str:
        return "".join(random.choices(_ID_CHARS, k=9))

    def new_segment(self) -> MistralSegment:
        return MistralSegment()

    def scan(self, state: MistralSegment, text: str) -> int | None:
        offset = 0
        if not state.in_value:
            before = len(state.head)
            state.head += text
            start = _value_start(state.head)
            if start is None:
                if TOOL_CALLS not in state.head:  # text between calls: keep only what may begin the marker
                    state.head = state.head[-(len(TOOL_CALLS) - 1):]
                elif len(state.head) > _MAX_HEAD:
                    return len(text)  # no JSON after the marker: the segment ends here (and will not parse)
                return None
            state.in_value = True
            offset = start - before
            if offset < 0:  # the value began in held text (a `[` that could have begun `[ARGS]`): scan it first
                state.brackets.feed(state.head[start:before])
                offset = 0
        end = state.brackets.feed(text[offset:] if offset else text)
        return None if end is None else offset + end

    def parse(self, segment: str, last: bool) -> list[ParsedCall] | None:
        at = segment.find(TOOL_CALLS)
        if at < 0:  # text after the last call
            return []
        start = _value_start(segment + " " * len(ARGS))
        if start is None or start - at > _MAX_HEAD:
            return None
        head = segment[at + len(TOOL_CALLS):start]
        m = _NAME.match(head)
        if m is None:
            return None
        try:
            value = loads_json(segment[start:])
        except ValueError:
            return None
        if m.group(1):  # v11+: name[ARGS]{arguments}
            call = json_call(m.group(1), value)
            return None if call is None else [call]
        items = value if isinstance(value, list) else [value]
        calls = [json_call(v.get("name"), v.get("arguments", {})) if isinstance(v, dict) else None for v in items]
        if not calls or any(c is None for c in calls):
            return None
        return calls
