"""`tool_choice: "auto"` with the hermes tool-call parser: the parser on texts a model writes (finished and
streamed, split at every point), and through a real `kvgate serve --enable-auto-tool-choice --tool-call-parser
hermes` with the official openai client. A random model never decides to call a tool by itself, so the HTTP tests
make it write the calls with a regex constraint: what is tested is the server's reading of them."""

import json

import httpx
import openai
import pytest

from kvgate.engine.server.tool_parsers import HermesToolParser, ParsedCall
from tests.procs import KvgateServe

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
WEATHER_CALL = ParsedCall("get_weather", '{"city": "Paris", "unit": "c"}')


@pytest.mark.parametrize("text, content, calls", [
    ("just text", "just text", []),
    (CALL, None, [WEATHER_CALL]),
    ("Let me look.\n" + CALL, "Let me look.\n", [WEATHER_CALL]),
    (CALL + CALL.replace("Paris", "Köln"), None, [WEATHER_CALL, ParsedCall("get_weather", '{"city": "Köln", "unit": "c"}')]),
    (CALL[:-len("</tool_call>")], None, [WEATHER_CALL]),  # the output ended inside its last block
    ('<tool_call>{"name": "f", "arguments": {"a": [1, {"b": null}]}}</tool_call>', None,
     [ParsedCall("f", '{"a": [1, {"b": null}]}')]),
    ("x <tool_call>{not json}</tool_call>", "x <tool_call>{not json}</tool_call>", []),  # text, as vLLM answers
    (CALL + '<tool_call>{"name": 3}</tool_call>', CALL + '<tool_call>{"name": 3}</tool_call>', []),
    ('<tool_call>{"name": "f", "arguments": "a string"}</tool_call>',
     '<tool_call>{"name": "f", "arguments": "a string"}</tool_call>', []),
    ("a < b and <tool_ca", "a < b and <tool_ca", []),
])
def test_hermes_extract(text, content, calls):
    assert HermesToolParser().extract(text) == (content, calls)


def _streamed(text: str, cuts: list[int]) -> tuple[str, list[ParsedCall]]:
    stream = HermesToolParser().stream()
    sent, calls, last = [], [], 0
    for cut in [*cuts, len(text)]:
        content, done = stream.feed(text[last:cut])
        sent.append(content)
        calls += done
        last = cut
    content, done = stream.finish()
    return "".join(sent) + content, calls + done


@pytest.mark.parametrize("text", ["Let me look.\n" + CALL, CALL + "\n" + CALL, "plain < text <tool", "a" + CALL[:-3],
                                  "x <tool_call>{broken</tool_call> y"])
def test_hermes_stream_matches_extract_at_every_split(text):
    content, calls = HermesToolParser().extract(text)
    for cut in range(len(text) + 1):
        for cuts in ([cut], list(range(0, len(text), 3)), list(range(len(text)))):
            got_content, got_calls = _streamed(text, sorted(set(cuts)))
            if calls:
                assert got_calls == calls and got_content == (content or ""), (text, cuts)
            else:
                assert got_calls == [] and got_content == text, (text, cuts)


def test_text_streams_as_it_comes_holding_back_only_a_possible_tag():
    stream = HermesToolParser().stream()
    assert stream.feed("Hello wor") == ("Hello wor", [])
    assert stream.feed("ld <tool") == ("ld ", [])  # "<tool" may begin a tag
    assert stream.feed("box>") == ("<toolbox>", [])
    assert stream.feed("<tool_call>") == ("", [])
    assert stream.feed(CALL[len("<tool_call>"):]) == ("", [WEATHER_CALL])


# --- through the server ----------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}
ASK = [{"role": "user", "content": "weather in Paris?"}]
# The model is made to write a hermes call after a short sentence (the constraint stands in for a tool-using model).
WRITES_A_CALL = {"structured_outputs": {"regex": r'Checking\.<tool_call>\n\{"name": "get_weather", "arguments": '
                                                 r'\{"city": "(Paris|Rome)", "unit": "(c|f)"\}\}\n</tool_call>'}}


@pytest.fixture(scope="module")
def auto_server(kvgate_cache):
    with KvgateServe("sim-8b", "--backend", "sim", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                     cache_dir=kvgate_cache) as server:
        yield server


@pytest.fixture(scope="module")
def client(auto_server):
    return openai.OpenAI(base_url=auto_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.processes
def test_auto_reads_the_models_calls(client):
    for tool_choice in ("auto", openai.NOT_GIVEN):  # auto is also the default when tools are given
        r = client.chat.completions.create(model="sim-8b", messages=ASK, tools=[WEATHER], tool_choice=tool_choice,
                                           max_tokens=200, extra_body=WRITES_A_CALL)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.id and call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


@pytest.mark.processes
def test_auto_without_a_call_is_text(client):
    r = client.chat.completions.create(model="sim-8b", messages=ASK, tools=[WEATHER], max_tokens=200,
                                       extra_body={"structured_outputs": {"regex": "No tool needed[.]"}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content == "No tool needed."
    assert not choice.message.tool_calls


@pytest.mark.processes
def test_streamed_auto_sends_text_then_the_whole_call(client):
    stream = client.chat.completions.create(model="sim-8b", messages=ASK, tools=[WEATHER], stream=True,
                                            max_tokens=200, extra_body=WRITES_A_CALL)
    content, calls, finish = "", [], None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        content += choice.delta.content or ""
        calls += choice.delta.tool_calls or []
    assert content == "Checking." and finish == "tool_calls"
    (call,) = calls
    assert call.index == 0 and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["unit"] in ("c", "f")


def test_flags_go_together(capsys):
    from kvgate.cli import main

    for flags in (["--enable-auto-tool-choice"], ["--tool-call-parser", "hermes"]):
        assert main(["serve", "x", "--backend", "sim", *flags]) == 2  # refused before anything starts
        assert "go together" in capsys.readouterr().err
    assert main(["serve", "x", "--backend", "sim", "--enable-auto-tool-choice", "--tool-call-parser", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tool-call-parser 'nope' is not one of: hermes, llama3_json" in err
    assert main(["serve", "x", "--backend", "sim", "--reasoning-parser", "nope"]) == 2
    assert capsys.readouterr().err == "kvgate serve: error: --reasoning-parser 'nope' is not one of: deepseek_r1, qwen3\n"


@pytest.mark.processes
def test_named_and_required_still_constrain_with_auto_enabled(auto_server):
    bounded = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        "required": ["zone"], "additionalProperties": False}}}
    r = httpx.post(auto_server.url + "/v1/chat/completions", timeout=60, json={
        "messages": ASK, "tools": [bounded], "tool_choice": "required", "max_tokens": 300})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["tool_calls"]
