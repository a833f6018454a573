"""vLLM's render endpoints on a real server (the demo model): exactly the engine's token ids, the real
endpoints' errors, and a generation from the rendered ids equal to one from the text."""

import httpx
import pytest

from kvgate.common.demo import ensure_demo_model
from kvgate.common.tokenizer_files import load_tokenizer

pytestmark = pytest.mark.processes

# The fields of vLLM's GenerateRequest (vllm/entrypoints/scale_out/token_in_token_out/protocol.py).
GENERATE_REQUEST_FIELDS = {"request_id", "token_ids", "assistant_tokens_mask", "token_offsets", "features",
                           "sampling_params", "model", "stream", "stream_options", "cache_salt", "priority",
                           "kv_transfer_params"}
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Héllo, wörld!"},
            {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "And again?"}]


@pytest.fixture(scope="module")
def tokenizer(demo_server, kvgate_cache):
    return load_tokenizer(ensure_demo_model(kvgate_cache / "models"))  # the folder the server built and loaded


def template_ids(tokenizer, messages, add_generation_prompt) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in newer transformers


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=30)


def test_completions_render_gives_the_engines_token_ids(demo_server, tokenizer):
    texts = ["The quick brown fox", "Ünïcode ✓ and <|user|> special text"]
    r = post(demo_server, "/v1/completions/render", {"model": "demo", "prompt": texts, "max_tokens": 7,
                                                     "temperature": 0.5, "cache_salt": "s", "priority": 2})
    assert r.status_code == 200, r.text
    rendered = r.json()
    assert isinstance(rendered, list) and len(rendered) == 2
    for item, text in zip(rendered, texts):
        assert set(item) == GENERATE_REQUEST_FIELDS
        assert item["token_ids"] == tokenizer.encode(text)
        assert item["request_id"].startswith("cmpl-")
        assert item["model"] == "demo" and item["cache_salt"] == "s" and item["priority"] == 2
        assert item["stream"] is False and item["stream_options"] is None
        sp = item["sampling_params"]
        assert sp["max_tokens"] == 7 and sp["temperature"] == 0.5 and "eos_token_ids" not in sp
    assert rendered[0]["request_id"] != rendered[1]["request_id"]

    # one string: still a list of one; token ids: passed through; max_tokens resolved as the engine does
    one = post(demo_server, "/v1/completions/render", {"prompt": "abc", "stream": True,
                                                       "stream_options": {"include_usage": True}}).json()
    assert len(one) == 1 and one[0]["token_ids"] == tokenizer.encode("abc")
    assert one[0]["sampling_params"]["max_tokens"] == 1024 - len(one[0]["token_ids"])  # --max-model-len 1024
    assert one[0]["stream"] is True and one[0]["stream_options"] == {"include_usage": True}
    ids = post(demo_server, "/v1/completions/render", {"prompt": [5, 6, 7]}).json()
    assert ids[0]["token_ids"] == [5, 6, 7]


def test_chat_render_gives_the_templates_token_ids(demo_server, tokenizer):
    r = post(demo_server, "/v1/chat/completions/render", {"model": "demo", "messages": MESSAGES,
                                                          "max_completion_tokens": 5})
    assert r.status_code == 200, r.text
    item = r.json()
    assert set(item) == GENERATE_REQUEST_FIELDS
    assert item["token_ids"] == template_ids(tokenizer, MESSAGES, True)
    assert item["request_id"].startswith("chatcmpl-") and item["sampling_params"]["max_tokens"] == 5
    # the same as /tokenize answers for the conversation
    tokens = post(demo_server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert tokens == item["token_ids"]
    no_gen = post(demo_server, "/v1/chat/completions/render", {"messages": MESSAGES[:2],
                                                               "add_generation_prompt": False}).json()
    assert no_gen["token_ids"] == template_ids(tokenizer, MESSAGES[:2], False)


RENDER_ERRORS = [
    ("/v1/completions/render", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/v1/chat/completions/render", {"model": "other", "messages": MESSAGES}, 404, "model"),
    ("/v1/completions/render", b'{"prompt": "x", ', 400, None),  # malformed JSON
    ("/v1/completions/render", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions/render", {"prompt": []}, 400, "prompt"),
    ("/v1/completions/render", {"prompt": [10**6]}, 400, "prompt"),  # outside the vocabulary
    ("/v1/completions/render", {"prompt": "x" * 2000}, 400, "prompt"),  # past --max-model-len 1024
    ("/v1/completions/render", {"prompt": "x", "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/completions/render", {"prompt": "x", "n": 1000}, 400, "n"),
    ("/v1/completions/render", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("/v1/completions/render", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("/v1/completions/render", {"prompt": ["x"] * 300}, 400, "prompt"),  # --max-prompts-per-request
    ("/v1/chat/completions/render", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions/render", {"messages": MESSAGES, "chat_template": "{{ messages }}"}, 400,
     "chat_template"),
    ("/v1/chat/completions/render", {"messages": MESSAGES, "chat_template_kwargs": {"chat_template": "x"}}, 400,
     "chat_template"),
    ("/v1/chat/completions/render", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": False}}, 400,
     "chat_template_kwargs"),
    ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages"),
]


@pytest.mark.parametrize("path,body,status,param", RENDER_ERRORS)
def test_render_errors_are_openai_shaped(demo_server, path, body, status, param):
    if isinstance(body, bytes):
        r = httpx.post(demo_server.url + path, content=body, headers={"content-type": "application/json"})
    else:
        r = post(demo_server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"] and error["type"] in (
        "invalid_request_error", "not_found_error")
    if param is not None:
        assert error["param"] == param, error


def test_generating_from_rendered_ids_equals_generating_from_text(demo_server):
    kw = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    text = "Once upon a time"
    ids = post(demo_server, "/v1/completions/render", {"prompt": text, **kw}).json()[0]["token_ids"]
    from_text = post(demo_server, "/v1/completions", {"prompt": text, **kw}).json()
    from_ids = post(demo_server, "/v1/completions", {"prompt": ids, **kw}).json()
    assert from_ids["choices"][0]["text"] == from_text["choices"][0]["text"]
    assert from_ids["usage"]["prompt_tokens"] == from_text["usage"]["prompt_tokens"] == len(ids)

    chat_ids = post(demo_server, "/v1/chat/completions/render", {"messages": MESSAGES, **kw}).json()["token_ids"]
    chat = post(demo_server, "/v1/chat/completions", {"messages": MESSAGES, **kw}).json()
    from_chat_ids = post(demo_server, "/v1/completions", {"prompt": chat_ids, **kw}).json()
    assert from_chat_ids["choices"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert chat["usage"]["prompt_tokens"] == len(chat_ids)


def test_render_admits_nothing(demo_server):
    """Rendering queues no engine request and counts no prompt tokens (it is not a generation)."""
    from tests.procs import scrape

    before = scrape(demo_server.url)
    for _ in range(3):
        assert post(demo_server, "/v1/completions/render", {"prompt": "abc " * 50}).status_code == 200
    after = scrape(demo_server.url)
    assert after["vllm:prompt_tokens_total"] == before["vllm:prompt_tokens_total"]
    assert after["kvgate:num_prefill_tokens_pending"] == 0
