"""The tool-call parsers (engine/server/tool_parsers/) on the texts each family's models write: finished outputs,
the same texts streamed cut at every point, the bounds on calls, and streaming work linear in the output.
tests/server/test_parsers_vs_vllm.py compares them with vLLM's own parsers."""

import json
import time

import pytest

from kvgate.engine.server.tool_parsers import TOOL_PARSERS, ParsedCall, ToolCallLimits, tool_parser

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}, "opts": {"type": "object"},
                                     "temp": {"type": "number"}}}}}
PARIS = ParsedCall("get_weather", '{"city": "Paris"}')
ROME = ParsedCall("get_weather", '{"city": "Rome"}')


def _qwen3_call(city: str, extra: str = "") -> str:
    return (f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n{extra}</function>\n"
            "</tool_call>")


# (parser, text, content, calls): what kvgate answers for a finished output
CASES = [
    # llama3_json: JSON objects opening the output, `;`-separated, with or without <|python_tag|>
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [PARIS]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "arguments": {"city": "Paris"}}; '
                    '{"name": "get_weather", "arguments": {"city": "Rome"}}', None, [PARIS, ROME]),
    ("llama3_json", '  {"name": "get_weather", "parameters": {"city": "Paris"}}<|eom_id|>', None, [PARIS]),
    ("llama3_json", "The weather is fine {maybe}.", "The weather is fine {maybe}.", []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par', '{"name": "get_weather", "parameters": '
                                                                         '{"city": "Par', []),  # cut short
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    # Llama 3.1's code_interpreter and built-in tools after <|python_tag|>: no JSON call, all text (streamed too)
    ("llama3_json", "  <|python_tag|>import math\nprint(math.pi)", "  <|python_tag|>import math\nprint(math.pi)", []),
    ("llama3_json", '<|python_tag|>brave_search.call(query="Köln")', '<|python_tag|>brave_search.call(query="Köln")',
     []),
    ("llama3_json", '{"name": "f", "parameters": {"s": "}{\\"]"}}', None, [ParsedCall("f", '{"s": "}{\\"]"}')]),
    # mistral: before v11 a JSON array after [TOOL_CALLS]; v11+ name[ARGS]{...} per call
    ("mistral", 'Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_weather", "arguments": {"city": "Rome"}}]', "Let me check. ", [PARIS, ROME]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}] trailing', None, [PARIS]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}',
     None, [PARIS, ROME]),
    ("mistral", '[TOOL_CALLS]get_weather{"city": "Paris"}', None, [PARIS]),
    ("mistral", 'plain [TOOLS] text', "plain [TOOLS] text", []),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"ci', '[TOOL_CALLS] [{"name": "get_weather", '
                                                                          '"arguments": {"ci', []),
    # qwen3_coder: XML, values typed by the tool's schema
    ("qwen3_coder", "Let me check.\n" + _qwen3_call("Paris") + "\n" + _qwen3_call("Rome"), "Let me check.\n",
     [PARIS, ROME]),
    ("qwen3_coder", _qwen3_call("Paris", "<parameter=days>\n3\n</parameter>\n<parameter=metric>\nfalse\n"
                                         "</parameter>\n<parameter=opts>\n{\"a\": [1, null]}\n</parameter>\n"
                                         "<parameter=temp>\n21.5\n</parameter>\n<parameter=note>\n42\n</parameter>\n"),
     None, [ParsedCall("get_weather", '{"city": "Paris", "days": 3, "metric": false, "opts": {"a": [1, null]}, '
                                      '"temp": 21.5, "note": "42"}')]),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>",
     None, [PARIS]),  # the output ended before </tool_call>
    ("qwen3_coder", "<tool_call>\nnot xml\n</tool_call>", "<tool_call>\nnot xml\n</tool_call>", []),
    ("qwen3_coder", "a <tool and </tool_call> text", "a <tool and </tool_call> text", []),
    # pythonic: a Python list of calls with literal keyword arguments
    ("pythonic", '[get_weather(city="Paris"), get_weather(city=\'Rome\')]', None, [PARIS, ROME]),
    ("pythonic", '[get_weather(city="Paris", days=-3, opts={"a": (1, None, True)})]', None,
     [ParsedCall("get_weather", '{"city": "Paris", "days": -3, "opts": {"a": [1, null, true]}}')]),
    ("pythonic", "[get_weather()]", None, [ParsedCall("get_weather", "{}")]),
    ("pythonic", "[get_weather(city=x)]", "[get_weather(city=x)]", []),  # not a literal
    ("pythonic", "[1, 2, 3]", "[1, 2, 3]", []),
    ("pythonic", " \n[1, 2]", " \n[1, 2]", []),  # the whitespace before a list that is no call stays content
    ("pythonic", 'Sure! [get_weather(city="Paris")]', 'Sure! [get_weather(city="Paris")]', []),
    ("pythonic", '[get_weather(city="Par', '[get_weather(city="Par', []),
    # hermes (and its alias): tests/server/test_auto_tool_choice.py has more
    ("qwen3_json", 'ok<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', "ok",
     [PARIS]),
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
     "Let me look.\n", [PARIS, ROME]),
    ("hermes", 'x <tool_call>{not json}</tool_call>', 'x <tool_call>{not json}</tool_call>', []),
]


def _parser(name, **limits):
    return tool_parser(name, [WEATHER_TOOL], ToolCallLimits(**limits) if limits else None)


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_extract(name, text, content, calls):
    assert _parser(name).extract(text) == (content, calls)


def streamed(parser, text: str, cuts) -> tuple[str, list[ParsedCall]]:
    stream = parser.stream()
    sent, calls, last = [], [], 0
    for cut in [*cuts, len(text)]:
        content, done = stream.feed(text[last:cut])
        sent.append(content)
        calls += done
        last = cut
    content, done = stream.finish()
    return "".join(sent) + content, calls + done


@pytest.mark.parametrize("name, text, content, calls", CASES)
def test_stream_matches_extract_at_every_split(name, text, content, calls):
    parser = _parser(name)
    for cuts in [[cut] for cut in range(len(text) + 1)] + [list(range(0, len(text), 3)), list(range(len(text)))]:
        expected = ((content or ""), calls) if calls else (text, [])
        assert streamed(parser, text, cuts) == expected, (text, cuts)


def test_text_streams_as_it_comes_holding_back_only_a_possible_opener():
    stream = _parser("mistral").stream()
    assert stream.feed("Hello [TOOL") == ("Hello ", [])
    assert stream.feed("S] x [TOOL_C") == ("[TOOLS] x ", [])
    assert stream.feed('ALLS]get_weather[ARGS]{"city": ') == ("", [])
    assert stream.feed('"Paris"}') == ("", [PARIS])
    stream = _parser("pythonic").stream()
    assert stream.feed("  ") == ("", [])  # may still open a list
    assert stream.feed("no list") == ("  no list", [])
    assert stream.feed(" [f()]") == (" [f()]", [])  # the output did not open with the list: text


def test_each_call_goes_out_when_it_closes():
    stream = _parser("qwen3_coder").stream()
    text = "Sure.\n" + _qwen3_call("Paris") + _qwen3_call("Rome")
    first_end = text.index("</tool_call>") + len("</tool_call>")
    assert stream.feed(text[:first_end]) == ("Sure.\n", [PARIS])
    assert stream.feed(text[first_end:]) == ("", [ROME])
    assert stream.finish() == ("", [])


def test_a_call_that_does_not_parse_after_sent_calls_goes_out_as_text():
    text = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_weather[ARGS]{"city": Rome}'
    parser = _parser("mistral")
    assert parser.extract(text) == (text, [])  # finished: all or nothing, as vLLM answers a malformed output
    assert streamed(parser, text, range(len(text))) == ('[TOOL_CALLS]get_weather[ARGS]{"city": Rome}', [PARIS])


def test_mistral_call_ids_are_mistrals_nine_characters():
    ids = {_parser("mistral").call_id() for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert _parser("hermes").call_id().startswith("chatcmpl-tool-")


# --- bounds ----------------------------------------------------------------------------------------------------

def _calls_text(name: str, n: int, city: str = "Paris") -> str:
    """n calls in the parser's syntax."""
    if name in ("hermes", "qwen3_json"):
        return "".join(f'<tool_call>{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}</tool_call>'
                       for _ in range(n))
    if name in ("llama3_json", "llama4_json"):
        return "; ".join(f'{{"name": "get_weather", "parameters": {{"city": "{city}"}}}}' for _ in range(n))
    if name == "mistral":
        return "".join(f'[TOOL_CALLS]get_weather[ARGS]{{"city": "{city}"}}' for _ in range(n))
    if name in ("qwen3_coder", "qwen3_xml"):
        return "".join(_qwen3_call(city) for _ in range(n))
    assert name == "pythonic"
    return "[" + ", ".join(f'get_weather(city="{city}")' for _ in range(n)) + "]"


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_number_of_calls_is_bounded(name):
    parser = _parser(name, max_calls=3)
    at_limit, over = _calls_text(name, 3), _calls_text(name, 4)
    assert parser.extract(at_limit) == (None, [PARIS] * 3)
    assert parser.extract(over) == (over, [])
    content, calls = streamed(parser, over, range(0, len(over), 7))
    assert len(calls) <= 3 and (content == over or calls)  # past the bound: text from there on


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_size_of_a_call_is_bounded(name):
    one = _calls_text(name, 1)
    limit = len(one) + 1  # the bound counts one call's text; +1: llama's and mistral's separators, a margin
    parser = _parser(name, max_call_chars=limit)
    assert parser.extract(one)[1] == [PARIS]
    longer = _calls_text(name, 1, city="Paris" + "x" * 2)
    assert parser.extract(longer) == (longer, [])
    assert streamed(parser, longer, range(0, len(longer), 5)) == (longer, [])


def test_default_bounds_are_generous_and_finite():
    from kvgate.engine.server.tool_parsers import MAX_CALL_CHARS, MAX_TOOL_CALLS

    assert 16 <= MAX_TOOL_CALLS <= 1024 and 64 << 10 <= MAX_CALL_CHARS <= 1 << 20


# --- linear work --------------------------------------------------------------------------------------------------

def _stream_seconds(name: str, arg_chars: int, piece: int = 4) -> float:
    """CPU seconds to stream one call with `arg_chars` characters of arguments, `piece` characters per feed (a
    token's worth): the best of five (CPU time, not wall time: other processes share the machine)."""
    text = _calls_text(name, 1, city="Paris" + "y" * arg_chars)
    best = float("inf")
    for _ in range(5):
        stream = _parser(name).stream()
        started = time.process_time()
        calls = []
        for i in range(0, len(text), piece):
            calls += stream.feed(text[i:i + piece])[1]
        calls += stream.finish()[1]
        best = min(best, time.process_time() - started)
        assert len(calls) == 1 and len(json.loads(calls[0].arguments)["city"]) == 5 + arg_chars
    return best


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "qwen3_coder", "pythonic"])
def test_streaming_work_is_linear_in_the_output(name):
    """Four times the text costs about four times the time (a parser that re-read its whole text on every piece
    would cost sixteen)."""
    small, large = _stream_seconds(name, 48_000), _stream_seconds(name, 192_000)
    assert large < 8 * small, (name, small, large)


def test_text_held_back_is_bounded():
    """What a stream holds before deciding is bounded too: a Mistral call's name (1 KiB), the whitespace before a
    leading format's first character (one call's size)."""
    from kvgate.engine.server.tool_parsers.mistral import _MAX_HEAD

    name = "n" * (_MAX_HEAD + 1)
    long_name = f'[TOOL_CALLS]{name}[ARGS]{{"city": "Paris"}}'
    assert _parser("mistral").extract(long_name) == (long_name, [])
    assert streamed(_parser("mistral"), long_name, range(0, len(long_name), 9)) == (long_name, [])
    ok_name = f'[TOOL_CALLS]{"n" * (_MAX_HEAD - 40)}[ARGS]{{"city": "Paris"}}'
    assert _parser("mistral").extract(ok_name)[1] == [ParsedCall("n" * (_MAX_HEAD - 40), '{"city": "Paris"}')]
    spaces = " " * 101
    stream = _parser("pythonic", max_call_chars=100).stream()
    assert stream.feed(spaces[:100]) == ("", [])  # held: may still open a list
    assert stream.feed(spaces[100:]) == (spaces, [])  # past the bound: text
