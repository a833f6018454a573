"""The EPP's reading of Responses (/v1/responses) and Anthropic Messages (/v1/messages) bodies: the same prompt
as the chat request with the same conversation (so they share prefix hashes and precise-prefix tokens), malformed
bodies refused in each API's error shape, their usage and first tokens found in their responses, and Anthropic's
x-api-key kept out of the EPP's view."""

import json

import pytest

from kvgate.epp import extproc
from kvgate.epp.request_parsing import BadRequest, parse_request

SYSTEM = "You are a careful assistant. " * 20
CHAT = {"model": "m", "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]}
RESPONSES = {"model": "m", "instructions": SYSTEM, "input": "hi", "max_output_tokens": 9}
MESSAGES = {"model": "m", "system": [{"type": "text", "text": SYSTEM}], "max_tokens": 9,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}


def parse(path: str, body) -> object:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return parse_request("r1", raw, {":path": path})[0]


def test_responses_and_messages_bodies_are_read_as_the_same_conversation_as_chat():
    chat = parse("/v1/chat/completions", CHAT)
    for path, body in (("/v1/responses", RESPONSES), ("/v1/messages?beta=true", MESSAGES)):
        request = parse(path, body)
        assert request.prompt == chat.prompt and request.body == {"messages": CHAT["messages"]}
        assert request.max_tokens == 9


def test_claude_codes_attribution_block_and_system_messages_are_read_as_the_engine_reads_them():
    """The per-request billing block is left out and system-role messages join the system prompt (vLLM's rules),
    in the EPP and in the engine alike: the prefix stays shared."""
    from kvgate.engine.server.anthropic_protocol import MessagesRequest
    from kvgate.engine.server.serving_messages import conversation_of

    body = {"model": "m", "max_tokens": 9, "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=5f3e;"},
        {"type": "text", "text": SYSTEM[:40]}], "messages": [
        {"role": "system", "content": SYSTEM[40:]}, {"role": "user", "content": "hi"}]}
    assert parse("/v1/messages", body).prompt == parse("/v1/chat/completions", CHAT).prompt
    assert conversation_of(MessagesRequest.model_validate(body)) == CHAT["messages"]


def test_items_and_blocks_are_read_in_order():
    responses = parse("/v1/responses", {"input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "d"}]},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "42"}, {"type": "reasoning"}]})
    assert [m["role"] for m in responses.body["messages"]] == ["system", "assistant", "tool"]
    messages = parse("/v1/messages", {"messages": [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "42"}]}]})
    assert messages.body["messages"] == [{"role": "assistant", "content": '{"name":"f","arguments":{"a":1}}'},
                                         {"role": "tool", "content": "42"}]


def test_the_precise_scorer_tokenizes_them_as_the_chat():
    from kvgate.epp.kv_events.tokenize import PromptTokenizer

    tokenizer = PromptTokenizer()
    chat = tokenizer.tokens(parse("/v1/chat/completions", CHAT))
    assert chat and tokenizer.tokens(parse("/v1/messages", MESSAGES)) == chat
    assert tokenizer.tokens(parse("/v1/responses", RESPONSES)) == chat


@pytest.mark.parametrize("path, body, says", [
    ("/v1/responses", {"input": 3}, "'input'"),
    ("/v1/responses", {"input": ["x"]}, "input[0]"),
    ("/v1/responses", {"input": [{"role": "robot", "content": "x"}]}, "role"),
    ("/v1/responses", {"input": [{"type": "computer_call"}]}, "not supported"),
    ("/v1/responses", {"input": "x", "instructions": 5}, "'instructions'"),
    ("/v1/messages", {"messages": []}, "'messages'"),
    ("/v1/messages", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0]"),
    ("/v1/messages", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/messages", {"system": 5, "messages": [{"role": "user", "content": "x"}]}, "system"),
    ("/v1/messages", {"system": [{"type": "image"}], "messages": [{"role": "user", "content": "x"}]}, "system[0]"),
])
def test_malformed_bodies_are_bad_requests(path, body, says):
    with pytest.raises(BadRequest, match=".*".join(map(lambda c: "\\" + c if c in "[]()" else c, says))):
        parse(path, body)


def test_refusals_on_the_messages_path_are_in_anthropics_shape():
    anthropic = json.loads(extproc._immediate(400, "bad", anthropic=True).immediate_response.body)
    assert anthropic == {"type": "error", "error": {"type": "invalid_request_error", "message": "bad"}}
    assert json.loads(extproc._immediate(429, "busy", anthropic=True).immediate_response.body)["error"]["type"] \
        == "rate_limit_error"
    openai = json.loads(extproc._immediate(400, "bad").immediate_response.body)
    assert openai["error"]["type"] == "invalid_request_error" and openai["error"]["code"] == 400


def test_usage_and_first_tokens_of_their_responses():
    anthropic_stream = (b'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"end_turn"},'
                        b'"usage":{"input_tokens":12,"output_tokens":5}}\n\nevent: message_stop\ndata: '
                        b'{"type":"message_stop"}\n\n')
    assert extproc.find_usage(anthropic_stream) == (12, 5)
    responses_stream = (b'event: response.completed\ndata: {"type":"response.completed","response":{"usage":'
                        b'{"input_tokens":7,"output_tokens":3,"total_tokens":10}}}\n\n')
    assert extproc.find_usage(responses_stream) == (7, 3)
    assert extproc.find_usage(b'{"id":"msg_1","usage":{"input_tokens":4,"output_tokens":2}}') == (4, 2)
    assert extproc.has_token(b'data: {"type":"response.output_text.delta","delta":"He"}')
    assert extproc.has_token(b'data: {"type":"content_block_delta","delta":{"type":"text_delta","text":"He"}}')
    assert extproc.has_token(b'data: {"delta":{"type":"input_json_delta","partial_json":"{\\"a"}}')
    assert not extproc.has_token(b'data: {"type":"content_block_start","content_block":{"type":"text","text":""}}')
    assert not extproc.has_token(b'data: {"type":"response.created","response":{"text":{"format":{}}}}')


def test_an_anthropic_key_is_kept_out_of_the_epps_view():
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    headers = pb.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
        base_pb2.HeaderValue(key=k, raw_value=v) for k, v in (
            (":path", b"/v1/messages"), ("x-api-key", b"secret"), ("Authorization", b"Bearer secret"))]))
    assert extproc._headers(headers) == {":path": "/v1/messages"}


def test_a_continued_response_goes_to_the_endpoint_that_stored_it():
    from kvgate.common.response_ids import new_response_id, tag_of
    from kvgate.epp.scheduling.config import KVGATE_PROFILE_YAML, parse_config
    from kvgate.epp.scheduling.plugins import create_plugin
    from kvgate.epp.types import Endpoint, EndpointMetrics, EndpointState

    endpoints = [EndpointState(Endpoint(f"10.0.0.{i}:8000"), EndpointMetrics(), stale=False) for i in range(4)]
    stored_on = new_response_id("10.0.0.2:8000")
    assert tag_of(stored_on) and tag_of(stored_on) != tag_of(new_response_id("10.0.0.3:8000"))
    filt = create_plugin("previous-response-affinity-filter")
    assert filt.preference  # the others stay as fallbacks
    continued = parse("/v1/responses", {"input": "more", "previous_response_id": stored_on})
    assert [e.address for e in filt.filter(continued, endpoints)] == ["10.0.0.2:8000"]
    for other in ("resp_" + "0" * 40, "resp_abc", None):  # gone, or not an id of this scheme: every candidate
        body = {"input": "more", **({"previous_response_id": other} if other else {})}
        assert filt.filter(parse("/v1/responses", body), endpoints) == endpoints
    assert filt.filter(parse("/v1/responses", {"input": "x", "previous_response_id": new_response_id("elsewhere")}),
                       endpoints) == endpoints
    profile = parse_config(KVGATE_PROFILE_YAML)
    assert "previous-response-affinity-filter" in repr(profile.scheduler)
