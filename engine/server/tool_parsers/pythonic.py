"""`pythonic` (vLLM's name): calls as a Python list of function calls with keyword arguments, as Llama 3.2's and
Llama 4's pythonic templates and ToolACE ask for.

    [get_weather(city="Paris", days=3), get_time(zone='CET')]

The output is calls when it starts (after whitespace) with `[`, and the list is a list of calls whose arguments
are all literals (strings, numbers, True/False/None, lists, dicts, tuples); the message then has no content.
Anything else is text, as vLLM answers. A second list right after the first is more calls (Meta's llama-models
writes a turn's calls so, one list each); other text after the list's closing bracket is not part of the message
(vLLM reads the whole output as one list, so either output would be text there)."""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field

from kvgate.common import bounded_json
from kvgate.engine.server.tool_parsers.base import ParsedCall, ToolParser
from kvgate.engine.server.tool_parsers.scanners import BracketScanner


@dataclass
class ListSegment:
    brackets: BracketScanner = field(default_factory=lambda: BracketScanner(python=True))


class _NotALiteral(ValueError):
    pass


def _literal(node: ast.AST):
    """A literal argument's value (ast.literal_eval's set, without sets and operators)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        out = {}
        for k, v in zip(node.keys, node.values):
            key = _literal(k)
            if not isinstance(key, str):
                raise _NotALiteral("dict keys must be strings")
            out[key] = _literal(v)
        return out
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and isinstance(node.operand.value, (int, float)) and not isinstance(node.operand.value, bool):
        return -node.operand.value
    raise _NotALiteral(type(node).__name__)


def _call(node: ast.AST) -> ParsedCall | None:
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    if any(k.arg is None for k in node.keywords):  # **kwargs
        return None
    arguments = {k.arg: _literal(k.value) for k in node.keywords}
    return ParsedCall(node.func.id, json.dumps(arguments, ensure_ascii=False, allow_nan=False))


class PythonicToolParser(ToolParser):
    name = "pythonic"
    leading = ("[",)

    def new_segment(self) -> ListSegment:
        return ListSegment()

    def scan(self, state: ListSegment, text: str) -> int | None:
        return state.brackets.feed(text)

    def parse(self, segment: str, last: bool) -> list[ParsedCall] | None:
        source = segment.strip()
        if not source.startswith("["):  # text after the list
            return []
        try:
            bounded_json.check_depth(source.replace("(", "[").replace(")", "]"))  # the parser recurses per level
            tree = ast.parse(source, mode="eval")
            if not isinstance(tree.body, ast.List) or not tree.body.elts:
                return None
            calls = [_call(e) for e in tree.body.elts]
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return None
        return None if any(c is None for c in calls) else calls
