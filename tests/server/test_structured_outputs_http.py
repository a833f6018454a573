"""Structured outputs through a real `kvgate serve` process: the official openai client's parse() with a pydantic
model, the request fields vLLM takes, and 400s naming the bad field."""

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.processes

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "ok": {"type": "boolean"}},
          "required": ["n", "ok"], "additionalProperties": False}


class Address(BaseModel):
    city: str = Field(max_length=10)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "dev", "ops"]
    address: Address
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)


@pytest.fixture(scope="module")
def client(demo_server):
    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_client_parse_with_a_pydantic_model(client):
    for seed in range(5):
        completion = client.chat.completions.parse(
            model="demo", messages=[{"role": "user", "content": "who are you?"}], response_format=Person,
            temperature=1.0, seed=seed, max_tokens=400)
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop"
        assert isinstance(message.parsed, Person), message.content
    beta = client.beta.chat.completions.parse if hasattr(client.beta, "chat") else client.chat.completions.parse
    parsed = beta(model="demo", messages=[{"role": "user", "content": "hi"}], response_format=Person,
                  max_tokens=400).choices[0].message.parsed
    assert isinstance(parsed, Person)


@pytest.mark.parametrize("fields, check", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA, "strict": True}}},
     lambda text: set(json.loads(text)) == {"n", "ok"}),
    # Any object: the random model may write keys until max_tokens (an open object has no bound), so its output
    # is an object's start at least, and a whole object whenever it ended on its own (checked below).
    ({"response_format": {"type": "json_object"}}, lambda text: text.startswith("{")),
    ({"structured_outputs": {"json": SCHEMA}}, lambda text: set(json.loads(text)) == {"n", "ok"}),
    ({"structured_outputs": {"regex": "[a-c]{4}"}}, lambda text: re.fullmatch("[a-c]{4}", text)),
    ({"structured_outputs": {"choice": ["left", "right"]}}, lambda text: text in ("left", "right")),
    ({"structured_outputs": {"grammar": 'root ::= "x" [0-9]{2}'}}, lambda text: re.fullmatch("x[0-9]{2}", text)),
    ({"guided_json": SCHEMA}, lambda text: set(json.loads(text)) == {"n", "ok"}),
    ({"guided_regex": "[0-9]{3}"}, lambda text: re.fullmatch("[0-9]{3}", text)),
    ({"guided_choice": ["up", "down"]}, lambda text: text in ("up", "down")),
    ({"guided_grammar": 'start: "y" /[a-z]{2}/'}, lambda text: re.fullmatch("y[a-z]{2}", text)),
])
def test_request_fields_on_completions_and_chat(demo_server, fields, check):
    for path, body in (("/v1/completions", {"prompt": "go"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}]})):
        r = httpx.post(demo_server.url + path, json={**body, **fields, "max_tokens": 300, "temperature": 1.0,
                                                     "n": 3}, timeout=60)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            text = choice["text"] if "text" in choice else choice["message"]["content"]
            assert check(text), text
            if "json_object" not in str(fields):
                assert choice["finish_reason"] == "stop", text
            if choice["finish_reason"] == "stop" and text.startswith("{"):
                assert isinstance(json.loads(text), dict)


def test_streamed_constrained_chat_is_valid_json(client):
    stream = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "go"}], stream=True, max_tokens=300,
        extra_body={"guided_json": SCHEMA})
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert set(json.loads("".join(pieces))) == {"n", "ok"}


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "t"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar"),
    ({"guided_json": {"type": "object", "properties": 5}}, "guided_json"),
    ({"guided_json": {"type": "string", "minLength": 3, "maxLength": 1}}, "guided_json"),
    ({"guided_regex": "[z-a]"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_constraints_are_400s_naming_the_field(demo_server, fields, param):
    for path, body in (("/v1/completions", {"prompt": "go"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "go"}]})):
        r = httpx.post(demo_server.url + path, json={**body, **fields}, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert httpx.get(demo_server.url + "/health", timeout=5).status_code == 200


def test_sim_server_honours_schemas(sim_server):
    r = httpx.post(sim_server.url + "/v1/completions", json={
        "prompt": "go", "max_tokens": 300, "n": 4, "response_format": {
            "type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}}, timeout=60)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert set(json.loads(choice["text"])) == {"n", "ok"}


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
    "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "weather in Paris?"}]


def _check_call(call, tools=(WEATHER, TIME)):
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    assert call.type == "function" and call.id and call.function.name in schemas
    import jsonschema

    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_named_tool_choice_gives_a_valid_call(client):
    r = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER, TIME], max_tokens=300,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}}, n=3)
    for choice in r.choices:
        assert choice.finish_reason == "stop" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        _check_call(call)


def test_required_tool_choice_gives_one_or_more_valid_calls(client):
    r = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=400, n=4, temperature=1.0)
    names = set()
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
        for call in choice.message.tool_calls:
            _check_call(call)
            names.add(call.function.name)
    assert len({c.id for ch in r.choices for c in ch.message.tool_calls}) == sum(
        len(ch.message.tool_calls) for ch in r.choices)


@pytest.mark.parametrize("tool_choice", [{"type": "function", "function": {"name": "get_time"}}, "required"])
def test_streamed_tool_calls_assemble_to_the_same_kind_of_call(client, tool_choice):
    stream = client.chat.completions.create(model="demo", messages=ASK, tools=[WEATHER, TIME], stream=True,
                                            tool_choice=tool_choice, max_tokens=400, seed=5)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        assert not choice.delta.content
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = d.id or call["id"]
            if d.function is not None:
                call["name"] = d.function.name or call["name"]
                call["arguments"] += d.function.arguments or ""
    assert calls and finish == ("tool_calls" if tool_choice == "required" else "stop")
    for call in calls.values():
        assert call["id"] and call["name"] in ("get_weather", "get_time")
        if tool_choice != "required":
            assert call["name"] == "get_time"
        args = json.loads(call["arguments"])
        assert isinstance(args, dict)


def test_a_conversation_with_tool_results_renders(client):
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"}]
    r = client.chat.completions.create(model="demo", messages=messages, tools=[WEATHER], tool_choice="none",
                                       max_tokens=8)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


@pytest.mark.parametrize("fields, param", [
    ({"tools": [WEATHER]}, "tool_choice"),  # auto (the default): no tool-call parser here
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tools"),
])
def test_bad_tool_requests_are_400s(demo_server, fields, param):
    r = httpx.post(demo_server.url + "/v1/chat/completions", json={"messages": ASK, **fields}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text
