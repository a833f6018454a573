"""/v1/chat/completions (and its /render): conversations to token ids, and the answers, whole or as an SSE
stream, with the thinking and the tool calls read from the text (chat_output.py)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from kvgate.common.errors import InvalidRequestError
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.server import tool_calls
from kvgate.engine.server.chat_output import ChatOutput
from kvgate.engine.server.openai_serving import OpenAIServing, Prepared, sse, stream_error, usage
from kvgate.engine.server.protocol import ChatCompletionRequest
from kvgate.engine.server.reasoning_parsers import reasoning_parser


class OpenAIServingChat:
    def __init__(self, serving: OpenAIServing, tool_parser: str | None = None,
                 response_role: str = "assistant", reasoning_parser: str | None = None) -> None:
        self.serving = serving
        self.tool_parser = tool_parser  # --tool-call-parser with --enable-auto-tool-choice: tool_choice auto
        self.response_role = response_role  # --response-role
        self.reasoning_parser = reasoning_parser  # --reasoning-parser: the thinking split from the answer

    def output(self, req: ChatCompletionRequest) -> ChatOutput:
        """How the request's choices are read: thinking, then tool calls or text."""
        thinking = None
        if self.reasoning_parser is not None:
            thinking = reasoning_parser(self.reasoning_parser, req.chat_template_kwargs, _constrained(req))
        return ChatOutput(tool_calls.tool_mode(req, self.tool_parser), thinking, req.include_reasoning)

    def role(self, req: ChatCompletionRequest) -> str:
        """The role an answer names (vLLM's get_chat_request_role): --response-role when the template adds the
        generation prompt; otherwise the output continues the last message, so it is that message's role."""
        return self.response_role if req.add_generation_prompt else req.messages[-1].role

    async def prepare(self, req: ChatCompletionRequest) -> Prepared:
        self.serving.check_accepting()
        ids, params = await self.render(req)
        return self.serving.admit([ids], [params], req.n)

    async def render(self, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        """Every check of /v1/chat/completions and the conversation's token ids and parameters, admitting
        nothing (what /v1/chat/completions/render returns)."""
        serving = self.serving
        serving.check_model(req.model)
        serving.check_request(req)
        serving.check_logprobs(req.top_logprobs, "top_logprobs")
        top = req.top_logprobs if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        template_kwargs = req.chat_template_kwargs
        if req.tools and req.tool_choice != "none":  # passed on only if the template reads `tools`
            template_kwargs = {**(template_kwargs or {}), "tools": [t.model_dump(exclude_none=True) for t in req.tools]}
        kwargs = serving.template_kwargs(req.chat_template, template_kwargs)
        ids = await serving.off_loop(serving.chat_prompt, req, kwargs, param="messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        constraint = await serving.off_loop(serving.constraint, req, self.tool_parser, param="structured_outputs")
        params = serving.sampling_params(req, len(ids), max_tokens, (top or 0) if req.logprobs else None, constraint)
        mode = tool_calls.tool_mode(req, self.tool_parser)
        if mode is not None and mode.parser is not None and mode.parser.needs_special_tokens:
            params.skip_special_tokens = False  # the calls' markers are special tokens (vLLM does the same)
        return ids, params

    def _logprobs(self, c, k: int, start: int = 0) -> dict | None:
        if c.logprobs is None:
            return None
        token_text = self.serving.token_text
        content = []
        for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            text = token_text(tid)
            top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k)
            content.append({
                "token": text, "logprob": entry[tid].logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": token_text(t), "logprob": v, "bytes": list(token_text(t).encode())}
                                 for _, t, v in top],
            })
        return {"content": content}

    async def response(self, req: ChatCompletionRequest, prep: Prepared) -> dict:
        """The whole answer, once every sample has finished."""
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        finals, cached = await self.serving.collect(rid, req, prep)
        output = self.output(req)
        role = self.role(req)
        choices = []
        for (_, j), c in sorted(finals.items()):
            message, finish_reason = output.message(role, c.text, c.finish_reason)
            choices.append({"index": j, "message": message, "logprobs": self._logprobs(c, req.top_logprobs or 0),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        completion_tokens = sum(len(c.token_ids) for c in finals.values())
        return {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": self.serving.response_model(req),
                "choices": choices, "usage": usage(prep.prompts, completion_tokens, cached)}

    async def stream(self, req: ChatCompletionRequest, prep: Prepared) -> AsyncIterator[str]:
        """The answer as SSE chunks (a role chunk per sample first); an error after the first is reported
        in-band."""
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = self.serving.response_model(req)

        def chunk(choices, **extra):
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": choices, **extra})

        sent: dict[int, int] = {}
        completion_tokens, cached = 0, {}
        output = self.output(req)
        outputs = {j: output.stream() for j in range(req.n)}
        role = self.role(req)
        try:
            for j in range(req.n):
                yield chunk([{"index": j, "delta": {"role": role, "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for i, out in self.serving.run(rid, req, prep):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    start = sent.get(c.index, 0)
                    sent[c.index] = len(c.token_ids)
                    completion_tokens += len(c.token_ids) - start
                    if not c.delta_text and not c.finished and c.logprobs is None:
                        continue
                    logprobs = self._logprobs(c, req.top_logprobs or 0, start)
                    deltas, finish_reason = outputs[c.index].deltas(c.delta_text, c.finish_reason)
                    if not deltas and finish_reason is None and logprobs is None:
                        continue  # held back: a possible tag, a call not yet closed, a required array's text
                    for k, delta in enumerate(deltas or [{}]):
                        last = k == max(len(deltas) - 1, 0)
                        yield chunk([{"index": c.index, "delta": delta, "logprobs": logprobs if last else None,
                                      "finish_reason": finish_reason if last else None,
                                      **({"stop_reason": c.stop_reason} if c.finished and last else {})}])
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], usage=usage(prep.prompts, completion_tokens, cached))
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            yield sse(stream_error(exc))
        finally:
            prep.tracker.close()
        yield sse("[DONE]")


def _constrained(req: ChatCompletionRequest) -> bool:
    """Whether the request's output is generated under a constraint from its first token (structured_outputs.py
    reads the same fields)."""
    rf = req.response_format
    return (rf is not None and rf.type != "text") or req.structured_outputs is not None or any(
        getattr(req, f) is not None for f in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"))
