"""Calls wrapped in tags, `<tool_call>BODY</tool_call>`, one call per block (hermes and qwen3_coder): a segment
ends with the closing tag; text between blocks is not part of the message; a last block the output ended inside
(no closing tag) counts when its body parses. The body's syntax is the family's (`parse_body`)."""

from __future__ import annotations

from kvgate.engine.server.tool_parsers.base import ParsedCall, ToolParser
from kvgate.engine.server.tool_parsers.scanners import MarkerFinder

START, END = "<tool_call>", "</tool_call>"


class TaggedBlockParser(ToolParser):
    opener = START

    def parse_body(self, body: str) -> ParsedCall | None:
        raise NotImplementedError

    def new_segment(self) -> MarkerFinder:
        return MarkerFinder(END)

    def scan(self, state: MarkerFinder, text: str) -> int | None:
        return state.find(text)

    def parse(self, segment: str, last: bool) -> list[ParsedCall] | None:
        start = segment.find(START)
        if start < 0:  # text after the last block
            return []
        body = segment[start + len(START):]
        if not last or body.endswith(END):
            body = body[:len(body) - len(END)]
        call = self.parse_body(body)
        return None if call is None else [call]
