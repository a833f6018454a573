"""Property-based fuzzing of OpenAI request bodies straight at a real `kvgate serve --backend sim` process.

Bodies are well-formed requests with fields of the wrong type, absurd numbers, unknown and duplicate keys,
huge and deeply nested JSON, invalid UTF-8 and truncations. Every answer must be a success or an OpenAI-shaped
4xx JSON error — never a 5xx, never a hang (each request has a 20 s bound), and the process stays up —
while good requests sent alongside all complete with their exact token counts.
"""

import json
import threading

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.procs import KvgateServe

pytestmark = pytest.mark.processes

MAX_EXAMPLES = 200  # ~20-40 s on 2 shared cores

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "n", "best_of", "stream", "stream_options", "stop", "stop_token_ids", "seed", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "include_stop_str_in_output",
          "skip_special_tokens", "cache_salt", "priority", "user", "logprobs", "top_logprobs", "echo",
          "add_generation_prompt", "chat_template", "chat_template_kwargs", "tokens", "add_special_tokens"]

ABSURD_NUMBERS = st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, -(2**63) - 1, 10**100, 1e308, -1e308, 1e-320,
                                  0.5, 1.5, 2.000001, -0.0])
scalars = st.one_of(st.none(), st.booleans(), ABSURD_NUMBERS, st.integers(), st.floats(),  # NaN, inf too
                    st.text(max_size=40))
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=10), inner, max_size=5)), max_leaves=20)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", ""]),
                                           "content": st.one_of(st.text(max_size=40), json_values)}), max_size=3)
field_values = {
    "prompt": st.one_of(st.text(max_size=60), st.lists(st.integers(-5, 300), max_size=8),
                        st.lists(st.text(max_size=10), max_size=4), json_values),
    "messages": st.one_of(messages, json_values),
    "max_tokens": st.one_of(st.integers(-3, 8), ABSURD_NUMBERS, json_values),  # small: successes stay fast
    "stream": st.one_of(st.booleans(), json_values),
}


def _field(name: str):
    return st.tuples(st.just(name), field_values.get(name, st.one_of(scalars, json_values)))


# Half the objects start from a valid request, so the later fields are checked past the first error.
valid_starts = st.sampled_from([[], [("prompt", "hi")], [("messages", [{"role": "user", "content": "hi"}])],
                                [("prompt", "hi"), ("messages", [{"role": "user", "content": "hi"}])]])
request_objects = st.builds(lambda start, rest: start + rest, valid_starts, st.lists(
    st.one_of(*[_field(f) for f in FIELDS], st.tuples(st.text(max_size=12), json_values)), max_size=6))


def _encode(pairs: list) -> bytes:
    """An object with these (possibly repeated) keys; max_tokens stays small when it is a valid number."""
    items = []
    for key, value in pairs:
        if key in ("max_tokens", "max_completion_tokens") and isinstance(value, int) and value > 8:
            value = 8
        items.append(json.dumps(key) + ": " + json.dumps(value))
    if not any(k in ("max_tokens", "max_completion_tokens") for k, _ in pairs):
        items.append('"max_tokens": 4')
    return ("{" + ", ".join(items) + "}").encode()


@st.composite
def bodies(draw) -> bytes:
    raw = _encode(draw(request_objects))
    mutation = draw(st.sampled_from(["none", "none", "truncate", "bad-utf8", "nest", "huge-number", "garbage",
                                     "top-level"]))
    if mutation == "truncate" and len(raw) > 1:
        raw = raw[:draw(st.integers(1, len(raw) - 1))]
    elif mutation == "bad-utf8":
        at = draw(st.integers(0, len(raw)))
        raw = raw[:at] + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80\x80"])) + raw[at:]
    elif mutation == "nest":
        depth = draw(st.sampled_from([100, 1000, 50000]))
        raw = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
    elif mutation == "huge-number":
        raw = b'{"prompt": "x", "n": ' + b"9" * draw(st.sampled_from([20, 400, 5000])) + b"}"
    elif mutation == "garbage":
        raw = draw(st.binary(max_size=200))
    elif mutation == "top-level":
        raw = json.dumps(draw(json_values)).encode()
    return raw


def _good_requests(url: str, stop: threading.Event, results: list) -> None:
    with httpx.Client(base_url=url, timeout=30) as client:
        while not stop.is_set():
            r = client.post("/v1/completions", json={"prompt": "good", "max_tokens": 5, "ignore_eos": True})
            results.append(r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5)


@pytest.fixture(scope="module")
def fuzz_server(kvgate_cache):
    with KvgateServe("sim", "--backend", "sim", "--sim-max-model-len", "2048", "--sim-step-overhead-ms", "0.5",
                     "--max-request-body-bytes", str(1 << 20), cache_dir=kvgate_cache) as server:
        yield server


def test_fuzzed_bodies_never_break_the_server(fuzz_server):
    url = fuzz_server.url
    seen = {"cases": 0, "statuses": {}}
    stop, good = threading.Event(), []
    background = [threading.Thread(target=_good_requests, args=(url, stop, good), daemon=True) for _ in range(2)]
    for t in background:
        t.start()
    client = httpx.Client(base_url=url, timeout=20)

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]),
           body=bodies())
    def check(path, body):
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        seen["cases"] += 1
        seen["statuses"][r.status_code] = seen["statuses"].get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, body[:300], r.status_code, r.text[:500])
        if r.status_code >= 400:
            err = r.json()["error"]
            assert err["code"] == r.status_code and isinstance(err["message"], str), r.text
        elif "text/event-stream" in r.headers.get("content-type", ""):
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
            for line in r.text.splitlines():
                if line.startswith("data: {") and '"error"' in line:
                    assert json.loads(line[6:])["error"]["code"] < 500, line
        assert fuzz_server.proc.poll() is None

    try:
        check()
    finally:
        stop.set()
        for t in background:
            t.join(30)
        client.close()
    print(f"\nfuzz: {seen['cases']} cases, statuses {dict(sorted(seen['statuses'].items()))}, "
          f"{len(good)} concurrent good requests")
    assert seen["cases"] >= MAX_EXAMPLES
    assert good and all(good), f"{good.count(False)} of {len(good)} good requests failed"
    assert httpx.get(url + "/health").status_code == 200
