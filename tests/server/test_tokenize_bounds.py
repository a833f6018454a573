"""/tokenize, /detokenize and the render endpoints answer at most max_model_len tokens (a 400 naming the field
beyond), build their answers off the event loop, and refuse token ids outside the vocabulary with a 400."""

import asyncio
import time

import httpx
import pytest

from tests.procs import KvgateServe
from tests.server.test_hostile_input import _assert_error

pytestmark = pytest.mark.processes

MAX_MODEL_LEN = 3 * 2**20  # large enough that a 2 MiB prompt is allowed: its 2M ids must not stall the loop


@pytest.fixture(scope="module")
def server(kvgate_cache):
    with KvgateServe("sim", "--backend", "sim", "--sim-max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory",
                     str(2**40), "--tokenize-timeout", "60", cache_dir=kvgate_cache) as s:
        yield s


def _health_while(server, path: str, body) -> tuple[httpx.Response, list[float]]:
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            big = asyncio.create_task(client.post(path, json=body))
            await asyncio.sleep(0.05)
            took = []
            while not big.done():
                start = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                took.append(time.monotonic() - start)
                await asyncio.sleep(0.02)
            return await big, sorted(took)

    return asyncio.run(main())


def test_a_large_tokenize_answer_is_built_off_the_event_loop(server):
    """2 MiB of prompt = 2M ids, 6 MB of JSON: serialized on the loop, /health waited 1.7 s for it (a kubelet's
    probe times out after 1 s); in the tokenizer pool, /health answers meanwhile within a few hundred milliseconds
    at worst on a loaded machine (the pool's thread shares the GIL)."""
    prompt = "a b " * (2**20 // 2)
    r, took = _health_while(server, "/tokenize", {"prompt": prompt})
    assert r.status_code == 200 and r.json()["count"] == len(prompt) == len(r.json()["tokens"])
    assert len(took) >= 5 and took[len(took) // 2] < 0.3 and took[-1] < 0.75, took


def test_over_max_model_len_is_a_400_naming_the_field(server):
    count = MAX_MODEL_LEN + 1
    _assert_error(httpx.post(server.url + "/tokenize", json={"prompt": "a" * count}, timeout=120), 400, "prompt",
                  f"the prompt is {count} tokens, more than this model's max_model_len ({MAX_MODEL_LEN})")
    chat = {"messages": [{"role": "user", "content": "a" * count}]}
    _assert_error(httpx.post(server.url + "/tokenize", json=chat, timeout=120), 400, "messages", "max_model_len")
    compact = ("{\"tokens\":[" + ",".join(["1"] * count) + "]}").encode()  # 6 MB: under the body limit
    r = httpx.post(server.url + "/detokenize", content=compact, headers={"content-type": "application/json"},
                   timeout=120)
    _assert_error(r, 400, "tokens", f"tokens has {count} tokens")


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [2**63]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/v1/completions", {"prompt": [2**63] * 40, "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [2**64]], "max_tokens": 1}, "prompt"),
    ("/v1/completions/render", {"prompt": [2**63] * 40}, "prompt"),
])
def test_token_ids_outside_the_vocabulary_are_a_400(server, path, body, param):
    _assert_error(httpx.post(server.url + path, json={"model": "sim", **body}, timeout=30), 400, param)


def test_small_answers_are_unchanged(server):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "héllo"}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert body == {"tokens": body["tokens"], "count": len(body["tokens"]), "max_model_len": MAX_MODEL_LEN}
    text = httpx.post(server.url + "/detokenize", json={"tokens": body["tokens"]}, timeout=30).json()["prompt"]
    assert text.endswith("héllo")
    rendered = httpx.post(server.url + "/v1/completions/render", json={"model": "sim", "prompt": "hi"}, timeout=30)
    assert rendered.status_code == 200 and rendered.json()[0]["token_ids"][-2:] == [104, 105]
