"""/v1/completions (and its /render): prompts to token ids, and the answers, whole or as an SSE stream."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator

from kvgate.common.errors import InvalidRequestError
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.server.openai_serving import OpenAIServing, Prepared, sse, stream_error, usage
from kvgate.engine.server.protocol import CompletionRequest


def prompt_list(req: CompletionRequest) -> list:
    """The request's prompts: one text, one list of token ids, or a list of either."""
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


# The most negative logprob an answer carries: JSON has no -Infinity (vLLM's and OpenAI's floor).
LOGPROB_FLOOR = -9999.0


class OpenAIServingCompletion:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def prepare(self, req: CompletionRequest) -> Prepared:
        self.serving.check_accepting()
        prompts, params = await self.render(req)
        echo_texts = await self.serving.off_loop(self.echo_texts, req, prompts) if req.echo else None
        prep = self.serving.admit(prompts, params, req.n)
        prep.echo_texts = echo_texts
        return prep

    async def render(self, req: CompletionRequest) -> tuple[list[list[int]], list[SamplingParams]]:
        """Every check of /v1/completions and its prompts' token ids and parameters, admitting nothing (what
        /v1/completions/render returns)."""
        serving = self.serving
        serving.check_model(req.model)
        texts = prompt_list(req)
        serving.check_request(req, len(texts))
        serving.check_logprobs(req.logprobs, "logprobs")
        prompts = await serving.off_loop(serving.encode_prompts, texts)
        prompt_logprobs = self.prompt_logprobs(req)
        if prompt_logprobs is not None:
            self.check_prompt_logprob_tokens(prompts, req.n)
        constraint = await serving.off_loop(serving.constraint, req, None, param="structured_outputs")
        # echo with max_tokens 0 answers the prompt alone: the engine samples one token (its prefill's end), which
        # the answer leaves out (vLLM's way)
        max_tokens = 1 if req.echo and req.max_tokens == 0 else req.max_tokens
        params = [serving.sampling_params(req, len(ids), max_tokens, req.logprobs, constraint) for ids in prompts]
        if prompt_logprobs is not None:
            params = [dataclasses.replace(p, prompt_logprobs=prompt_logprobs) for p in params]
        return prompts, params

    def prompt_logprobs(self, req: CompletionRequest) -> int | None:
        """The top-k the prompt's tokens are scored with: vLLM's prompt_logprobs when given, else echo's logprobs."""
        if req.prompt_logprobs is None:
            return req.logprobs if req.echo else None
        self.serving.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
        if req.stream:  # vLLM's rule: a stream's events have no place for them
            raise InvalidRequestError("prompt_logprobs are not available when stream is true",
                                      param="prompt_logprobs")
        return req.prompt_logprobs

    def check_prompt_logprob_tokens(self, prompts: list[list[int]], n: int) -> None:
        limit = self.serving.limits.max_prompt_logprob_tokens
        count = sum(map(len, prompts)) * n
        if count > limit:
            raise InvalidRequestError(f"echo with logprobs over {count} prompt tokens (prompts x n); at most {limit} "
                                      "(--max-prompt-logprob-tokens)", param="echo")

    def echo_texts(self, req: CompletionRequest, prompts: list[list[int]]) -> list[str]:
        """Each prompt as echo writes it: a text as given, token ids decoded (in the pool)."""
        tok = self.serving.llm.tokenizer
        return [x if isinstance(x, str) else tok.decode(ids) for x, ids in zip(prompt_list(req), prompts)]

    def _logprobs(self, token_ids: list[int], entries: list, offset: int = 0) -> dict:
        """OpenAI's completions logprobs over tokens and their entries ({token id: Logprob}; None: the first prompt
        token, which has none)."""
        token_text = self.serving.token_text
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = offset
        for tid, entry in zip(token_ids, entries):
            text = token_text(tid)
            tokens.append(text)
            if entry is None:
                token_lps.append(None)
                tops.append(None)
            else:
                token_lps.append(max(entry[tid].logprob, LOGPROB_FLOOR))
                tops.append({token_text(t): max(lp.logprob, LOGPROB_FLOOR) for t, lp in entry.items()})
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _choice(self, req: CompletionRequest, prep: Prepared, i: int, c, prompt_lps, echo: bool,
                start: int | None = None, offset: int = 0) -> tuple[dict, int]:
        """One choice and its completion tokens: whole (start None), or a stream's delta from output token `start`
        at text offset `offset`; echo: the prompt leads it (a stream's first delta)."""
        text = c.text if start is None else c.delta_text
        ids, entries = c.token_ids[start or 0:], (c.logprobs or [])[start or 0:]
        finish, stop = c.finish_reason, c.stop_reason
        completion_tokens = len(ids)
        if req.echo and req.max_tokens == 0:  # the prompt alone; its sampled token is not the client's
            text, ids, entries = (prep.echo_texts[i], prep.prompts[i], prompt_lps) if echo else ("", [], [])
            finish, stop = ("length", None) if c.finished else (None, None)
            completion_tokens = 0
        elif echo:
            text = prep.echo_texts[i] + text
            ids, entries = prep.prompts[i] + ids, (prompt_lps or []) + entries
        logprobs = self._logprobs(ids, entries, offset) if req.logprobs is not None else None
        choice = {"index": i * req.n + c.index, "text": text, "logprobs": logprobs, "finish_reason": finish,
                  "stop_reason": stop}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(prompt_lps or [])
        return choice, completion_tokens

    def _vllm_prompt_logprobs(self, entries: list) -> list:
        """vLLM's choice.prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
        decoded_token}}."""
        token_text = self.serving.token_text
        return [None if entry is None else
                {str(t): {"logprob": max(lp.logprob, LOGPROB_FLOOR), "rank": lp.rank, "decoded_token": token_text(t)}
                 for t, lp in entry.items()} for entry in entries]

    async def response(self, req: CompletionRequest, prep: Prepared) -> dict:
        """The whole answer, once every prompt's samples have finished."""
        rid = f"cmpl-{uuid.uuid4().hex}"
        finals, cached, prompt_lps = {}, {}, {}
        try:
            async for i, out in self.serving.run(rid, req, prep):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    if out.prompt_logprobs is not None:
                        prompt_lps[(i, c.index)] = out.prompt_logprobs
                    if c.finished:
                        finals[(i, c.index)] = c
        finally:
            prep.tracker.close()
        choices, completion_tokens = [], 0
        for (i, j), c in sorted(finals.items()):
            choice, count = self._choice(req, prep, i, c, prompt_lps.get((i, j)), req.echo)
            choices.append(choice)
            completion_tokens += count
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.serving.response_model(req),
                "choices": choices, "usage": usage(prep.prompts, completion_tokens, cached)}

    async def stream(self, req: CompletionRequest, prep: Prepared) -> AsyncIterator[str]:
        """The answer as SSE events; an error after the first event is reported in-band. With echo a sample's first
        event leads with its prompt (and the prompt's logprobs)."""
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        model = self.serving.response_model(req)
        sent_tokens: dict[tuple[int, int], int] = {}
        offsets: dict[tuple[int, int], int] = {}
        completion_tokens, cached = 0, {}
        try:
            async for i, out in self.serving.run(rid, req, prep):
                cached[i] = out.num_cached_tokens
                for c in out.outputs:
                    key = (i, c.index)
                    echo = req.echo and key not in sent_tokens
                    start = sent_tokens.get(key, 0)
                    sent_tokens[key] = len(c.token_ids)
                    if not (req.echo and req.max_tokens == 0):  # counted whether or not an event carries them
                        completion_tokens += len(c.token_ids) - start
                    if not echo and not c.delta_text and not c.finished and c.logprobs is None:
                        continue
                    choice, _ = self._choice(req, prep, i, c, out.prompt_logprobs, echo, start, offsets.get(key, 0))
                    offsets[key] = offsets.get(key, 0) + len(choice["text"])
                    yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                               "choices": [choice]})
            if req.stream_options and req.stream_options.include_usage:
                yield sse({"id": rid, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": usage(prep.prompts, completion_tokens, cached)})
        except Exception as exc:  # noqa: BLE001 - the stream has started: report in-band
            yield sse(stream_error(exc))
        finally:
            prep.tracker.close()
        yield sse("[DONE]")
