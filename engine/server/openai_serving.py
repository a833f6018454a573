"""The shared base of the OpenAI APIs (serving_completion.py, serving_chat.py): admission, limits, model check,
prompt encoding, sampling parameters and the run/collect loop over AsyncLLM; with the errors and SSE framing both
APIs answer with.

Every request is checked against the server's RequestLimits before anything reaches the engine, and its
prompts are tokenized (chat: rendered, chat_template.py) in a small thread pool under a time bound, so neither a
large prompt nor a slow template stalls the event loop that serves every other stream. One instance serves both
APIs: admission (requests queued, requests open, draining) counts them together.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvgate.engine.async_llm import AsyncLLM
from kvgate.common.bounded_tokenize import BoundedEncoder
from kvgate.common.errors import EngineDeadError, EngineError, InvalidRequestError
from kvgate.engine.generation_defaults import GenerationDefaults, load_generation_defaults
from kvgate.engine.lora.request import LoRARequest
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.server import chat_template
from kvgate.engine.server.limits import RequestLimits
from kvgate.engine.server.metrics import RequestTracker, ServerMetrics
from kvgate.engine.server.protocol import ChatCompletionRequest, SamplingFields
from kvgate.engine.server.structured_outputs import structured_outputs_params
from kvgate.engine.structured_output import StructuredOutputManager

_TOKEN_ID = re.compile(r"[0-9]{1,10}")  # a logit_bias key: a token id, written in decimal


class ModelNotFound(Exception):
    pass


class Overloaded(Exception):
    pass


class ShuttingDown(Exception):
    """The server is draining (SIGTERM): running requests finish, new ones are refused with 503."""


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


def usage(prompts: list[list[int]], completion_tokens: int, cached: dict) -> dict:
    """A response's `usage`; `cached`: {prompt index: its prompt tokens found in the prefix cache}."""
    prompt_tokens = sum(map(len, prompts))
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(cached.values())}}


@dataclass
class Prepared:
    """A validated request: its prompts, per-prompt parameters and its accounting (opened on admission)."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    tracker: RequestTracker
    echo_texts: list[str] | None = None  # completions' echo: each prompt as text


class OpenAIServing:
    def __init__(self, llm: AsyncLLM, served_model_name: str, metrics: ServerMetrics,
                 limits: RequestLimits | None = None, chat_template: str | None = None,
                 generation_defaults: GenerationDefaults | None = None) -> None:
        self.llm = llm
        # the model's recommended sampling settings, for requests that leave them out (generation_defaults.py)
        self.generation_defaults = generation_defaults or load_generation_defaults(
            llm.config.model, llm.config.generation_config, llm.config.override_generation_config)
        self.model_name = served_model_name
        self.metrics = metrics
        self.limits = limits or RequestLimits()
        self.chat_template = chat_template  # --chat-template (checked at start): replaces the model's
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
        # view takes 0.3-1 s for a 32k vocabulary: `kvgate bench structured-outputs --compare-libraries`)
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
        if len(req.logit_bias or ()) > lim.max_logit_bias:
            raise InvalidRequestError(f"at most {lim.max_logit_bias} entries in logit_bias (--max-logit-bias), got "
                                      f"{len(req.logit_bias)}", param="logit_bias")

    def check_logprobs(self, value: int | None, param: str) -> None:
        if value is not None and value > self.limits.max_logprobs:
            raise InvalidRequestError(f"{param} must be in [0, {self.limits.max_logprobs}] (--max-logprobs), "
                                      f"got {value}", param=param)

    def admit(self, prompts: list[list[int]], params: list[SamplingParams], n: int) -> Prepared:
        """Count a checked request in (503 when draining, dead or full); its tracker's close counts it out."""
        self.check_accepting()
        samples = len(prompts) * n
        self.check_capacity(samples)
        self.in_flight += samples
        self.open_requests += 1

        def release() -> None:
            self.in_flight -= samples
            self.open_requests -= 1

        return Prepared(prompts, params, self.metrics.track(sum(map(len, prompts)), samples, on_close=release,
                                                            num_prompts=len(prompts)))

    # -- prompts and parameters -------------------------------------------------------------------

    def refuse_over_long(self, text: str, special: bool = True, param: str = "prompt") -> None:
        """A 400 for a text of at least max_model_len tokens, found by tokenizing only as much of it as that
        takes (common/bounded_tokenize.py) — a prompt of megabytes costs what a max_model_len one does, not
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

    def template_kwargs(self, chat_template_text: str | None, kwargs: dict | None) -> dict:
        """What a request may pass to the chat template (checked on the event loop: cheap)."""
        return chat_template.template_kwargs(self.llm.tokenizer, chat_template_text, kwargs,
                                             self.limits.trust_request_chat_template, self.chat_template)

    def chat_prompt(self, req: ChatCompletionRequest, template_kwargs: dict) -> list[int]:
        """Render and tokenize the conversation (in the pool)."""
        return chat_template.chat_prompt(self.llm.tokenizer, req, template_kwargs, self.llm.info.max_model_len,
                                         self.refuse_over_long)

    def sampling_params(self, req: SamplingFields, prompt_len: int, max_tokens: int | None,
                        logprobs: int | None, structured_outputs=None) -> SamplingParams:
        limit = self.llm.info.max_model_len
        if prompt_len >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{prompt_len} tokens, which leaves no room for a completion.", param="prompt")
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                "completion). Please reduce the prompt or max_tokens.", param="max_tokens")
        vocab = self.llm.info.vocab_size
        if any(not 0 <= t < vocab for t in req.stop_token_ids or ()):
            raise InvalidRequestError("stop_token_ids must be token ids of this model", param="stop_token_ids")
        logit_bias = token_biases(req.logit_bias, vocab)
        defaults = self.generation_defaults
        max_tokens = defaults.max_tokens_for(max_tokens, limit - prompt_len)
        fields = dict(
            n=req.n, **defaults.fill(dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                          min_p=req.min_p, repetition_penalty=req.repetition_penalty)),
            presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
            seed=req.seed, max_tokens=max_tokens,
            min_tokens=req.min_tokens, stop=req.stop, stop_token_ids=req.stop_token_ids, ignore_eos=req.ignore_eos,
            include_stop_str_in_output=req.include_stop_str_in_output, logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens, structured_outputs=structured_outputs, logit_bias=logit_bias,
        )
        return SamplingParams(**{k: v for k, v in fields.items() if v is not None})

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.llm.tokenizer.decode([token_id])
        return text

    # -- running ----------------------------------------------------------------------------------

    async def run(self, request_id: str, req: SamplingFields,
                  prep: Prepared) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of every prompt as they come, tagged with the prompt's index and counted in its tracker."""
        prompts, params, tracker = prep.prompts, prep.params, prep.tracker
        if tracker.trace is not None:
            tracker.trace.response_id = request_id
        arrival = time.monotonic()
        lora = self.check_model(req.model)  # again: an adapter removed since the request was checked is a 404
        streams = [
            self.llm.generate(f"{request_id}-{i}", ids, p, priority=req.priority, cache_salt=req.cache_salt,
                              arrival_time=arrival, lora_request=lora)
            for i, (ids, p) in enumerate(zip(prompts, params))
        ]
        if len(streams) == 1:
            async for out in streams[0]:
                _count(tracker, out)
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
                    _count(tracker, item)
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, rid: str, req: SamplingFields, prep: Prepared) -> tuple[dict, dict]:
        """Run to the end: ({(prompt index, sample index): final output}, {prompt index: cached tokens})."""
        finals, cached = {}, {}
        try:
            async for i, out in self.run(rid, req, prep):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    if c.finished:
                        finals[(i, c.index)] = c
        finally:
            prep.tracker.close()
        return finals, cached


def token_biases(given: dict[str, float] | None, vocab_size: int) -> dict[int, float] | None:
    """A request's logit_bias with its keys as token ids: JSON keys are strings, each a decimal token id of the
    vocabulary (else a 400 naming logit_bias; the values are SamplingParams' to check)."""
    if not given:
        return None
    biases = {}
    for key, bias in given.items():
        if not _TOKEN_ID.fullmatch(key):
            raise InvalidRequestError(f"logit_bias keys must be token ids (decimal integers), got {key!r:.40}",
                                      param="logit_bias")
        token = int(key)
        if token >= vocab_size:
            raise InvalidRequestError(f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})",
                                      param="logit_bias")
        biases[token] = bias
    return biases


def _count(tracker: RequestTracker, out: RequestOutput) -> None:
    """An output's new tokens and finished samples, in its request's metrics."""
    for c in out.outputs:
        tracker.on_tokens(len(c.delta_token_ids), out.num_cached_tokens or 0)
        if c.finished:
            tracker.on_finished_sample(c.finish_reason, out.metrics)
