"""The Responses and Anthropic Messages APIs' translation to and from chat, in process: requests to chat
conversations and fields, chat answers and chat stream chunks to each API's objects and events, the bounded
response store, and Anthropic's error shape. (Through a real gateway with the official clients:
tests/test_up_apis.py.)"""

import json

import pytest
from pydantic import ValidationError
from anthropic.types import Message
from openai.types.responses import Response

from kvgate.common.errors import InvalidRequestError
from kvgate.engine.server.anthropic_errors import reshaped
from kvgate.engine.server.anthropic_protocol import MessagesRequest
from kvgate.engine.server.chat_bridge import chat_request
from kvgate.engine.server.response_store import ResponseStore, StoreLimits
from kvgate.engine.server.responses_protocol import ResponsesRequest
from kvgate.engine.server import serving_messages as sm
from kvgate.engine.server import serving_responses as sr

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def responses_chat(body: dict) -> dict:
    req = ResponsesRequest.model_validate(body)
    return sr.chat_fields(req, sr.conversation_of(req, []))


def messages_chat(body: dict) -> dict:
    return sm.chat_fields(MessagesRequest.model_validate({"model": "m", "max_tokens": 5, **body}))


def test_a_responses_request_becomes_chat():
    fields = responses_chat({
        "model": "m", "instructions": "be brief", "max_output_tokens": 7, "temperature": 0.5, "top_k": 3,
        "input": [
            {"role": "developer", "content": "dev"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                            {"type": "input_text", "text": "b"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "calling"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"x\":1}"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call_output", "call_id": "c1", "output": "42"}],
        "tools": [{"type": "function", "name": "f", "parameters": WEATHER}], "tool_choice": {"type": "function",
                                                                                          "name": "f"},
        "text": {"format": {"type": "json_schema", "name": "s", "schema": WEATHER}}})
    assert fields["messages"] == [
        {"role": "system", "content": "be brief"}, {"role": "system", "content": "dev"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"x\":1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    assert (fields["max_tokens"], fields["temperature"], fields["top_k"]) == (7, 0.5, 3)
    assert fields["tools"] == [{"type": "function", "function": {"name": "f", "parameters": WEATHER}}]
    assert fields["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert fields["response_format"] == {"type": "json_schema", "json_schema": {"name": "s", "schema": WEATHER}}
    chat_request(fields)  # a valid chat request


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "web_search_call"}]}, "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
    ({"input": [{"type": "function_call", "name": "f"}]}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "x", "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text"),
])
def test_what_the_responses_api_cannot_serve_is_a_400_naming_the_field(body, param):
    with pytest.raises(InvalidRequestError) as caught:
        responses_chat(body)
    assert caught.value.param == param


def test_an_anthropic_request_becomes_chat():
    fields = messages_chat({
        "system": [{"type": "text", "text": "sys "}, {"type": "text", "text": "prompt"}], "top_k": 5,
        "stop_sequences": ["END"], "tools": [{"name": "f", "description": "d", "input_schema": WEATHER}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "hm", "signature": ""},
                                              {"type": "text", "text": "calling"},
                                              {"type": "tool_use", "id": "t1", "name": "f", "input": {"city": "P"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "text", "text": "sunny"}]},
                                         {"type": "text", "text": "and now?"}]}]})
    assert fields["messages"] == [
        {"role": "system", "content": "sys prompt"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "calling", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "f", "arguments": '{"city": "P"}'}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny"}, {"role": "user", "content": "and now?"}]
    assert (fields["max_tokens"], fields["top_k"], fields["stop"]) == (5, 5, ["END"])
    assert fields["tools"] == [{"type": "function", "function": {"name": "f", "parameters": WEATHER,
                                                                 "description": "d"}}]
    assert fields["tool_choice"] == "required" and fields["parallel_tool_calls"] is False
    assert messages_chat({"messages": [{"role": "user", "content": "x"}], "tools": fields and [
        {"name": "f", "input_schema": WEATHER}], "tool_choice": {"type": "tool", "name": "f"}})["tool_choice"] == {
        "type": "function", "function": {"name": "f"}}
    chat_request(fields)


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}]},
    {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]}]},
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"name": "web", "type": "web_search_20250305",
                                                                "input_schema": {}}]},
    {"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "tool"}},
    {"messages": [{"role": "user", "content": "x"}], "system": [{"type": "image"}]},
])
def test_what_the_messages_api_cannot_serve_is_a_400(body):
    with pytest.raises(InvalidRequestError):
        messages_chat(body)


@pytest.mark.parametrize("finish, engine_stop, called, reason", [
    ("stop", None, False, ("end_turn", None)),
    ("stop", "END", False, ("stop_sequence", "END")),
    ("stop", 2, False, ("end_turn", None)),  # a stop token id is the end of the turn
    ("length", None, False, ("max_tokens", None)),
    ("tool_calls", None, True, ("tool_use", None)),
    ("stop", None, True, ("tool_use", None)),  # a named call ends with chat's "stop"
])
def test_anthropic_stop_reasons(finish, engine_stop, called, reason):
    assert sm.stop_reason(finish, engine_stop, called, ["END"]) == reason


def chat_chunk(delta: dict, finish: str | None = None, **choice) -> dict:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish, **choice}]}


CALL_START = {"tool_calls": [{"index": 0, "id": "call-1", "type": "function",
                              "function": {"name": "f", "arguments": ""}}]}
CALL_ARGS = {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "P"}'}}]}
USAGE = {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 9, "total_tokens": 20,
                                  "prompt_tokens_details": {"cached_tokens": 4}}}
# a reasoning model's chat stream: role chunk, reasoning, text, a tool call, the finish, the usage
CHAT_STREAM = [chat_chunk({"role": "assistant", "content": ""}), chat_chunk({"reasoning_content": "think"}),
               chat_chunk({"reasoning_content": "ing"}), chat_chunk({"content": "Hel"}), chat_chunk({"content": "lo"}),
               chat_chunk(CALL_START), chat_chunk(CALL_ARGS), chat_chunk({}, "tool_calls"), USAGE]


def test_a_chat_stream_as_responses_events():
    req = ResponsesRequest.model_validate({"input": "x"})
    events = sr.ResponseEvents(sr.ResponseShape(req, "m", stored=False))
    out = events.start() + [e for c in CHAT_STREAM for e in events.feed(c)] + events.finish()
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert [e["output_index"] for e in out if e["type"] == "response.output_item.added"] == [0, 1, 2]
    final = Response.model_validate(out[-1]["response"])  # the official client's type
    assert final.status == "completed" and final.output_text == "Hello"
    assert [o.type for o in final.output] == ["reasoning", "message", "function_call"]
    assert final.output[2].arguments == '{"city": "P"}' and final.output[2].call_id == "call-1"
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.input_tokens_details.cached_tokens) \
        == (11, 9, 4)
    # the whole answer, from chat's non-streamed message, has the same items
    whole = sr.output_items({"role": "assistant", "reasoning_content": "thinking", "content": "Hello",
                             "tool_calls": [{"id": "call-1", "type": "function",
                                             "function": {"name": "f", "arguments": '{"city": "P"}'}}]})
    assert [(o["type"], o.get("name")) for o in whole] == [(o.type, getattr(o, "name", None)) for o in final.output]


def test_a_cut_responses_stream_is_incomplete_and_an_error_is_an_error_event():
    req = ResponsesRequest.model_validate({"input": "x", "max_output_tokens": 2})
    events = sr.ResponseEvents(sr.ResponseShape(req, "m", stored=False))
    events.start()
    events.feed(chat_chunk({"content": "ab"}, "length"))
    last = events.finish()[-1]
    assert last["type"] == "response.incomplete"
    assert last["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    failing = sr.ResponseEvents(sr.ResponseShape(req, "m", stored=False))
    out = failing.feed({"error": {"message": "the engine stopped", "type": "server_error", "code": 503}})
    assert out[-1]["type"] == "error" and out[-1]["message"] == "the engine stopped" and failing.failed


def test_a_chat_stream_as_anthropic_events():
    events = sm.MessageEvents("msg_1", "m", 11, None)
    out = events.start() + [e for c in CHAT_STREAM for e in events.feed(c)] + events.finish()
    assert [(e["type"], e.get("index")) for e in out] == [
        ("message_start", None), ("ping", None),
        ("content_block_start", 0), ("content_block_delta", 0), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1), ("content_block_delta", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2),
        ("message_delta", None), ("message_stop", None)]
    assert [out[i]["content_block"]["type"] for i in (2, 7, 11)] == ["thinking", "text", "tool_use"]
    assert [out[i]["delta"]["type"] for i in (3, 4, 5)] == ["thinking_delta", "thinking_delta", "signature_delta"]
    assert out[12]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "P"}'}
    assert out[-2]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert out[-2]["usage"] == {"input_tokens": 11, "output_tokens": 9}
    whole = sm.content_blocks({"reasoning_content": "thinking", "content": "Hello", "tool_calls": [
        {"id": "call-1", "type": "function", "function": {"name": "f", "arguments": '{"city": "P"}'}}]})
    message = Message.model_validate({"id": "msg_1", "type": "message", "role": "assistant", "model": "m",
                                      "content": whole, "stop_reason": "tool_use", "stop_sequence": None,
                                      "usage": sm.message_usage(11, 9)})  # the official client's type
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"city": "P"}


def test_a_stop_sequence_in_an_anthropic_stream():
    events = sm.MessageEvents("msg_1", "m", 3, ["END"])
    events.feed(chat_chunk({"content": "a"}))
    events.feed(chat_chunk({}, "stop", stop_reason="END"))
    assert events.finish()[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_response_store_is_bounded_by_count_bytes_and_age():
    clock = Clock()
    store = ResponseStore(StoreLimits(max_entries=3, max_bytes=100, ttl_s=10.0), clock)
    for i in range(4):  # the 4th pushes out the 1st (count)
        assert store.put(f"r{i}", {"id": i}, [], size=10)
    assert store.get("r0") is None and [store.get(f"r{i}").response["id"] for i in (1, 2, 3)] == [1, 2, 3]
    assert store.put("big", {}, [], size=85)  # r1 goes for the count, r2 for the bytes: 10 + 85 <= 100
    assert len(store) == 2 and store.bytes == 95 and store.get("r2") is None and store.get("r3") is not None
    assert not store.put("huge", {}, [], size=101)  # alone over the budget: not stored, nothing dropped
    assert len(store) == 2
    clock.now = 10.5  # past the TTL: gone
    assert store.get("r3") is None and len(store) == 0 and store.bytes == 0
    off = ResponseStore(StoreLimits(max_entries=0))
    assert not off.enabled and not off.put("r", {}, [], size=1)


def test_previous_response_id_with_the_store_off_or_an_unknown_id():
    serving = sr.OpenAIServingResponses(chat=None, store=ResponseStore(StoreLimits(max_entries=0)))
    with pytest.raises(InvalidRequestError, match="stores none") as caught:
        serving.previous(ResponsesRequest.model_validate({"input": "x", "previous_response_id": "resp_1"}))
    assert caught.value.param == "previous_response_id"
    serving = sr.OpenAIServingResponses(chat=None, store=ResponseStore())
    with pytest.raises(sr.PreviousResponseNotFound):
        serving.previous(ResponsesRequest.model_validate({"input": "x", "previous_response_id": "resp_1"}))
    serving.store.put("resp_1", {}, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], 10)
    req = ResponsesRequest.model_validate({"input": "c", "previous_response_id": "resp_1", "instructions": "i"})
    assert [m["content"] for m in sr.chat_fields(req, sr.conversation_of(req, serving.previous(req)))["messages"]] \
        == ["i", "a", "b", "c"]


def test_anthropic_error_shape():
    body = json.dumps({"error": {"message": "too big", "type": "request_too_large", "param": None, "code": 413}})
    assert json.loads(reshaped(413, body.encode())) == {
        "type": "error", "error": {"type": "request_too_large", "message": "too big"}}
    assert json.loads(reshaped(503, b"plain"))["error"] == {"type": "overloaded_error", "message": "plain"}
    assert json.loads(reshaped(500, b"{}"))["error"]["type"] == "api_error"



@pytest.mark.parametrize("model, body", [
    (ResponsesRequest, {"input": "x", "previous_response_id": "r" * 129}),  # at most 128 characters
    (ResponsesRequest, {"input": "x", "max_output_tokens": 0}),
    (MessagesRequest, {"model": "m", "max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}),
    (MessagesRequest, {"model": "m", "max_tokens": 1, "messages": []}),
    (MessagesRequest, {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                       "tools": [{"name": "f" * 65, "input_schema": {}}]}),  # tool names: at most 64 characters
])
def test_request_fields_past_their_bounds_are_refused(model, body):
    with pytest.raises(ValidationError):
        model.model_validate(body)


def test_request_fields_at_their_bounds_are_taken():
    ResponsesRequest.model_validate({"input": "x", "previous_response_id": "r" * 128, "max_output_tokens": 1})
    MessagesRequest.model_validate({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
                                    "tools": [{"name": "f" * 64, "input_schema": {}}]})
