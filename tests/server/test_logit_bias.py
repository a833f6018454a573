"""logit_bias through the official openai client on `kvgate serve demo`: a token's bias is added to its logit before
sampling (vLLM's rule), on completions and chat; bad maps are 400s naming logit_bias; other requests are untouched."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

pytestmark = pytest.mark.processes

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(demo_server):
    return openai.OpenAI(base_url=demo_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def token_id(server, text: str) -> int:
    """The first token of `text` (the demo's vocabulary is byte-level: one token per byte)."""
    r = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30)
    return r.json()["tokens"][0]


@pytest.fixture(scope="module")
def z_token(demo_server) -> int:
    """The id of "Z" (a token the random demo model does not pick greedily after PROMPT)."""
    return token_id(demo_server, "Z")


def greedy(client, **kw) -> str:
    return client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=0,
                                     extra_body={"ignore_eos": True}, **kw).choices[0].text


def test_a_large_bias_makes_greedy_output_that_token(client, demo_server, z_token):
    plain = greedy(client)
    assert "Z" not in plain  # so the bias, not the model, writes the Zs below
    assert greedy(client, logit_bias={str(z_token): 100}) == "Z" * 6
    chat = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                          temperature=0, logit_bias={str(z_token): 100},
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == "Z" * 5
    # a sampled request follows the bias too
    sampled = client.completions.create(model="demo", prompt=PROMPT, max_tokens=6, temperature=1.0, seed=7,
                                        logit_bias={str(z_token): 100}, extra_body={"ignore_eos": True})
    assert sampled.choices[0].text == "Z" * 6
    # and a -100 bias on the greedy first token (a byte of the demo's byte-level vocabulary) bans it
    banned = greedy(client, logit_bias={str(token_id(demo_server, plain[0])): -100})
    assert banned[0] != plain[0], (plain, banned)


def test_requests_without_a_bias_are_untouched_beside_one_with_it(client, z_token):
    alone = greedy(client)
    with ThreadPoolExecutor(6) as pool:  # biased and plain requests in the same batches
        biased = [pool.submit(greedy, client, logit_bias={str(z_token): 100}) for _ in range(3)]
        plain = [pool.submit(greedy, client) for _ in range(3)]
        assert [f.result() for f in biased] == ["Z" * 6] * 3
        assert [f.result() for f in plain] == [alone] * 3


@pytest.mark.parametrize("bias, says", [
    ({"1000000": 5}, "outside the vocabulary"),
    ({"-1": 5}, "token ids"),
    ({"abc": 5}, "token ids"),
    ({"65": 100.5}, "[-100, 100]"),
    ({"65": -101}, "[-100, 100]"),
    ({str(i): 1 for i in range(1025)}, "--max-logit-bias"),
])
@pytest.mark.parametrize("api", ["completions", "chat"])
def test_bad_maps_are_400s_naming_logit_bias(client, api, bias, says):
    with pytest.raises(openai.BadRequestError) as info:
        if api == "completions":
            client.completions.create(model="demo", prompt=PROMPT, max_tokens=2, logit_bias=bias)
        else:
            client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           logit_bias=bias)
    error = info.value.response.json()["error"]
    assert error["param"] == "logit_bias" and error["code"] == 400 and says in error["message"], error


def test_non_finite_biases_are_refused(demo_server):
    r = httpx.post(demo_server.url + "/v1/completions", content='{"prompt": "x", "logit_bias": {"65": Infinity}}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text
