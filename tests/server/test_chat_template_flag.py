"""`kvgate serve --chat-template` and `--response-role` (vLLM's flags) as users see them: real servers with the demo
model (and a copy of it without a chat template of its own), the official openai client, /tokenize and the chat
render endpoint showing the server's template, and the start errors (status 2, one line, before any model is built
or loaded)."""

import json
import os
import subprocess

import httpx
import openai
import pytest

from kvgate.common.demo import ensure_demo_model
from kvgate.common.tokenizer_files import load_tokenizer
from kvgate.engine.server.chat_template import (MAX_TEMPLATE_BYTES, ChatTemplateError, load_server_template,
                                                template_kwargs)
from tests.procs import KVGATE, KvgateServe

# Each message behind a marker the model's own template never writes, so the rendering shows whose template ran.
SERVER_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\nSERVER-TPL {{ m['content'] }}<|end|>\n"
                   "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
# One line, as a flag value: the newline comes from a Jinja string escape, not from the shell.
INLINE_TEMPLATE = ("{% for m in messages %}INLINE-TPL[{{ m['role'] }}]{{ m['content'] }}{{ '\\n' }}{% endfor %}"
                   "{% if add_generation_prompt %}INLINE-TPL[reply]{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo?"}]


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=60)


def ids_of(rendered) -> list[int]:
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)  # a BatchEncoding in newer HF


def detokenize(server, ids: list[int]) -> str:
    r = post(server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


@pytest.fixture(scope="module")
def demo_folder(kvgate_cache):
    return ensure_demo_model(kvgate_cache / "models")


@pytest.fixture(scope="module")
def tokenizer(demo_folder):
    return load_tokenizer(demo_folder)


@pytest.fixture(scope="module")
def bare_folder(demo_folder, tmp_path_factory):
    """The demo model without a chat template (its weights linked, not copied)."""
    folder = tmp_path_factory.mktemp("no-template-model")
    for name in ("config.json", "tokenizer.json"):
        (folder / name).write_bytes((demo_folder / name).read_bytes())
    (folder / "model.safetensors").symlink_to(demo_folder / "model.safetensors")
    config = json.loads((demo_folder / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert not load_tokenizer(folder).chat_template
    return folder


@pytest.fixture(scope="module")
def tpl_server(kvgate_cache, tmp_path_factory):
    path = tmp_path_factory.mktemp("templates") / "server.jinja"
    path.write_text(SERVER_TEMPLATE)
    with KvgateServe("demo", "--max-model-len", "1024", "--engine-loop", "thread", "--chat-template", str(path),
                     "--response-role", "narrator", cache_dir=kvgate_cache) as server:
        yield server


@pytest.fixture(scope="module")
def bare_server(kvgate_cache, bare_folder):
    with KvgateServe(str(bare_folder), "--max-model-len", "1024", "--engine-loop", "thread", "--served-model-name",
                     "bare", "--chat-template", INLINE_TEMPLATE, "--trust-request-chat-template",
                     cache_dir=kvgate_cache) as server:
        yield server


def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


# -- a template file, and --response-role ------------------------------------------------------------------------

@pytest.mark.processes
def test_openai_chat_is_rendered_by_the_server_template_and_names_the_response_role(tpl_server, tokenizer):
    expected = ids_of(tokenizer.apply_chat_template(MESSAGES, chat_template=SERVER_TEMPLATE, tokenize=True,
                                                    add_generation_prompt=True))
    own = ids_of(tokenizer.apply_chat_template(MESSAGES, tokenize=True, add_generation_prompt=True))
    assert expected != own
    r = client(tpl_server).chat.completions.create(model="demo", messages=MESSAGES, max_tokens=6, temperature=0)
    assert r.choices[0].message.role == "narrator" and r.choices[0].message.content
    assert r.usage.prompt_tokens == len(expected) and r.usage.completion_tokens == 6


@pytest.mark.processes
def test_tokenize_and_render_show_the_server_template(tpl_server, tokenizer):
    expected = ids_of(tokenizer.apply_chat_template(MESSAGES, chat_template=SERVER_TEMPLATE, tokenize=True,
                                                    add_generation_prompt=True))
    tokens = post(tpl_server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    rendered = post(tpl_server, "/v1/chat/completions/render", {"messages": MESSAGES}).json()["token_ids"]
    assert tokens == rendered == expected
    text = detokenize(tpl_server, tokens)
    assert text == "<s><|system|>\nSERVER-TPL Be brief.<|end|>\n<|user|>\nSERVER-TPL Héllo?<|end|>\n<|assistant|>\n"
    no_gen = post(tpl_server, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()["tokens"]
    assert detokenize(tpl_server, no_gen) == text[:-len("<|assistant|>\n")]


@pytest.mark.processes
def test_response_role_streamed_and_with_tools(tpl_server):
    stream = client(tpl_server).chat.completions.create(model="demo", messages=MESSAGES, max_tokens=6,
                                                        temperature=0, stream=True, n=2)
    roles = {}
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.role is not None:
                roles.setdefault(choice.index, []).append(choice.delta.role)
    assert roles == {0: ["narrator"], 1: ["narrator"]}  # once per choice, in its first chunk
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a"],
        "additionalProperties": False}}}
    r = client(tpl_server).chat.completions.create(model="demo", messages=MESSAGES, max_tokens=40, temperature=0,
                                                   tools=[tool], tool_choice={"type": "function",
                                                                              "function": {"name": "pick"}})
    message = r.choices[0].message
    assert message.role == "narrator" and message.tool_calls and message.tool_calls[0].function.name == "pick"


@pytest.mark.processes
def test_without_the_generation_prompt_the_answer_names_the_last_messages_role(tpl_server):
    body = {"messages": [*MESSAGES, {"role": "assistant", "content": "Well"}], "add_generation_prompt": False,
            "max_tokens": 4, "temperature": 0}
    r = post(tpl_server, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"
    body["messages"][-1]["role"] = "user"
    assert post(tpl_server, "/v1/chat/completions", body).json()["choices"][0]["message"]["role"] == "user"
    with httpx.stream("POST", tpl_server.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=60) as r:
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[len("data: "):])
    assert first["choices"][0]["delta"] == {"role": "user", "content": ""}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize", "/v1/chat/completions/render"])
@pytest.mark.parametrize("extra", [{"chat_template": "{{ 7 * 7 }}"},
                                   {"chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}])
@pytest.mark.processes
def test_a_request_template_is_still_refused_without_trust(tpl_server, path, extra):
    r = post(tpl_server, path, {"messages": MESSAGES, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "chat_template" and "--trust-request-chat-template" in error["message"]


# -- a model without a template of its own, an inline template ----------------------------------------------------

@pytest.mark.processes
def test_a_model_without_a_template_serves_chats_with_the_inline_one(bare_server):
    r = client(bare_server).chat.completions.create(model="bare", messages=MESSAGES, max_tokens=5, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    tokens = post(bare_server, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert r.usage.prompt_tokens == len(tokens)
    assert detokenize(bare_server, tokens) == "INLINE-TPL[system]Be brief.\nINLINE-TPL[user]Héllo?\nINLINE-TPL[reply]"
    rendered = post(bare_server, "/v1/chat/completions/render", {"messages": MESSAGES}).json()["token_ids"]
    assert rendered == tokens


@pytest.mark.processes
def test_a_trusted_request_template_takes_precedence_over_the_servers(bare_server):
    tokens = post(bare_server, "/tokenize", {"messages": MESSAGES,
                                             "chat_template": "REQ:{{ messages[-1]['content'] }}"}).json()["tokens"]
    assert detokenize(bare_server, tokens) == "REQ:Héllo?"


@pytest.mark.processes
def test_a_model_without_a_template_and_no_flag_says_which_flag(kvgate_cache, bare_folder):
    with KvgateServe(str(bare_folder), "--backend", "sim", "--sim-max-model-len", "1024",
                     cache_dir=kvgate_cache) as server:
        for path in ("/v1/chat/completions", "/tokenize"):
            r = post(server, path, {"messages": MESSAGES})
            assert r.status_code == 400, r.text
            assert "no chat template" in r.json()["error"]["message"]
            assert "--chat-template" in r.json()["error"]["message"]


# -- start errors -------------------------------------------------------------------------------------------------

def _bad_templates(folder):
    (folder / "syntax.jinja").write_text("{% for m in messages %}{{ m['content'] }}")
    (folder / "filter.jinja").write_text("{{ messages | no_such_filter }}")
    (folder / "big.jinja").write_text("x" * (MAX_TEMPLATE_BYTES + 1))
    (folder / "empty.jinja").write_text("")
    (folder / "latin1.jinja").write_bytes("{{ 'caf\xe9' }}".encode("latin-1"))
    (folder / "a-directory").mkdir()
    return [
        (folder / "missing.jinja", "looks like a file path, but it cannot be opened (No such file or directory)"),
        (folder / "syntax.jinja", "is not a valid Jinja template: line 1:"),
        (folder / "filter.jinja", "No filter named 'no_such_filter'"),
        (folder / "big.jinja", f"is {MAX_TEMPLATE_BYTES + 1} bytes, larger than {MAX_TEMPLATE_BYTES}"),
        (folder / "empty.jinja", "is empty"),
        (folder / "latin1.jinja", "is not UTF-8 text"),
        (folder / "a-directory", "is not a regular file"),
        ("{% if add_generation_prompt %}", "(inline) is not a valid Jinja template: line 1:"),
    ]


@pytest.mark.processes
def test_a_bad_template_is_a_start_error_of_one_line_before_any_model_is_built(tmp_path):
    cache = tmp_path / "cache"  # the demo model would be built here: it must stay empty
    cache.mkdir()
    env = dict(os.environ, KVGATE_CACHE_DIR=str(cache), OMP_NUM_THREADS="1")
    for value, says in _bad_templates(tmp_path):
        r = subprocess.run([KVGATE, "serve", "demo", "--chat-template", str(value)], capture_output=True, text=True,
                           timeout=120, env=env)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, (value, r.returncode, r.stderr)
        assert lines[0].startswith("kvgate serve: error: --chat-template") and says in lines[0], (value, lines)
    assert list(cache.iterdir()) == []


def test_an_empty_response_role_is_refused(capsys):
    from kvgate.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "x", "--backend", "sim", "--response-role", " "])
    assert exit_.value.code == 2 and "--response-role: must not be empty" in capsys.readouterr().err


# -- the loader and the template choice, without a server ---------------------------------------------------------

def test_the_loader_reads_files_as_utf8_and_inline_text_as_written(tmp_path):
    path = tmp_path / "bom.jinja"
    path.write_bytes(b"\xef\xbb\xbf" + SERVER_TEMPLATE.encode())  # an editor's byte-order mark is dropped
    assert load_server_template(str(path)) == SERVER_TEMPLATE
    assert load_server_template(INLINE_TEMPLATE) == INLINE_TEMPLATE  # no escape decoding (vLLM's current rule)
    assert load_server_template("café: {{ messages }}") == "café: {{ messages }}"
    # transformers' tags compile: the check runs in the environment that renders
    tracked = "{% for m in messages %}{% generation %}{{ m['content'] }}{% endgeneration %}{% endfor %}"
    assert load_server_template(tracked) == tracked
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ChatTemplateError, match="not a regular file"):  # never opened: it would block the start
        load_server_template(str(fifo))
    with pytest.raises(ChatTemplateError, match="larger than"):
        load_server_template("{{ x }}" + "x" * MAX_TEMPLATE_BYTES)
    with pytest.raises(ChatTemplateError, match="cannot be compiled: RecursionError"):
        load_server_template("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}")
    with pytest.raises(ChatTemplateError, match="is empty"):
        load_server_template("")


class _Tokenizer:
    chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.mark.parametrize("request_template, trusted, server, expected", [
    (None, False, None, None),  # the model's: nothing to pass
    (None, False, "S{{ messages }}", "S{{ messages }}"),
    ("R{{ messages }}", True, "S{{ messages }}", "R{{ messages }}"),  # a trusted request's wins, as in vLLM
])
def test_the_template_is_the_trusted_requests_then_the_servers_then_the_models(request_template, trusted, server,
                                                                                expected):
    kwargs = template_kwargs(_Tokenizer(), request_template, {"bos_token": "B", "unread": 1}, trusted, server)
    assert kwargs.get("chat_template") == expected
    # only what the template in use reads is passed: the model's reads bos_token, the others do not
    assert ("bos_token" in kwargs) == (expected is None) and "unread" not in kwargs
