"""API keys on a real `kvgate serve` (vLLM's `--api-key` / VLLM_API_KEY): the official openai client with a right key
is served and with a wrong or missing one gets AuthenticationError; probes and the scrape need no key; every other
path, unknown ones included, is refused before its body is read; keys never reach the log."""

import os
import socket
import subprocess
import time

import httpx
import openai
import pytest

from tests.procs import KVGATE, KvgateServe

pytestmark = pytest.mark.processes

KEYS = ("k1-9f3a7c2e5b", "k2-4d8e1f6a0c")
WRONG = "wrong-7e2b9d4c1a"
ENV_KEY = "env-key-3c5e7a9b1d"
BODY_LIMIT = 1 << 16


@pytest.fixture(scope="module")
def server(kvgate_cache):
    with KvgateServe("sim", "--backend", "sim", "--api-key", *KEYS, "--max-request-body-bytes", str(BODY_LIMIT),
                     "--uvicorn-log-level", "debug", cache_dir=kvgate_cache, env={"VLLM_API_KEY": ENV_KEY}) as s:
        yield s


def _client(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0, timeout=30)


def _assert_401(r: httpx.Response, says: str, challenge: str = "Bearer") -> None:
    assert r.status_code == 401, (r.status_code, r.text)
    assert r.headers["www-authenticate"] == challenge and r.headers["connection"] == "close"
    err = r.json()["error"]  # the server's error shape (protocol.error_body), OpenAI's type for a bad key
    assert set(err) == {"message", "type", "param", "code"} and (err["type"], err["param"], err["code"]) == (
        "invalid_request_error", None, 401) and says in err["message"], err


@pytest.mark.parametrize("key", KEYS)
def test_each_key_is_served_through_the_openai_client(server, key):
    client = _client(server, key)
    assert [m.id for m in client.models.list().data] == ["sim"]
    r = client.completions.create(model="sim", prompt="Hello there", max_tokens=4)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    chat = client.chat.completions.create(model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          stream=True)
    assert sum(1 for c in chat if c.choices and c.choices[0].delta.content) == 3


@pytest.mark.parametrize("key", [WRONG, ENV_KEY, KEYS[0] + "x", KEYS[0][:-1], KEYS[0].upper(), KEYS[0] + " x"])
def test_a_wrong_key_is_an_authentication_error(server, key):
    """ENV_KEY too: the flag wins over VLLM_API_KEY."""
    with pytest.raises(openai.AuthenticationError) as caught:
        _client(server, key).completions.create(model="sim", prompt="x", max_tokens=1)
    err = caught.value
    assert err.status_code == 401 and err.body["type"] == "invalid_request_error" and err.body["code"] == 401
    _assert_401(err.response, "Invalid API key.", 'Bearer error="invalid_token"')
    assert key.strip() not in err.response.text  # never echoed


@pytest.mark.parametrize("headers, says", [
    ({}, "No API key"),
    ({"Authorization": ""}, "not a Bearer token"),
    ({"Authorization": f"Basic {KEYS[0]}"}, "not a Bearer token"),
    ({"Authorization": KEYS[0]}, "not a Bearer token"),
])
def test_a_missing_key_is_a_401_saying_how_to_send_one(server, headers, says):
    _assert_401(httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers,
                           timeout=10), says)
    with pytest.raises(openai.AuthenticationError):
        _client(server, KEYS[0]).with_options(default_headers={"Authorization": headers.get("Authorization", "")}) \
            .models.list()


def test_the_scheme_is_case_insensitive_and_the_first_header_counts(server):
    for value in (f"bearer {KEYS[1]}", f"BEARER  {KEYS[1]}"):
        assert httpx.get(server.url + "/v1/models", headers={"Authorization": value}, timeout=10).status_code == 200
    twice = [("authorization", f"Bearer {WRONG}"), ("authorization", f"Bearer {KEYS[0]}")]
    _assert_401(httpx.get(server.url + "/v1/models", headers=twice, timeout=10), "Invalid",
                'Bearer error="invalid_token"')


def test_probes_and_the_scrape_need_no_key(server):
    for path in ("/health", "/live", "/metrics", "/metrics?name[]=vllm:num_requests_running&name[]=x"):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 200, (path, r.status_code)
    assert "vllm:num_requests_running" in httpx.get(server.url + "/metrics", timeout=10).text
    assert httpx.head(server.url + "/metrics", timeout=10).status_code == 200


@pytest.mark.parametrize("method, path", [
    ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/tokenize"), ("POST", "/detokenize"),
    ("POST", "/v1/completions/render"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/nowhere"),
    ("GET", "/health/"), ("GET", "//health"), ("GET", "/Health"), ("GET", "/metrics/x"), ("POST", "/health"),
    ("POST", "/metrics"), ("DELETE", "/live"), ("POST", "/v1/load_lora_adapter"),
])
def test_everything_else_is_guarded_unknown_paths_included(server, method, path):
    """Fail closed: a 401 before the 404 or 405, and only GET/HEAD of the probes' and the scrape's paths are public."""
    _assert_401(httpx.request(method, server.url + path, timeout=10), "No API key")
    if path == "/nowhere":  # with a key, the route table answers
        r = httpx.get(server.url + path, headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=10)
        assert r.status_code == 404


def test_options_passes_as_a_cors_preflight(server):
    r = httpx.options(server.url + "/v1/completions", headers={"Origin": "https://example.com",
                                                               "Access-Control-Request-Method": "POST"}, timeout=10)
    assert r.status_code == 405  # no CORS layer here: past the key check, the route answers


def _raw_head(server, head: bytes, first: bytes) -> tuple[bytes, float]:
    """Send a request head announcing a body far over the limit and only the `first` bytes of it: the answer, and
    how long it took. Read until the server closes, so only a server that answers without the body returns."""
    start = time.monotonic()
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + head
                     + b"\r\n" + first)
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    return data, time.monotonic() - start


def test_a_large_body_without_a_key_is_refused_before_it_is_read(server):
    """The 401 comes before the body limit's 413 and without waiting for the body: the server reads none of it."""
    declared = b"Content-Length: %d\r\n" % (100 * BODY_LIMIT)
    data, took = _raw_head(server, declared, b'{"prompt": "')
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401 ") and b"connection: close" in head.lower() and b"No API key" in body
    assert took < 5
    data, _ = _raw_head(server, b"Transfer-Encoding: chunked\r\n", b"ffffff\r\n" + b'{"prompt": "')
    assert data.startswith(b"HTTP/1.1 401 "), data[:200]
    # with a key, the same head meets the body limit: so the 401 above was not the limit's doing
    data, _ = _raw_head(server, declared + f"Authorization: Bearer {KEYS[1]}\r\n".encode(), b"")
    assert data.startswith(b"HTTP/1.1 413 "), data[:200]
    big = {"prompt": "a" * (4 * BODY_LIMIT)}
    _assert_401(httpx.post(server.url + "/v1/completions", json=big, timeout=10), "No API key")


def test_keys_never_reach_the_log(server):
    """After every test above (module order), at uvicorn's debug level: no key, right or wrong, in the log."""
    httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {WRONG}"}, timeout=10)
    log = server.log_path.read_text(errors="replace")
    for secret in (*KEYS, WRONG, ENV_KEY):
        assert secret not in log


def test_vllm_api_key_from_the_environment(kvgate_cache):
    """VLLM_API_KEY alone (as a Kubernetes Secret sets it) is the one key; an empty one is unset (vLLM's rule)."""
    from kvgate.engine.server.auth import resolve_api_keys

    with KvgateServe("sim", "--backend", "sim", cache_dir=kvgate_cache, env={"VLLM_API_KEY": ENV_KEY}) as keyed:
        r = _client(keyed, ENV_KEY).completions.create(model="sim", prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens == 2
        with pytest.raises(openai.AuthenticationError):
            _client(keyed, KEYS[0]).models.list()
        assert httpx.get(keyed.url + "/metrics", timeout=10).status_code == 200
    assert resolve_api_keys(None, {"VLLM_API_KEY": ""}) == [] == resolve_api_keys(None, {})
    assert resolve_api_keys(list(KEYS), {"VLLM_API_KEY": ENV_KEY}) == list(KEYS)


def test_an_empty_api_key_flag_exits_2_with_one_line():
    """At once (no model is loaded), naming the flag; as the user runs it."""
    r = subprocess.run([KVGATE, "serve", "sim", "--backend", "sim", "--api-key", ""], capture_output=True, text=True,
                       timeout=60, env={**os.environ, "VLLM_API_KEY": ENV_KEY})
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr == "kvgate serve: error: --api-key: the key is empty (an unset shell variable?): give a key, or " \
                       "leave --api-key out\n", r.stderr


@pytest.mark.parametrize("args, env, says", [
    (["--api-key", KEYS[0], ""], {}, "kvgate serve: error: --api-key: key 2 of 2 is empty"),
    (["--api-key", KEYS[0] + "\n"], {}, "kvgate serve: error: --api-key: the key starts or ends with whitespace"),
    ([], {"VLLM_API_KEY": KEYS[0] + "\n"}, "kvgate serve: error: VLLM_API_KEY: the key starts or ends with"),
    ([], {"VLLM_API_KEY": "a\x01b"}, "kvgate serve: error: VLLM_API_KEY: the key holds a control character"),
    (["--require-api-key"], {"VLLM_API_KEY": ""}, "kvgate serve: error: --require-api-key: no key given"),
])
def test_a_key_that_cannot_work_is_a_start_error(args, env, says, monkeypatch, capsys):
    """The same start (kvgate's own main), in this process: exit 2, one line naming the source, never the key."""
    from kvgate.cli import main

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "sim", "--backend", "sim", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith(says) and len(err.strip().splitlines()) == 1 and KEYS[0] not in err, err
