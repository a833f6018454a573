"""Chat templates: what a request may pass to the model's template, and a conversation rendered to token ids.

Templates come from the model only: a template in the request (`chat_template`, or inside
`chat_template_kwargs`) is refused unless the server trusts request templates (vLLM's
`--trust-request-chat-template`), and only the keyword arguments the template actually reads are passed on
(as vLLM does).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from kvgate.engine.errors import InvalidRequestError
from kvgate.engine.server.protocol import ChatCompletionRequest

# Names the server itself passes to the template.
_SERVER_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt"})


@functools.lru_cache(maxsize=8)
def _template_variables(template: str) -> frozenset[str]:
    """The variables a Jinja template reads (parsed once per template; never rendered here)."""
    import jinja2
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))


def template_kwargs(tokenizer, chat_template: str | None, kwargs: dict | None,
                    trust_request_template: bool) -> dict:
    """What a request may pass to the chat template (cheap: checked on the event loop)."""
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
        template = getattr(tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the default one
            template = template.get("default")
    if not isinstance(template, str) or not template:
        raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
    try:
        reads = _template_variables(template)
    except Exception as exc:  # noqa: BLE001 - only a trusted request template can be malformed
        raise InvalidRequestError(f"cannot parse the chat template: {exc}", param="chat_template") from exc
    passed = {k: v for k, v in kwargs.items() if k in reads and k not in _SERVER_TEMPLATE_VARS}
    if from_request or template is not getattr(tokenizer, "chat_template", None):
        passed["chat_template"] = template  # a trusted request template, or the default of named ones
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
