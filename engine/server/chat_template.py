"""Chat templates: the server's own (`--chat-template`, loaded and checked at start), what a request may pass to
the template, and a conversation rendered to token ids.

Templates come from the server or the model: `--chat-template` (vLLM's flag) replaces the model's for every chat
request and /tokenize; a template in the request (`chat_template`, or inside `chat_template_kwargs`) is refused
unless the server trusts request templates (vLLM's `--trust-request-chat-template`), and only the keyword
arguments the template actually reads are passed on (as vLLM does). Every template is compiled in transformers'
sandboxed Jinja environment, the one apply_chat_template renders in.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Callable

from kvgate.common.errors import ConfigError, InvalidRequestError
from kvgate.engine.server.protocol import ChatCompletionRequest

# Names the server itself passes to the template.
_SERVER_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt"})

# vLLM's rule (load_chat_template): a --chat-template value that names no file is the template itself only if it
# has one of these; otherwise it was meant as a path, and a typo in it must not become a one-line template.
_JINJA_CHARS = "{}\n"

# The largest --chat-template (file or text). Real templates are a few KiB: vLLM's examples/ ones run from 4.5k
# characters (DeepSeek-V3.2 tools) through 5.4k (Llama 3.1 JSON tools) to 17k (Gemma 4), 60 times under this. A
# file over 1 MiB is a wrong path (weights, a log, a dataset) that would be read whole into memory and compiled.
MAX_TEMPLATE_BYTES = 1 << 20


class ChatTemplateError(ConfigError):
    """--chat-template cannot be served: the server does not start (one line, for stderr)."""


def compile_template(template: str):
    """`template` compiled as transformers' apply_chat_template compiles it: its sandboxed environment
    (ImmutableSandboxedEnvironment with its extensions and globals), and its cache, so a template compiled here
    renders under the same rules. jinja2.TemplateSyntaxError when it does not compile."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template)


def load_server_template(value: str) -> str:
    """--chat-template's template: the file `value` names, else `value` itself when it reads as a template (vLLM's
    rule; taken as written, as vLLM now takes it: no escape decoding, which garbled non-ASCII text). Checked as
    the server will use it: readable UTF-8, at most MAX_TEMPLATE_BYTES, not empty, compiling in the sandbox.
    ChatTemplateError says why not."""
    if not value.strip():
        raise ChatTemplateError("--chat-template is empty")
    try:
        st = os.stat(value)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the value
        if not any(c in value for c in _JINJA_CHARS):
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise ChatTemplateError(f"--chat-template {value!r} looks like a file path, but it cannot be opened "
                                    f"({why}); a template given inline must contain '{{', '}}' or a newline") from exc
        text, source = value, "--chat-template (inline)"
        if len(text.encode("utf-8", "surrogatepass")) > MAX_TEMPLATE_BYTES:
            raise ChatTemplateError(f"{source} is larger than {MAX_TEMPLATE_BYTES} bytes") from None
    else:
        source = f"--chat-template {value!r}"
        text = _read_template_file(value, st, source)
    if not text.strip():
        raise ChatTemplateError(f"{source} is empty")
    try:
        compile_template(text)
    except Exception as exc:  # noqa: BLE001 - any failure here means the template cannot be served
        import jinja2

        if isinstance(exc, jinja2.TemplateSyntaxError):
            raise ChatTemplateError(f"{source} is not a valid Jinja template: line {exc.lineno}: "
                                    f"{_one_line(exc.message or str(exc))}") from exc
        raise ChatTemplateError(f"{source} cannot be compiled: {type(exc).__name__}: {_one_line(str(exc))}") from exc
    return text


def _read_template_file(path: str, st: os.stat_result, source: str) -> str:
    if not stat.S_ISREG(st.st_mode):  # a directory, FIFO or device: never read (a FIFO would block the start)
        raise ChatTemplateError(f"{source} is not a regular file")
    if st.st_size > MAX_TEMPLATE_BYTES:
        raise ChatTemplateError(f"{source} is {st.st_size} bytes, larger than {MAX_TEMPLATE_BYTES} (not a chat "
                                "template: a wrong path?)")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_TEMPLATE_BYTES + 1)  # bounded even if the file grew since stat
    except OSError as exc:
        raise ChatTemplateError(f"{source} cannot be read ({exc.strerror or exc})") from exc
    if len(data) > MAX_TEMPLATE_BYTES:
        raise ChatTemplateError(f"{source} is larger than {MAX_TEMPLATE_BYTES} bytes")
    try:
        return data.decode("utf-8-sig")  # an editor's byte-order mark is not template text
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(f"{source} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


def _one_line(text: str) -> str:
    return " ".join(text.split())


@functools.lru_cache(maxsize=8)
def _template_variables(template: str) -> frozenset[str]:
    """The variables a Jinja template reads (parsed once per template, by the environment that renders it, so its
    tags, `{% generation %}` included, parse; never rendered here)."""
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(compile_template(template).environment.parse(template)))


def template_kwargs(tokenizer, chat_template: str | None, kwargs: dict | None,
                    trust_request_template: bool, server_template: str | None = None) -> dict:
    """What a request may pass to the chat template (cheap: checked on the event loop). The template is the
    request's (trusted only), else the server's (`server_template`, --chat-template), else the model's."""
    kwargs = dict(kwargs or {})
    if "tokenize" in kwargs:
        raise InvalidRequestError("chat_template_kwargs may not set tokenize", param="chat_template_kwargs")
    template = chat_template if chat_template is not None else kwargs.pop("chat_template", None)
    from_request = template is not None
    if from_request and not trust_request_template:
        raise InvalidRequestError("a chat template was passed with the request, but this server does not "
                                  "run request templates (--trust-request-chat-template is not set)",
                                  param="chat_template")
    kwargs.pop("chat_template", None)
    if template is None:
        template = server_template
    if template is None:
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
    if not isinstance(template, str) or not template:
        raise InvalidRequestError("this model has no chat template; start the server with --chat-template, or "
                                  "use /v1/completions", param="messages")
    try:
        reads = _template_variables(template)
    except Exception as exc:  # noqa: BLE001 - only a trusted request template can be malformed
        raise InvalidRequestError(f"cannot parse the chat template: {exc}", param="chat_template") from exc
    passed = {k: v for k, v in kwargs.items() if k in reads and k not in _SERVER_TEMPLATE_VARS}
    if from_request or template is not getattr(tokenizer, "chat_template", None):
        passed["chat_template"] = template  # a trusted request template, the server's, or the default of named ones
    return passed


def _messages(req: ChatCompletionRequest) -> list[dict]:
    """The conversation as the template takes it (text content only)."""
    messages = []
    for m in req.messages:
        content = m.content
        if isinstance(content, list):
            parts = []
            for part in content:
                if part.get("type") != "text":
                    raise InvalidRequestError(f"content part type {part.get('type')!r} is not supported "
                                              "(text only)", param="messages")
                parts.append(str(part.get("text", "")))
            content = "".join(parts)
        message = {"role": m.role, "content": content or ""}
        extra = m.model_extra or {}
        for key in ("tool_calls", "tool_call_id", "name"):  # a conversation that used tools before
            if extra.get(key) is not None:
                message[key] = extra[key]
        messages.append(message)
    return messages


def chat_prompt(tokenizer, req: ChatCompletionRequest, kwargs: dict, max_model_len: int,
                refuse_over_long: Callable[..., None]) -> list[int]:
    """Render and tokenize the conversation (slow: run in the tokenizer pool). `refuse_over_long(text,
    special=, param=)` refuses a rendering of max_model_len tokens or more before it is tokenized whole."""
    messages = _messages(req)
    if sum(len(m["content"]) for m in messages) > max_model_len:  # may be over: render, count
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False,
                                                 add_generation_prompt=req.add_generation_prompt, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
        if isinstance(text, str):  # apply_chat_template(tokenize=True) tokenizes it without special tokens
            refuse_over_long(text, special=False, param="messages")
    try:
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=req.add_generation_prompt,
                                            **kwargs)
    except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
        raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    if not ids:
        raise InvalidRequestError("the conversation renders to an empty prompt", param="messages")
    return list(ids)
