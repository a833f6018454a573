"""`llama3_json` (vLLM's name; `llama4_json` is its alias there): Llama 3.1/3.2/4's JSON calls, as their
JSON-tools chat templates ask for.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The output is calls when it starts (after whitespace) with `{` or `<|python_tag|>`: JSON objects with a string
`name` and an object `parameters` (or `arguments`), separated by `;`, whitespace or nothing (Meta's llama-models
writes a turn's calls back to back, which vLLM reads as text; text between or after them is not part of the
message, as in vLLM); the message then has no content. An output that starts otherwise is text: that is vLLM's
streaming rule, used here for finished outputs too (vLLM's non-streaming parser also picks JSON out of the middle
of prose, which a stream cannot do without holding back all text). So is an output whose `<|python_tag|>` is
followed by no JSON call (Llama 3.1's code_interpreter code, its built-in tools' `brave_search.call(...)`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.engine.server.tool_parsers.base import ParsedCall, ToolParser, json_call, loads_json
from kvgate.engine.server.tool_parsers.scanners import BracketScanner

PYTHON_TAG = "<|python_tag|>"


@dataclass
class JsonSegment:
    """A segment: text before the value (separators), then one JSON value."""

    in_value: bool = False
    brackets: BracketScanner = field(default_factory=BracketScanner)


def scan_json_value(state: JsonSegment, text: str, openers: str = "{") -> int | None:
    """Where the segment's JSON value ends in `text`: the value starts at the first of `openers`."""
    offset = 0
    if not state.in_value:
        starts = [i for i in (text.find(c) for c in openers) if i >= 0]
        if not starts:
            return None
        offset = min(starts)
        state.in_value = True
    end = state.brackets.feed(text[offset:] if offset else text)
    return None if end is None else offset + end


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    leading = ("{", PYTHON_TAG)

    def new_segment(self) -> JsonSegment:
        return JsonSegment()

    def scan(self, state: JsonSegment, text: str) -> int | None:
        return scan_json_value(state, text)

    def parse(self, segment: str, last: bool) -> list[ParsedCall] | None:
        start = segment.find("{")
        if start < 0:  # text after the last call (separators, an end of turn): not part of the message
            return []
        try:
            value = loads_json(segment[start:])
        except ValueError:
            return None
        if not isinstance(value, dict) or ("arguments" in value and "parameters" in value):
            return None
        call = json_call(value.get("name"), value.get("parameters", value.get("arguments", {})))
        return None if call is None else [call]
