"""The reasoning parsers (engine/server/reasoning_parsers.py): thinking split from the answer, whole and streamed
at every cut; and through a real `kvgate serve --reasoning-parser qwen3 --enable-auto-tool-choice
--tool-call-parser qwen3_coder` with the official openai client, the thinking first and a Qwen3-Coder call after
it, whole and streamed. A random model writes neither by itself, so the HTTP tests make it write them with a
regex constraint: what is tested is the server's reading of them."""

import json
import time

import openai
import pytest

from kvgate.engine.server.reasoning_parsers import REASONING_PARSERS, reasoning_parser
from tests.procs import KvgateServe

CASES = [  # (text, reasoning, content), for qwen3 and deepseek_r1 alike
    ("<think>Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),
    ("Let me think.</think>The answer is 4.", "Let me think.", "The answer is 4."),  # <think> was in the prompt
    ("<think>\nstep\n</think>\n\nDone.", "\nstep\n", "\n\nDone."),
    ("cut while thinking", "cut while thinking", None),
    ("<think>cut while thinking", "cut while thinking", None),
    ("thought</think>", "thought", None),
    ("a </thin k> b", "a </thin k> b", None),
]


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
@pytest.mark.parametrize("text, reasoning, content", CASES)
def test_extract_and_stream_at_every_cut(name, text, reasoning, content):
    parser = reasoning_parser(name)
    assert parser.extract(text) == (reasoning, content)
    for cuts in [[cut] for cut in range(len(text) + 1)] + [list(range(len(text)))]:
        stream, got_reasoning, got_content, last = parser.stream(), [], [], 0
        for cut in [*cuts, len(text)]:
            r, c = stream.feed(text[last:cut])
            got_reasoning.append(r)
            got_content.append(c)
            last = cut
        r, c = stream.finish()
        assert ("".join(got_reasoning) + r, "".join(got_content) + c) == (reasoning or "", content or ""), cuts


def test_a_qwen3_call_while_thinking_ends_the_thinking():
    text = "<think>I need the weather.\n<tool_call>\n<function=f>\n</function>\n</tool_call>"
    call = text[text.index("<tool_call>"):]
    assert reasoning_parser("qwen3").extract(text) == ("I need the weather.\n", call)
    assert reasoning_parser("deepseek_r1").extract(text) == (text[len("<think>"):], None)
    for cut in range(len(text) + 1):
        stream = reasoning_parser("qwen3").stream()
        parts = [stream.feed(text[:cut]), stream.feed(text[cut:]), stream.finish()]
        assert ("".join(p[0] for p in parts), "".join(p[1] for p in parts)) == ("I need the weather.\n", call)


def test_qwen3_with_thinking_off_is_all_answer():
    text = "<think>a</think>b"
    assert reasoning_parser("qwen3", {"enable_thinking": False}).extract(text) == (None, text)
    assert reasoning_parser("qwen3", {"enable_thinking": True}).extract(text) == ("a", "b")
    assert reasoning_parser("deepseek_r1", {"enable_thinking": False}).extract(text) == ("a", "b")  # no switch


@pytest.mark.parametrize("text, reasoning, content", [
    ('{"a": 1}', None, '{"a": 1}'), ("<think>x</think>{}", "x", "{}"), ("x</think>y", None, "x</think>y"),
    ("<thin", None, "<thin")])
def test_a_constrained_output_thinks_only_when_it_opens_with_the_tag(text, reasoning, content):
    """Its grammar chose its first characters: a JSON answer must not become reasoning."""
    parser = reasoning_parser("qwen3", constrained=True)
    assert parser.extract(text) == (reasoning, content)
    for cut in range(len(text) + 1):
        stream = parser.stream()
        r1, c1 = stream.feed(text[:cut])
        r2, c2 = stream.feed(text[cut:])
        r3, c3 = stream.finish()
        assert (r1 + r2 + r3, c1 + c2 + c3) == (reasoning or "", content or ""), cut


def test_streaming_holds_back_only_a_possible_tag():
    stream = reasoning_parser("qwen3").stream()
    assert stream.feed("<thi") == ("", "")
    assert stream.feed("nk>Hmm, </th") == ("Hmm, ", "")
    assert stream.feed("ink>Yes") == ("", "Yes")
    assert stream.feed(" <think>") == ("", " <think>")  # after the thinking, tags are text


def test_streaming_work_is_linear_in_the_output():
    def seconds(n: int) -> float:
        best = float("inf")
        text = "<think>" + "x" * n + "</think>" + "y" * n
        for _ in range(5):
            stream, started = reasoning_parser("qwen3").stream(), time.process_time()
            for i in range(0, len(text), 4):
                stream.feed(text[i:i + 4])
            stream.finish()
            best = min(best, time.process_time() - started)
        return best

    small, large = seconds(25_000), seconds(100_000)
    assert large < 8 * small, (small, large)


# --- through the server ----------------------------------------------------------------------------------------

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"]}}}
ASK = [{"role": "user", "content": "weather in Paris?"}]
# The model is made to think, say a word, then write a Qwen3-Coder call (a stand-in for a thinking, tool-using model).
THINKS_THEN_CALLS = {"structured_outputs": {"regex": r"<think>\nThe user wants (Paris|Rome)\.\n</think>\n\nChecking\."
                                                     r"\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
                                                     r"(Paris|Rome)\n</parameter>\n<parameter=days>\n[1-3]\n"
                                                     r"</parameter>\n</function>\n</tool_call>"}}
THINKS_THEN_ANSWERS = {"structured_outputs": {"regex": r"<think>Easy\.</think>It is sunny\."}}


@pytest.fixture(scope="module")
def thinking_server(kvgate_cache):
    with KvgateServe("sim-8b", "--backend", "sim", "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
                     "--tool-call-parser", "qwen3_coder", cache_dir=kvgate_cache) as server:
        yield server


@pytest.fixture(scope="module")
def client(thinking_server):
    return openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.mark.processes
def test_thinking_then_a_call(client):
    r = client.chat.completions.create(model="sim-8b", messages=ASK, tools=[WEATHER], max_tokens=300,
                                       extra_body=THINKS_THEN_CALLS)
    choice = r.choices[0]
    message = choice.message.model_dump()
    assert message["reasoning"] == message["reasoning_content"]
    assert message["reasoning"].startswith("\nThe user wants ")
    assert choice.message.content == "\n\nChecking.\n" and choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Rome")
    assert arguments["days"] in (1, 2, 3)  # typed by the tool's schema


@pytest.mark.processes
def test_streamed_thinking_then_a_call(client):
    stream = client.chat.completions.create(model="sim-8b", messages=ASK, tools=[WEATHER], max_tokens=300,
                                            stream=True, extra_body=THINKS_THEN_CALLS)
    reasoning, content, calls, finish, order = "", "", [], None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta.model_dump()
        finish = choice.finish_reason or finish
        if delta.get("reasoning"):
            assert delta["reasoning_content"] == delta["reasoning"]
            reasoning += delta["reasoning"]
            order.append("reasoning")
        if delta.get("content"):
            content += delta["content"]
            order.append("content")
        if choice.delta.tool_calls:
            calls += choice.delta.tool_calls
            order.append("call")
    assert reasoning.startswith("\nThe user wants ") and content == "\n\nChecking.\n" and finish == "tool_calls"
    assert order.index("content") > max(i for i, kind in enumerate(order) if kind == "reasoning")
    assert order.count("reasoning") > 1  # the thinking streams as it comes
    (call,) = calls
    assert call.index == 0 and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["days"] in (1, 2, 3)


@pytest.mark.processes
def test_thinking_off_and_reasoning_left_out(client):
    off = client.chat.completions.create(model="sim-8b", messages=ASK, max_tokens=100,
                                         extra_body={**THINKS_THEN_ANSWERS,
                                                     "chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == "<think>Easy.</think>It is sunny."
    assert off.choices[0].message.model_dump()["reasoning"] is None
    on = client.chat.completions.create(model="sim-8b", messages=ASK, max_tokens=100, extra_body=THINKS_THEN_ANSWERS)
    assert on.choices[0].message.content == "It is sunny."
    assert on.choices[0].message.model_dump()["reasoning_content"] == "Easy."
    constrained = client.chat.completions.create(model="sim-8b", messages=ASK, max_tokens=100,
                                                 extra_body={"structured_outputs": {"regex": r'\{"a": [0-9]\}'}})
    assert constrained.choices[0].message.content.startswith('{"a": ')  # the answer, not reasoning
    assert constrained.choices[0].message.model_dump()["reasoning"] is None
    hidden = client.chat.completions.create(model="sim-8b", messages=ASK, max_tokens=100,
                                            extra_body={**THINKS_THEN_ANSWERS, "include_reasoning": False})
    assert hidden.choices[0].message.content == "It is sunny."
    assert hidden.choices[0].message.model_dump()["reasoning"] is None
