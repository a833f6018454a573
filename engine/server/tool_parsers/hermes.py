"""`hermes`: Hermes 2 Pro, Qwen2.5, Qwen3 and the other models whose chat template wraps each call as JSON in
`<tool_call>` tags (vLLM's parser of that name reads the same text; `qwen3_json` is its alias there):

    optional text<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call><tool_call>...</tool_call>

Every block holds one JSON object with a string `name` and an object `arguments` (or `parameters`). The text
before the first tag is the content (None when blank)."""

from __future__ import annotations

from kvgate.engine.server.tool_parsers.base import ParsedCall, json_call, loads_json
from kvgate.engine.server.tool_parsers.tagged import TaggedBlockParser


class HermesToolParser(TaggedBlockParser):
    name = "hermes"

    def parse_body(self, body: str) -> ParsedCall | None:
        try:
            value = loads_json(body)
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        return json_call(value.get("name"), value.get("arguments", value.get("parameters", {})))
