"""Completions `echo` through the official openai client on `kvgate serve demo`: the prompt leads the text, and with
`logprobs` its tokens' logprobs lead the logprobs (the first token's null, as vLLM and OpenAI answer); `max_tokens: 0`
answers the prompt alone (what evaluation harnesses ask); streamed, the prompt leads each sample's first event."""

import math

import httpx
import openai
import pytest

pytestmark = pytest.mark.processes

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(demo_server):
    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def prompt_ids(demo_server) -> list[int]:
    r = httpx.post(demo_server.url + "/tokenize", json={"prompt": PROMPT}, timeout=30)
    return r.json()["tokens"]


def check_prompt_logprobs(logprobs, num_prompt: int, top: int) -> None:
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) >= num_prompt
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for lp, tops in zip(logprobs.token_logprobs[1:num_prompt], logprobs.top_logprobs[1:num_prompt]):
        assert math.isfinite(lp) and lp <= 0
        assert 1 <= len(tops) <= top + 1 and max(tops.values()) >= lp  # its own token and the top `top`
    offsets = logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets)


def test_echo_with_max_tokens_0_answers_the_prompt_and_its_logprobs(client, prompt_ids):
    out = client.completions.create(model="demo", prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert len(choice.logprobs.tokens) == len(prompt_ids)
    check_prompt_logprobs(choice.logprobs, len(prompt_ids), 1)
    assert out.usage.prompt_tokens == len(prompt_ids) and out.usage.completion_tokens == 0


def test_echo_leads_a_generation_whose_own_part_is_unchanged(client, prompt_ids):
    kw = dict(model="demo", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    plain = client.completions.create(**kw).choices[0]
    echoed = client.completions.create(echo=True, **kw).choices[0]
    assert echoed.text == PROMPT + plain.text
    check_prompt_logprobs(echoed.logprobs, len(prompt_ids), 2)
    assert echoed.logprobs.tokens[len(prompt_ids):] == plain.logprobs.tokens
    assert echoed.logprobs.token_logprobs[len(prompt_ids):] == pytest.approx(plain.logprobs.token_logprobs, abs=1e-5)
    no_logprobs = client.completions.create(echo=True, **{**kw, "logprobs": None}).choices[0]
    assert no_logprobs.text == echoed.text and no_logprobs.logprobs is None


def test_echo_streams_the_prompt_first_then_the_generation(client, prompt_ids):
    kw = dict(model="demo", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=1, echo=True,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    events = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    usage = events.pop().usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), 3)
    assert events[0].choices[0].text.startswith(PROMPT)
    assert len(events[0].choices[0].logprobs.tokens) > len(prompt_ids)  # the prompt's and the first token's
    assert "".join(e.choices[0].text for e in events) == whole.text
    streamed = [lp for e in events for lp in e.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-5)
    only_prompt = list(client.completions.create(stream=True, stream_options={"include_usage": True},
                                                 **{**kw, "max_tokens": 0}))
    assert only_prompt.pop().usage.completion_tokens == 0
    assert [e.choices[0].text for e in only_prompt] == [PROMPT]
    assert only_prompt[0].choices[0].finish_reason == "length"


def test_echo_of_token_id_prompts_decodes_them_in_prompt_order(client, prompt_ids):
    out = client.completions.create(model="demo", prompt=[prompt_ids, prompt_ids[:5]], max_tokens=0, echo=True,
                                    logprobs=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    texts = [c.text for c in out.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[0].endswith(PROMPT)
    assert [len(c.logprobs.tokens) for c in out.choices] == [len(prompt_ids)] * 2 + [5] * 2
    assert out.choices[0].logprobs.token_logprobs == out.choices[1].logprobs.token_logprobs


def test_bad_echo_requests_are_400s_naming_their_field(client):
    for kw, param in ((dict(max_tokens=0), "max_tokens"), (dict(echo=True, logprobs=21), "logprobs")):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="demo", prompt=PROMPT, **kw)
        assert info.value.body["param"] == param, info.value.body


def test_vllm_prompt_logprobs_field_without_echo(demo_server, client, prompt_ids):
    body = {"model": "demo", "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2}
    r = httpx.post(demo_server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["logprobs"] is None and not choice["text"].startswith(PROMPT)
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(prompt_ids) and entries[0] is None
    echoed = client.completions.create(model="demo", prompt=PROMPT, max_tokens=0, echo=True, logprobs=2).choices[0]
    for token, entry, lp in zip(prompt_ids[1:], entries[1:], echoed.logprobs.token_logprobs[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(lp, abs=1e-6)
        assert entry[str(token)]["rank"] >= 1 and len(entry) <= 3
