"""The official openai client against `kvgate serve demo`."""

import openai
import pytest

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def client(demo_server):
    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["demo"]


def test_completion_and_usage(client):
    r = client.completions.create(model="demo", prompt="Hello there", max_tokens=12, temperature=0)
    assert r.object == "text_completion" and len(r.choices) == 1
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.prompt_tokens == len("Hello there") and r.usage.completion_tokens == 12


def test_chat_completion(client):
    r = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage.completion_tokens == 8


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_streamed_text_equals_non_streamed_text(client, api):
    kw = dict(model="demo", max_tokens=24, temperature=0.9, seed=1234)
    if api == "completions":
        full = client.completions.create(prompt="Once upon a time", **kw).choices[0].text
        stream = client.completions.create(prompt="Once upon a time", stream=True, **kw)
        pieces = [c.choices[0].text for c in stream if c.choices]
    else:
        msgs = [{"role": "user", "content": "tell me a story"}]
        full = client.chat.completions.create(messages=msgs, **kw).choices[0].message.content
        stream = client.chat.completions.create(messages=msgs, stream=True, **kw)
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 1 and "".join(pieces) == full


def test_n_2_gives_two_different_seeded_samples(client):
    r = client.completions.create(model="demo", prompt="abc", max_tokens=16, n=2, temperature=1.0, seed=7)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].text != r.choices[1].text
    assert r.usage.completion_tokens == 32
    again = client.completions.create(model="demo", prompt="abc", max_tokens=16, n=2, temperature=1.0, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]


def test_stop_strings(client):
    base = client.completions.create(model="demo", prompt="stop test", max_tokens=30, temperature=0).choices[0].text
    stop = base[10:13]
    cut = base[: base.find(stop)]
    r = client.completions.create(model="demo", prompt="stop test", max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == cut
    streamed = client.completions.create(model="demo", prompt="stop test", max_tokens=30, temperature=0,
                                         stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == cut


def test_logprobs(client):
    r = client.completions.create(model="demo", prompt="log", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.token_logprobs) == 5 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(t) >= 3 for t in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text
    c = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


def test_stream_usage_and_token_ids_prompt(client):
    stream = client.completions.create(model="demo", prompt=[72, 105, 33], max_tokens=6, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[-1].usage.prompt_tokens == 3 and chunks[-1].usage.completion_tokens == 6
