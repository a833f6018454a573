"""OpenAI completions and chat completions over AsyncLLM: validation, prompts, responses and SSE streams."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.errors import InvalidRequestError
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.server.metrics import RequestTracker, ServerMetrics
from kvgate.engine.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields


class ModelNotFound(Exception):
    pass


class Overloaded(Exception):
    pass


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
                 max_queued_requests: int | None = None) -> None:
        self.llm = llm
        self.model_name = served_model_name
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.in_flight = 0  # engine requests (prompts x n) admitted and not yet done
        self._token_text: dict[int, str] = {}

    # -- checks -----------------------------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise ModelNotFound(f"The model `{name}` does not exist; this server serves `{self.model_name}`.")

    def check_capacity(self) -> None:
        if self.max_queued_requests is None:
            return
        stats = self.llm.stats
        running = stats.num_running if stats else 0
        queued = self.in_flight - running
        if queued >= self.max_queued_requests:
            raise Overloaded(f"The server is overloaded: {queued} requests are queued "
                             f"(limit {self.max_queued_requests}). Retry later.")

    def _admit(self, prompts: list[list[int]], params: list[SamplingParams], n: int) -> Prepared:
        self.check_capacity()
        samples = len(prompts) * n
        self.in_flight += samples

        def release() -> None:
            self.in_flight -= samples

        return Prepared(prompts, params, self.metrics.track(sum(map(len, prompts)), samples, on_close=release))

    # -- prompts and parameters -------------------------------------------------------------------

    def completion_prompts(self, req: CompletionRequest) -> list[list[int]]:
        p = req.prompt
        if isinstance(p, str):
            prompts = [p]
        elif p and all(isinstance(x, int) for x in p):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        tok = self.llm.tokenizer
        return [tok.encode(x) if isinstance(x, str) else list(x) for x in prompts]

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        tok = self.llm.tokenizer
        if not getattr(tok, "chat_template", None):
            raise InvalidRequestError("this model has no chat template; use /v1/completions", param="messages")
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
            messages.append({"role": m.role, "content": content or ""})
        try:
            ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=req.add_generation_prompt,
                                          **(req.chat_template_kwargs or {}))
        except Exception as exc:  # noqa: BLE001 - a template error is the request's fault
            raise InvalidRequestError(f"cannot apply the chat template: {exc}", param="messages") from exc
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def sampling_params(self, req: SamplingFields, prompt_len: int, max_tokens: int | None,
                        logprobs: int | None) -> SamplingParams:
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
            skip_special_tokens=req.skip_special_tokens,
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
        streams = [
            self.llm.generate(f"{request_id}-{i}", ids, p, priority=req.priority, cache_salt=req.cache_salt,
                              arrival_time=arrival)
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

    def prepare_completion(self, req: CompletionRequest):
        self.check_model(req.model)
        if req.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        prompts = self.completion_prompts(req)
        params = [self.sampling_params(req, len(ids), req.max_tokens, req.logprobs) for ids in prompts]
        return self._admit(prompts, params, req.n)

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
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
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
                               "model": self.model_name, "choices": [choice]})
            if req.stream_options and req.stream_options.include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                           "choices": [], "usage": self._usage(prompts, completion_tokens, cached)})
        except InvalidRequestError as exc:
            yield sse({"error": {"message": str(exc), "type": "invalid_request_error", "param": exc.param,
                                 "code": 400}})
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            yield sse({"error": {"message": f"internal error: {type(exc).__name__}", "type": "server_error",
                                 "param": None, "code": 500}})
        finally:
            tracker.close()
        yield sse("[DONE]")

    # -- chat -------------------------------------------------------------------------------------

    def prepare_chat(self, req: ChatCompletionRequest):
        self.check_model(req.model)
        ids = self.chat_prompt(req)
        top = req.top_logprobs if req.logprobs else None
        if req.top_logprobs and not req.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = self.sampling_params(req, len(ids), max_tokens, (top or 0) if req.logprobs else None)
        return self._admit([ids], [params], req.n)

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
        choices = [{"index": j, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c, req.top_logprobs or 0), "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason} for (_, j), c in sorted(finals.items())]
        completion_tokens = sum(len(c.token_ids) for c in finals.values())
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": self._usage(prompts, completion_tokens, cached)}

    async def chat_stream(self, req: ChatCompletionRequest, prep: Prepared) -> AsyncIterator[str]:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        prompts, params, tracker = prep.prompts, prep.params, prep.tracker

        def chunk(choices, **extra):
            return sse({"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": self.model_name, "choices": choices, **extra})

        sent: dict[int, int] = {}
        completion_tokens, cached = 0, {}
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
                    delta = {"content": c.delta_text} if c.delta_text else {}
                    yield chunk([{"index": c.index, "delta": delta, "logprobs": self._chat_logprobs(c, req.top_logprobs or 0, start),
                                  "finish_reason": c.finish_reason}])
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], usage=self._usage(prompts, completion_tokens, cached))
        except InvalidRequestError as exc:
            yield sse({"error": {"message": str(exc), "type": "invalid_request_error", "param": exc.param,
                                 "code": 400}})
        except Exception as exc:  # noqa: BLE001
            yield sse({"error": {"message": f"internal error: {type(exc).__name__}", "type": "server_error",
                                 "param": None, "code": 500}})
        finally:
            tracker.close()
        yield sse("[DONE]")
