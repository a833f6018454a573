"""`qwen3_coder` (vLLM's name; `qwen3_xml` is its alias there): Qwen3-Coder's XML calls.

    optional text<tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each is typed by the request's schema for that parameter, as vLLM types them: integer
and number parse as numbers, boolean as true/false, object and array as JSON (else a Python literal), null
text as null; a string parameter, or one the schema does not describe, stays text. One newline around a value
is the template's markup and is dropped. A value runs to `</parameter>` or to the next `<parameter=`; a last
parameter the output ended inside is dropped (vLLM's rule)."""

from __future__ import annotations

import ast
import json
import re

from kvgate.common import bounded_json
from kvgate.engine.server.tool_parsers.base import ParsedCall, loads_json
from kvgate.engine.server.tool_parsers.tagged import TaggedBlockParser

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=))", re.DOTALL)


def _unwrap(value: str) -> str:
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def typed_value(value: str, schema: dict | None):
    """A parameter's text as its schema's type (text when it does not parse as one)."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the first non-null type
        kind = next((k for k in kind if k != "null"), None)
    if value.strip().lower() == "null" and kind != "string":
        return None
    if kind in (None, "string", "str", "text"):
        return value
    text = value.strip()
    try:
        if kind in ("integer", "int"):
            return int(text)
        if kind in ("number", "float"):
            number = float(text)
            return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
        if kind in ("boolean", "bool"):
            return {"true": True, "false": False}.get(text.lower(), value)
        if kind in ("object", "array"):
            try:
                return loads_json(text)
            except ValueError:
                bounded_json.check_depth(text)
                return ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return value
    return value


class Qwen3CoderToolParser(TaggedBlockParser):
    name = "qwen3_coder"

    def _schema(self, function: str) -> dict:
        for tool in self.tools:
            spec = tool.get("function", tool)
            if spec.get("name") == function:
                return (spec.get("parameters") or {}).get("properties") or {}
        return {}

    def parse_body(self, body: str) -> ParsedCall | None:
        m = _FUNCTION.match(body)
        if m is None:
            return None
        name = m.group(1).strip()
        if not name:
            return None
        schema = self._schema(name)
        arguments = {}
        for p in _PARAMETER.finditer(m.group(2)):
            key = p.group(1).strip()
            arguments[key] = typed_value(_unwrap(p.group(2)), schema.get(key))
        try:
            text = json.dumps(arguments, ensure_ascii=False)
        except (TypeError, ValueError):  # a literal JSON cannot hold (a set, bytes, a complex number)
            return None
        return ParsedCall(name, text)
