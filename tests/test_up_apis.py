"""The Responses API and the Anthropic Messages API through `kvgate up` (two sim engines, the EPP, Envoy) with the
official `openai` and `anthropic` clients: text, streaming, tool calls, system prompts; prefix routing of both
(requests sharing a long system prompt land on one replica, the same one as a chat request with that prompt);
and each API's limits and errors in its own shape, from the EPP and from the engines. One stack for the module."""


import anthropic
import httpx
import openai
import pytest

from tests.procs import free_port, stop_group
from tests.test_up import read_until_up, start_up

pytestmark = pytest.mark.processes

KEY = "apis-key-5e1c9a"
BODY_LIMIT = 1 << 16
MAX_STOPS = 4
MAX_MODEL_LEN = 1024
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
           "additionalProperties": False}
# the model is made to write a hermes call (a random model never decides to call a tool by itself): what is tested
# is the server's reading of it (--enable-auto-tool-choice --tool-call-parser hermes)
WRITES_A_CALL = {"structured_outputs": {"regex": r'Checking\.<tool_call>\n\{"name": "get_weather", "arguments": '
                                                 r'\{"city": "(Paris|Rome)"\}\}\n</tool_call>'}}


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("up-apis")
    port = free_port()
    engine_args = ["--enable-auto-tool-choice", "--tool-call-parser=hermes", f"--api-key={KEY}",
                   f"--max-model-len={MAX_MODEL_LEN}", f"--max-request-body-bytes={BODY_LIMIT}",
                   f"--max-stop-sequences={MAX_STOPS}"]
    proc = start_up(tmp, port, "--backend", "sim", *(f"--engine-arg={a}" for a in engine_args))
    try:
        output = read_until_up(proc, 120)
        assert "Ctrl-C stops everything" in output, output
        yield f"http://127.0.0.1:{port}"
    finally:
        stop_group(proc, timeout=60)


@pytest.fixture(scope="module")
def oai(gateway):
    return openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(gateway):
    return anthropic.Anthropic(base_url=gateway, api_key=KEY, max_retries=0, timeout=60)  # sends x-api-key


def test_responses_text_and_stream(oai):
    r = oai.responses.create(model="demo", instructions="Answer briefly.", input="hello", max_output_tokens=6)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert len(r.output_text) > 0 and r.usage.output_tokens == 6 and r.usage.input_tokens > len("hello")
    events = list(oai.responses.create(model="demo", input=[{"role": "user", "content": "hello"}],
                                       max_output_tokens=6, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and events[-1].response.output_text == deltas and events[-1].response.usage.output_tokens == 6


def test_responses_tool_calls_and_their_follow_ups(oai, gateway):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    named = oai.responses.create(model="demo", input="weather?", tools=[tool], max_output_tokens=60,
                                 tool_choice={"type": "function", "name": "get_weather"})
    [call] = named.output
    assert named.status == "completed" and call.type == "function_call" and call.name == "get_weather"
    assert call.arguments in ('{"city": "Paris"}', '{"city": "Rome"}')
    raw = oai.responses.with_raw_response.create(model="demo", input="weather?", tools=[tool],
                                                 max_output_tokens=200, extra_body=WRITES_A_CALL)
    auto = raw.parse()
    assert [o.type for o in auto.output] == ["message", "function_call"] and auto.output[0].content[0].text == \
        "Checking."
    call = auto.output[1]
    # the whole conversation again, with the tool's output (store: false, as Codex-style clients send it)
    follow = oai.responses.create(model="demo", store=False, max_output_tokens=3, tools=[tool], tool_choice="none",
                                  input=[{"role": "user", "content": "weather?"},
                                         {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                          "arguments": call.arguments},
                                         {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert follow.status == "incomplete" and follow.store is False
    # previous_response_id continues the stored conversation: the EPP sends it to the replica that stored it
    # (previous-response-affinity-filter), each time
    for _ in range(4):
        raw_after = oai.responses.with_raw_response.create(
            model="demo", previous_response_id=auto.id, max_output_tokens=3, tools=[tool], tool_choice="none",
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
        after = raw_after.parse()
        assert raw_after.headers["x-kvgate-endpoint"] == raw.headers["x-kvgate-endpoint"]
        assert after.previous_response_id == auto.id and after.usage.input_tokens > auto.usage.input_tokens
    replica = openai.OpenAI(base_url=f"http://{raw.headers['x-kvgate-endpoint']}/v1", api_key=KEY, max_retries=0)
    assert replica.responses.retrieve(auto.id).output[1].call_id == call.call_id
    with pytest.raises(openai.NotFoundError):
        replica.responses.create(model="demo", previous_response_id="resp_" + "0" * 32, input="x",
                                 max_output_tokens=1)


def test_messages_text_system_prompt_and_stream(claude, oai):
    m = claude.messages.create(model="demo", max_tokens=6, system="Answer briefly.",
                               messages=[{"role": "user", "content": "hello"}])
    assert m.type == "message" and m.role == "assistant" and m.stop_reason == "max_tokens"
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    # the system prompt is the conversation's system message, as in chat: the same prompt, token for token
    chat = oai.chat.completions.create(model="demo", max_tokens=1, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "hello"}])
    no_system = claude.messages.create(model="demo", max_tokens=1, messages=[{"role": "user", "content": "hello"}])
    assert m.usage.input_tokens == chat.usage.prompt_tokens > no_system.usage.input_tokens + len("Answer briefly.")
    assert claude.messages.count_tokens(model="demo", system="Answer briefly.", messages=[
        {"role": "user", "content": "hello"}]).input_tokens == m.usage.input_tokens
    with claude.messages.stream(model="demo", max_tokens=6, system=[{"type": "text", "text": "Answer briefly."}],
                                messages=[{"role": "user", "content": "hello"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text and final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (m.usage.input_tokens, 6)
    # a stop sequence taken from what the model writes: stop_reason stop_sequence, naming it
    base = claude.messages.create(model="demo", max_tokens=30, messages=[{"role": "user", "content": "stop test"}],
                                  extra_body={"temperature": 0}).content[0].text
    stop = base[10:13]
    cut = claude.messages.create(model="demo", max_tokens=30, messages=[{"role": "user", "content": "stop test"}],
                                 stop_sequences=[stop], extra_body={"temperature": 0})
    assert (cut.stop_reason, cut.stop_sequence, cut.content[0].text) == ("stop_sequence", stop,
                                                                        base[:base.find(stop)])


def test_messages_tool_calls(claude):
    tools = [{"name": "get_weather", "description": "the weather", "input_schema": WEATHER}]
    ask = [{"role": "user", "content": "weather?"}]
    m = claude.messages.create(model="demo", max_tokens=60, messages=ask, tools=tools,
                               tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    assert m.content[0].name == "get_weather" and m.content[0].input["city"] in ("Paris", "Rome")
    with claude.messages.stream(model="demo", max_tokens=200, messages=ask, tools=tools,
                                extra_body=WRITES_A_CALL) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[0].text == "Checking." and final.content[1].input["city"] in ("Paris", "Rome")
    result = claude.messages.create(model="demo", max_tokens=3, tools=tools, messages=[
        *ask, {"role": "assistant", "content": final.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": final.content[1].id, "content": "sunny"}]}])
    assert result.stop_reason == "max_tokens" and result.usage.input_tokens > final.usage.input_tokens


def test_a_long_shared_system_prompt_routes_every_api_to_one_replica(oai, claude):
    """For each of three long system prompts, two Messages, two Responses and two chat requests (different user
    turns): all six land on one replica — the EPP reads them as one conversation prefix."""
    for k in range(3):
        system = f"You are assistant number {k}. " + "Follow these long shared instructions with care. " * 8
        replicas = []
        for i in range(2):
            replicas.append(claude.messages.with_raw_response.create(
                model="demo", max_tokens=2, system=system,
                messages=[{"role": "user", "content": f"question {i}"}]).headers["x-kvgate-endpoint"])
            replicas.append(oai.responses.with_raw_response.create(
                model="demo", max_output_tokens=2, instructions=system,
                input=f"request {i}").headers["x-kvgate-endpoint"])
            replicas.append(oai.chat.completions.with_raw_response.create(
                model="demo", max_tokens=2, messages=[{"role": "system", "content": system},
                                                      {"role": "user", "content": f"chat {i}"}]
            ).headers["x-kvgate-endpoint"])
        assert len(set(replicas)) == 1, (k, replicas)


def _anthropic_error(r: httpx.Response, status: int, kind: str, says: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind and says in body["error"]["message"], body


def _openai_error(r: httpx.Response, status: int, says: str, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert says in error["message"] and (param is None or error["param"] == param), error


def test_errors_and_limits_in_each_apis_shape(gateway):
    auth = {"x-api-key": KEY}
    post = lambda path, body, headers=auth: httpx.post(gateway + path, json=body, headers=headers, timeout=60)  # noqa: E731
    one = [{"role": "user", "content": "x"}]
    # refused by the EPP (malformed for routing), each in its API's shape
    _anthropic_error(post("/v1/messages", {"model": "demo", "max_tokens": 2, "messages": "x"}), 400,
                     "invalid_request_error", "'messages'")
    _openai_error(post("/v1/responses", {"model": "demo", "input": 5}), 400, "'input'")
    # refused by the engine
    _anthropic_error(post("/v1/messages", {"model": "demo", "max_tokens": 2, "messages": one}, {}), 401,
                     "authentication_error", "x-api-key")
    _anthropic_error(post("/v1/messages", {"model": "demo", "max_tokens": 2, "messages": one},
                          {"x-api-key": KEY + "x"}), 401, "authentication_error", "Invalid API key")
    _anthropic_error(post("/v1/messages", {"model": "demo", "messages": one}), 400, "invalid_request_error",
                     "max_tokens")
    _anthropic_error(post("/v1/messages", {"model": "nope", "max_tokens": 2, "messages": one}), 404,
                     "not_found_error", "nope")
    # the limits: prompt length, max tokens, stop sequences, body size; at the limit served, past it refused
    long = "y" * MAX_MODEL_LEN
    _anthropic_error(post("/v1/messages", {"model": "demo", "max_tokens": 2,
                                           "messages": [{"role": "user", "content": long}]}),
                     400, "invalid_request_error", f"maximum context length is {MAX_MODEL_LEN} tokens")
    _openai_error(post("/v1/responses", {"model": "demo", "input": long}), 400,
                  f"maximum context length is {MAX_MODEL_LEN} tokens", "input")
    prompt_tokens = post("/v1/messages", {"model": "demo", "max_tokens": 1, "messages": one}).json()["usage"][
        "input_tokens"]
    room = MAX_MODEL_LEN - prompt_tokens
    assert post("/v1/messages", {"model": "demo", "max_tokens": room, "messages": one,
                                 "stop_sequences": ["x"] * MAX_STOPS}).status_code == 200
    _anthropic_error(post("/v1/messages", {"model": "demo", "max_tokens": room + 1, "messages": one}), 400,
                     "invalid_request_error", "maximum context length")
    responses_room = MAX_MODEL_LEN - post("/v1/responses", {"model": "demo", "input": "x", "max_output_tokens": 1}
                                          ).json()["usage"]["input_tokens"]
    assert post("/v1/responses", {"model": "demo", "input": "x", "max_output_tokens": responses_room,
                                  "store": False}).status_code == 200
    _openai_error(post("/v1/responses", {"model": "demo", "input": "x", "max_output_tokens": responses_room + 1}),
                  400, "maximum context length", "max_output_tokens")
    _anthropic_error(post("/v1/messages", {"model": "demo", "max_tokens": 2, "messages": one,
                                           "stop_sequences": ["x"] * (MAX_STOPS + 1)}),
                     400, "invalid_request_error", f"at most {MAX_STOPS} stop sequences")
    pad = "z" * BODY_LIMIT
    _anthropic_error(post("/v1/messages", {"model": "demo", "max_tokens": 2, "messages": one, "metadata": pad}),
                     413, "request_too_large", str(BODY_LIMIT))
    _openai_error(post("/v1/responses", {"model": "demo", "input": "x", "metadata": pad}, {
        "authorization": f"Bearer {KEY}"}), 413, str(BODY_LIMIT))
