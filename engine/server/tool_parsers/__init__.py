"""Parsers of a model's own tool-call syntax, for `tool_choice: "auto"` (`--enable-auto-tool-choice
--tool-call-parser NAME`, vLLM's flags and names): the model decides whether to call a tool, and its text is split
into the message's `content` and its `tool_calls`, whole (`extract`) or as it streams (`stream`: base.py).

One module per family's syntax; TOOL_PARSERS maps vLLM's names (and its aliases for the same syntax) to them.
Other APIs that generate through chat (Responses, Messages) use the same entry points:
`tool_parser(name, tools).extract(text)` and `.stream().feed(text)` / `.finish()`.
"""

from __future__ import annotations

from kvgate.engine.server.tool_parsers.base import (MAX_CALL_CHARS, MAX_TOOL_CALLS, CallStream, ParsedCall,
                                                   ToolCallLimits, ToolParser)
from kvgate.engine.server.tool_parsers.hermes import HermesToolParser
from kvgate.engine.server.tool_parsers.llama3_json import Llama3JsonToolParser
from kvgate.engine.server.tool_parsers.mistral import MistralToolParser
from kvgate.engine.server.tool_parsers.pythonic import PythonicToolParser
from kvgate.engine.server.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3_json": HermesToolParser,  # vLLM's alias: Qwen2.5 / Qwen3 JSON calls are hermes' syntax
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "qwen3_xml": Qwen3CoderToolParser,
    "pythonic": PythonicToolParser,
}


def tool_parser(name: str, tools: list[dict] | None = None, limits: ToolCallLimits | None = None) -> ToolParser:
    """The parser `name` (a key of TOOL_PARSERS) for a request with these tool definitions."""
    return TOOL_PARSERS[name](tools, limits)


__all__ = ["MAX_CALL_CHARS", "MAX_TOOL_CALLS", "TOOL_PARSERS", "CallStream", "HermesToolParser",
           "Llama3JsonToolParser", "MistralToolParser", "ParsedCall", "PythonicToolParser", "Qwen3CoderToolParser",
           "ToolCallLimits", "ToolParser", "tool_parser"]
