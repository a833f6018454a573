"""Structured outputs through a real `kvgate serve` process: the official openai client's parse() with a pydantic
model, the request fields vLLM takes, and 400s naming the bad field."""

import json
import re
from typing import Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field

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
