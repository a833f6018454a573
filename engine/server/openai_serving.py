"""OpenAI completions and chat completions over AsyncLLM: validation, prompts, responses and SSE streams.

Every request is checked against the server's RequestLimits before anything reaches the engine, and its
prompts are tokenized (chat: rendered) in a small thread pool under a time bound, so neither a large prompt
nor a slow template stalls the event loop that serves every other stream. Chat templates come from the
model only: a template in the request (`chat_template`, or inside `chat_template_kwargs`) is refused unless
the server trusts request templates (vLLM's `--trust-request-chat-template`), and only the keyword
arguments the model's template actually reads are passed on (as vLLM does).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.bounded_tokenize import BoundedEncoder
from kvgate.engine.errors import EngineDeadError, EngineError, InvalidRequestError
from kvgate.engine.lora.request import LoRARequest
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.server.limits import RequestLimits
from kvgate.engine.server.metrics import RequestTracker, ServerMetrics
from kvgate.engine.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from kvgate.engine.server import tool_calls
from kvgate.engine.server.structured_outputs import structured_outputs_params
from kvgate.engine.structured_output import StructuredOutputManager


class ModelNotFound(Exception):
    pass


class Overloaded(Exception):
    pass


class ShuttingDown(Exception):
    """The server is draining (SIGTERM): running requests finish, new ones are refused with 503."""


# chat_template_kwargs a request may never set: they would replace the template or change the call itself.
_FORBIDDEN_TEMPLATE_KWARGS = ("chat_template", "tokenize")
# Names the server itself passes to the template.
_SERVER_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt"})


@functools.lru_cache(maxsize=8)
def _template_variables(template: str) -> frozenset[str]:
    """The variables a Jinja template reads (parsed once per template; never rendered here)."""
    import jinja2
    import jinja2.meta

    return frozenset(jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template)))


def stream_error(exc: Exception) -> dict:
    """The SSE error event for an error met after a stream's headers were sent (OpenAI's error shape)."""
    if isinstance(exc, InvalidRequestError):
        return {"error": {"message": str(exc), "type": "invalid_request_error", "param": exc.param, "code": 400}}
    if isinstance(exc, EngineError):  # the engine died, or the server is shutting down: retry elsewhere
        return {"error": {"message": str(exc), "type": "server_error", "param": None, "code": 503}}
    return {"error": {"message": f"internal error: {type(exc).__name__}", "type": "server_error", "param": None,
                      "code": 500}}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass
class Prepared:
    """A validated request: its prompts, per-prompt parameters and its accounting (opened on admission)."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    tracker: RequestTracker


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, served_model_name: str, metrics: ServerMetrics,
                 limits: RequestLimits | None = None, tool_parser: str | None = None) -> None:
        self.llm = llm
        self.tool_parser = tool_parser  # --tool-call-parser with --enable-auto-tool-choice: tool_choice auto
        self.model_name = served_model_name
        self.metrics = metrics
        self.limits = limits or RequestLimits()
        self.in_flight = 0  # engine requests (prompts x n) admitted and not yet done
        self.open_requests = 0  # API requests admitted and not yet answered (what a drain waits for)
        self.shutting_down: str | None = None  # why new requests are refused (set by the drain)
        self._token_text: dict[int, str] = {}
        # Tokenization and template rendering run here, not on the event loop. A few threads: the Rust
        # tokenizer is fast, and a bounded pool bounds the CPU a burst of large prompts can take.
        self._pool = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                        thread_name_prefix="kvgate-tokenize")
        self._bounded_encoder: BoundedEncoder | None = None  # built on the first long prompt (a vocabulary scan)
        # matchers for the constraints' admission check; built on the first constrained request (its tokenizer
        # view takes 0.3-1 s for a 32k vocabulary)
        self._constraint_checker: StructuredOutputManager | None = None
        self._checker_lock = threading.Lock()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable, *args, param: str = "prompt"):
        """Run a tokenizer call in the pool, bounded by --tokenize-timeout. A call that ran too long is the
        request's fault (400); one that never got a thread in that time means the server is too busy (503)."""
        started: list[float] = []

        def run():
            started.append(time.monotonic())
            return fn(*args)

        future = asyncio.get_running_loop().run_in_executor(self._pool, run)
        limit = self.limits.tokenize_timeout
        try:
            return await asyncio.wait_for(future, limit)
        except asyncio.TimeoutError:
            if started:
                raise InvalidRequestError(f"the prompt took more than {limit:g} s to tokenize "
                                          "(--tokenize-timeout)", param=param) from None
            raise Overloaded(f"The server is overloaded: no tokenizer thread was free for {limit:g} s. "
                             "Retry later.") from None

    # -- checks -----------------------------------------------------------------------------------

    def check_model(self, name: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); ModelNotFound for a name not served."""
        if name is None or name == self.model_name:
            return None
        lora = self.llm.loras.get(name)
        if lora is None:
            served = ", ".join(f"`{n}`" for n in [self.model_name, *sorted(self.llm.loras)])
            raise ModelNotFound(f"The model `{name}` does not exist; this server serves {served}.")
        return lora

    def response_model(self, req: SamplingFields) -> str:
        """The `model` a response names: the adapter asked for, else the served model (vLLM's answer). `model` was
        checked when the request came in, so it is one of the two."""
        return req.model or self.model_name

    def check_accepting(self) -> None:
        if self.shutting_down:
            raise ShuttingDown(self.shutting_down)
        if self.llm.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.llm.error}")

    def check_capacity(self, samples: int) -> None:
        limit = self.limits.max_queued_requests
        stats = self.llm.stats
        running = stats.num_running if stats else 0
        queued = self.in_flight - running
        if queued + samples > limit:
            raise Overloaded(f"The server is overloaded: {queued} requests are queued and this one adds "
                             f"{samples} (limit {limit}, --max-queued-requests). Retry later.")

    def check_request(self, req: SamplingFields, num_prompts: int = 1) -> None:
        """The request's own size against the limits (before any tokenization)."""
        lim = self.limits
        for name, value in (("n", req.n), ("best_of", req.best_of)):
            if value is not None and not 1 <= value <= lim.max_n:
                raise InvalidRequestError(f"{name} must be in [1, {lim.max_n}] (--max-n), got {value}", param=name)
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequestError("best_of other than n is not supported", param="best_of")
        if num_prompts > lim.max_prompts_per_request:
            raise InvalidRequestError(f"{num_prompts} prompts in one request; at most "
                                      f"{lim.max_prompts_per_request} (--max-prompts-per-request)", param="prompt")
        samples = num_prompts * req.n
        if samples > lim.max_queued_requests:
            raise InvalidRequestError(f"this request makes {samples} engine requests (prompts x n), more than the "
                                      f"server ever queues ({lim.max_queued_requests}, --max-queued-requests)",
                                      param="n")
        stops = [req.stop] if isinstance(req.stop, str) else (req.stop or [])
        if len(stops) > lim.max_stop_sequences:
            raise InvalidRequestError(f"at most {lim.max_stop_sequences} stop sequences (--max-stop-sequences), "
                                      f"got {len(stops)}", param="stop")
        if any(len(x) > lim.max_stop_sequence_chars for x in stops):
            raise InvalidRequestError(f"a stop sequence is longer than {lim.max_stop_sequence_chars} characters "
                                      "(--max-stop-sequence-chars)", param="stop")
        if len(req.stop_token_ids or ()) > lim.max_stop_sequences:
            raise InvalidRequestError(f"at most {lim.max_stop_sequences} stop_token_ids (--max-stop-sequences)",
                                      param="stop_token_ids")

    def check_logprobs(self, value: int | None, param: str) -> None:
        if value is not None and value > self.limits.max_logprobs:
            raise InvalidRequestError(f"{param} must be in [0, {self.limits.max_logprobs}] (--max-logprobs), "
                                      f"got {value}", param=param)

    def _admit(self, prompts: list[list[int]], params: list[SamplingParams], n: int) -> Prepared:
        self.check_accepting()
        samples = len(prompts) * n
        self.check_capacity(samples)
        self.in_flight += samples
        self.open_requests += 1

        def release() -> None:
            self.in_flight -= samples
            self.open_requests -= 1

        return Prepared(prompts, params, self.metrics.track(sum(map(len, prompts)), samples, on_close=release))

    # -- prompts and parameters -------------------------------------------------------------------

    @staticmethod
    def completion_prompt_list(req: CompletionRequest) -> list:
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return prompts

    def refuse_over_long(self, text: str, special: bool = True, param: str = "prompt") -> None:
        """A 400 for a text of at least max_model_len tokens, found by tokenizing only as much of it as that
        takes (engine/bounded_tokenize.py) — a prompt of megabytes costs what a max_model_len one does, not
        millions of ids. Texts too short in characters to be cut are left to the full tokenization."""
        limit = self.llm.info.max_model_len
        backend = getattr(self.llm.tokenizer, "backend_tokenizer", None)
        if backend is None or len(text) <= limit:  # no more characters than the limit: cheap to tokenize whole
            return
        if self._bounded_encoder is None:
            self._bounded_encoder = BoundedEncoder(backend)
        if len(text) <= limit * self._bounded_encoder.chars_per_token + self._bounded_encoder.cut_margin:
            return
        found = self._bounded_encoder.prefix(text, limit, special)
        if not found.complete:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has more than that "
                f"(about {found.count} tokens), which leaves no room for a completion.", param=param)

    def constraint_checker(self) -> StructuredOutputManager:
        """The admission check's matcher builder (in the pool: several threads may ask at once)."""
        with self._checker_lock:
            if self._constraint_checker is None:
                info = self.llm.info
                self._constraint_checker = StructuredOutputManager(self.llm.tokenizer, info.vocab_size,
                                                                   info.eos_token_ids)
            return self._constraint_checker

    def constraint(self, req, tool_parser: str | None):
        """The request's structured-output constraint, checked against its cost (in the pool)."""
        return structured_outputs_params(req, tool_parser, self.constraint_checker())

    def encode_prompts(self, prompts: list) -> list[list[int]]:
        """Texts to token ids (in the pool); token ids are checked against the vocabulary."""
        tok, vocab = self.llm.tokenizer, self.llm.info.vocab_size
        out = []
        for x in prompts:
            if isinstance(x, str):
                self.refuse_over_long(x)
            ids = tok.encode(x) if isinstance(x, str) else list(x)
            if not ids:
                raise InvalidRequestError("a prompt is empty", param="prompt")
            if not isinstance(x, str) and any(not 0 <= t < vocab for t in ids):
                raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
            out.append(ids)
        return out

    def template_kwargs(self, chat_template: str | None, kwargs: dict | None) -> dict:
        """What a request may pass to the chat template (checked on the event loop: cheap)."""
        kwargs = dict(kwargs or {})
        if "tokenize" in kwargs:
            raise InvalidRequestError("chat_template_kwargs may not set tokenize", param="chat_template_kwargs")
        template = chat_template if chat_template is not None else kwargs.pop("chat_template", None)
        from_request = template is not None
        if from_request and not self.limits.trust_request_chat_template:
            raise InvalidRequestError("a chat template was passed with the request, but this server does not "
                                      "run request templates (--trust-request-chat-template is not set)",
                                      param="chat_template")
        kwargs.pop("chat_template", None)
        tok = self.llm.tokenizer
        if template is None:
            template = getattr(tok, "chat_template", None)
            if isinstance(template, dict):  # named templates: the default one
                template = template.get("default")
        if not isinstance(template, str) or not template:
            raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
        try:
            reads = _template_variables(template)
        except Exception as exc:  # noqa: BLE001 - only a trusted request template can be malformed
            raise InvalidRequestError(f"cannot parse the chat template: {exc}", param="chat_template") from exc
        passed = {k: v for k, v in kwargs.items() if k in reads and k not in _SERVER_TEMPLATE_VARS}
        if from_request or template is not getattr(tok, "chat_template", None):
            passed["chat_template"] = template  # a trusted request template, or the default of named ones
        return passed

    def chat_prompt(self, req: ChatCompletionRequest, template_kwargs: dict | None = None) -> list[int]:
        """Render and tokenize the conversation (in the pool)."""
        tok = self.llm.tokenizer
        if template_kwargs is None:
            template_kwargs = self.template_kwargs(req.chat_template, req.chat_template_kwargs)
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
        if sum(len(m["content"]) for m in messages) > self.llm.info.max_model_len:  # may be over: render, count
            try:
                text = tok.apply_chat_template(messages, tokenize=False,
                                               add_generation_prompt=req.add_generation_prompt, **template_kwargs)
            except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
                raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
            if isinstance(text, str):  # apply_chat_template(tokenize=True) tokenizes it without special tokens
                self.refuse_over_long(text, special=False, param="messages")
        try:
            ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=req.add_generation_prompt,
                                          **template_kwargs)
        except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        if not ids:
            raise InvalidRequestError("the conversation renders to an empty prompt", param="messages")
        return list(ids)

    def sampling_params(self, req: SamplingFields, prompt_len: int, max_tokens: int | None,
                        logprobs: int | None, structured_outputs=None) -> SamplingParams:
        limit = self.llm.info.max_model_len
        if prompt_len >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves no room for a completion.", param="prompt")
        if max_tokens is None:
            max_tokens = limit - prompt_len
        elif prompt_len + max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                "completion). Please reduce the prompt or max_tokens.", param="max_tokens")
        vocab = self.llm.info.vocab_size
        if any(not 0 <= t < vocab for t in req.stop_token_ids or ()):
            raise InvalidRequestError("stop_token_ids must be token ids of this model", param="stop_token_ids")
        fields = dict(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            repetition_penalty=req.repetition_penalty, seed=req.seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens, structured_outputs=structured_outputs,
        )
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.llm.tokenizer.decode([token_id])
        return text

    # -- running ----------------------------------------------------------------------------------

    async def _run(self, request_id: str, prompts: list[list[int]], params: list[SamplingParams],
                   req: SamplingFields) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every prompt as they come, tagged with the prompt's index."""
        arrival = time.monotonic()
        lora = self.check_model(req.model)  # again: an adapter removed since the request was checked is a 404
        streams = [
            self.llm.generate(f"{request_id}-{i}", ids, p, priority=req.priority, cache_salt=req.cache_salt,
                              arrival_time=arrival, lora_request=lora)
            for i, (ids, p) in enumerate(zip(prompts, params))
        ]
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream) -> None:
            try:
                async for out in stream:
                    q.put_nowait((i, out))
                q.put_nowait((i, None))
            except Exception as exc:  # noqa: BLE001 - re-raised by the consumer
                q.put_nowait((i, exc))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await q.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _observe(self, tracker: RequestTracker, out: RequestOutput) -> None:
        for c in out.outputs:
            tracker.on_tokens(len(c.delta_token_ids))
            if c.finished:
                tracker.on_finished_sample(c.finish_reason, out.metrics)

    # -- completions ------------------------------------------------------------------------------

    async def prepare_completion(self, req: CompletionRequest) -> Prepared:
        self.check_accepting()
        prompts, params = await self.render_completion(req)
        return self._admit(prompts, params, req.n)

    async def render_completion(self, req: CompletionRequest) -> tuple[list[list[int]], list[SamplingParams]]:
        """Every check of /v1/completions and its prompts' token ids and parameters, admitting nothing (what
        /v1/completions/render returns)."""
        self.check_model(req.model)
        if req.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        texts = self.completion_prompt_list(req)
        self.check_request(req, len(texts))
        self.check_logprobs(req.logprobs, "logprobs")
        prompts = await self.off_loop(self.encode_prompts, texts)
        constraint = await self.off_loop(self.constraint, req, None, param="structured_outputs")
        params = [self.sampling_params(req, len(ids), req.max_tokens, req.logprobs, constraint) for ids in prompts]
        return prompts, params

    def _completion_logprobs(self, c, start: int = 0, offset: int = 0) -> dict | None:
        if c.logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = offset
        for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            text = self.token_text(tid)
            tokens.append(text)
            token_lps.append(entry[tid].logprob)
            tops.append({self.token_text(t): lp.logprob for t, lp in entry.items()})
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def _collect(self, rid: str, req: SamplingFields, prep: Prepared) -> tuple[dict, dict]:
        """Run to the end: ({(prompt index, sample index): final output}, {prompt index: cached tokens})."""
        finals, cached = {}, {}
        try:
            async for i, out in self._run(rid, prep.prompts, prep.params, req):
                self._observe(prep.tracker, out)
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    if c.finished:
                        finals[(i, c.index)] = c
        finally:
            prep.tracker.close()
        return finals, cached

    async def completion(self, req: CompletionRequest, prep: Prepared) -> dict:
        rid = f"cmpl-{uuid.uuid4().hex}"
        prompts = prep.prompts
        finals, cached = await self._collect(rid, req, prep)
        n = req.n
        choices = []
        for (i, j), c in sorted(finals.items()):
            choices.append({"index": i * n + j, "text": c.text, "logprobs": self._completion_logprobs(c),
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        completion_tokens = sum(len(c.token_ids) for c in finals.values())
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.response_model(req),
                "choices": choices, "usage": self._usage(prompts, completion_tokens, cached)}

    def _usage(self, prompts, completion_tokens: int, cached: dict) -> dict:
        prompt_tokens = sum(map(len, prompts))
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}

    async def completion_stream(self, req: CompletionRequest, prep: Prepared) -> AsyncIterator[str]:
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        prompts, params, tracker = prep.prompts, prep.params, prep.tracker
        sent_tokens: dict[tuple[int, int], int] = {}
        offsets: dict[tuple[int, int], int] = {}
        completion_tokens, cached = 0, {}
        try:
            async for i, out in self._run(rid, prompts, params, req):
                self._observe(tracker, out)
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    key = (i, c.index)
                    start = sent_tokens.get(key, 0)
                    sent_tokens[key] = len(c.token_ids)
                    completion_tokens += len(c.token_ids) - start
                    if not c.delta_text and not c.finished and c.logprobs is None:
                        continue
                    lp = self._completion_logprobs(c, start, offsets.get(key, 0))
                    offsets[key] = offsets.get(key, 0) + len(c.delta_text)
                    choice = {"index": i * req.n + c.index, "text": c.delta_text, "logprobs": lp,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    yield sse({"id": rid, "object": "text_completion", "created": created,
                               "model": self.response_model(req), "choices": [choice]})
            if req.stream_options and req.stream_options.include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created,
                           "model": self.response_model(req),
                           "choices": [], "usage": self._usage(prompts, completion_tokens, cached)})
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            yield sse(stream_error(exc))
        finally:
            tracker.close()
        yield sse("[DONE]")

    # -- chat -------------------------------------------------------------------------------------

    async def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        self.check_accepting()
        ids, params = await self.render_chat(req)
        return self._admit([ids], [params], req.n)

    async def render_chat(self, req: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        """Every check of /v1/chat/completions and the conversation's token ids and parameters, admitting
        nothing (what /v1/chat/completions/render returns)."""
        self.check_model(req.model)
        self.check_request(req)
        self.check_logprobs(req.top_logprobs, "top_logprobs")
        top = req.top_logprobs if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        template_kwargs = req.chat_template_kwargs
        if req.tools and req.tool_choice != "none":  # passed on only if the template reads `tools`
            template_kwargs = {**(template_kwargs or {}), "tools": [t.model_dump(exclude_none=True) for t in req.tools]}
        kwargs = self.template_kwargs(req.chat_template, template_kwargs)
        ids = await self.off_loop(self.chat_prompt, req, kwargs, param="messages")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        constraint = await self.off_loop(self.constraint, req, self.tool_parser, param="structured_outputs")
        params = self.sampling_params(req, len(ids), max_tokens, (top or 0) if req.logprobs else None, constraint)
        return ids, params

    def _chat_logprobs(self, c, k: int, start: int = 0) -> dict | None:
        if c.logprobs is None:
            return None
        content = []
        for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            text = self.token_text(tid)
            top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= k)
            content.append({
                "token": text, "logprob": entry[tid].logprob, "bytes": list(text.encode()),
                "top_logprobs": [{"token": self.token_text(t), "logprob": v, "bytes": list(self.token_text(t).encode())}
                                 for _, t, v in top],
            })
        return {"content": content}

    async def chat(self, req: ChatCompletionRequest, prep: Prepared) -> dict:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        prompts = prep.prompts
        finals, cached = await self._collect(rid, req, prep)
        mode = tool_calls.tool_mode(req, self.tool_parser)
        choices = []
        for (_, j), c in sorted(finals.items()):
            message, finish_reason = {"role": "assistant", "content": c.text}, c.finish_reason
            if mode is not None:
                message, finish_reason = tool_calls.message(mode, c.text, c.finish_reason)
            choices.append({"index": j, "message": message, "logprobs": self._chat_logprobs(c, req.top_logprobs or 0),
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason})
        completion_tokens = sum(len(c.token_ids) for c in finals.values())
        return {"id": rid, "object": "chat.completion", "created": int(time.time()),
                "model": self.response_model(req),
                "choices": choices, "usage": self._usage(prompts, completion_tokens, cached)}

    async def chat_stream(self, req: ChatCompletionRequest, prep: Prepared) -> AsyncIterator[str]:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        prompts, params, tracker = prep.prompts, prep.params, prep.tracker

        def chunk(choices, **extra):
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": self.response_model(req), "choices": choices, **extra})

        sent: dict[int, int] = {}
        completion_tokens, cached = 0, {}
        mode = tool_calls.tool_mode(req, self.tool_parser)
        tool_streams = {j: tool_calls.ToolCallStream(mode) for j in range(req.n)} if mode is not None else {}
        try:
            for j in range(req.n):
                yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for i, out in self._run(rid, prompts, params, req):
                self._observe(tracker, out)
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    start = sent.get(c.index, 0)
                    sent[c.index] = len(c.token_ids)
                    completion_tokens += len(c.token_ids) - start
                    if not c.delta_text and not c.finished and c.logprobs is None:
                        continue
                    logprobs = self._chat_logprobs(c, req.top_logprobs or 0, start)
                    if mode is not None:
                        deltas, finish_reason = tool_streams[c.index].deltas(c.delta_text, c.finish_reason)
                        if not deltas and finish_reason is None and logprobs is None:
                            continue  # a required array's text: sent as calls once it ends
                        for k, delta in enumerate(deltas or [{}]):
                            last = k == max(len(deltas) - 1, 0)
                            yield chunk([{"index": c.index, "delta": delta, "logprobs": logprobs if last else None,
                                          "finish_reason": finish_reason if last else None}])
                        continue
                    delta = {"content": c.delta_text} if c.delta_text else {}
                    yield chunk([{"index": c.index, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": c.finish_reason}])
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], usage=self._usage(prompts, completion_tokens, cached))
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            yield sse(stream_error(exc))
        finally:
            tracker.close()
        yield sse("[DONE]")
