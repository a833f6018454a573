"""/v1/completions (and its /render): prompts to token ids, and the answers, whole or as an SSE stream."""

from __future__ import annotations

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


class OpenAIServingCompletion:
    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving

    async def prepare(self, req: CompletionRequest) -> Prepared:
        self.serving.check_accepting()
        prompts, params = await self.render(req)
        return self.serving.admit(prompts, params, req.n)

    async def render(self, req: CompletionRequest) -> tuple[list[list[int]], list[SamplingParams]]:
        """Every check of /v1/completions and its prompts' token ids and parameters, admitting nothing (what
        /v1/completions/render returns)."""
        serving = self.serving
        serving.check_model(req.model)
        if req.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        texts = prompt_list(req)
        serving.check_request(req, len(texts))
        serving.check_logprobs(req.logprobs, "logprobs")
        prompts = await serving.off_loop(serving.encode_prompts, texts)
        constraint = await serving.off_loop(serving.constraint, req, None, param="structured_outputs")
        params = [serving.sampling_params(req, len(ids), req.max_tokens, req.logprobs, constraint) for ids in prompts]
        return prompts, params

    def _logprobs(self, c, start: int = 0, offset: int = 0) -> dict | None:
        if c.logprobs is None:
            return None
        token_text = self.serving.token_text
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = offset
        for tid, entry in zip(c.token_ids[start:], c.logprobs[start:]):
            text = token_text(tid)
            tokens.append(text)
            token_lps.append(entry[tid].logprob)
            tops.append({token_text(t): lp.logprob for t, lp in entry.items()})
            offsets.append(pos)
            pos += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def response(self, req: CompletionRequest, prep: Prepared) -> dict:
        """The whole answer, once every prompt's samples have finished."""
        rid = f"cmpl-{uuid.uuid4().hex}"
        finals, cached = await self.serving.collect(rid, req, prep)
        n = req.n
        choices = []
        for (i, j), c in sorted(finals.items()):
            choices.append({"index": i * n + j, "text": c.text, "logprobs": self._logprobs(c),
                            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason})
        completion_tokens = sum(len(c.token_ids) for c in finals.values())
        return {"id": rid, "object": "text_completion", "created": int(time.time()),
                "model": self.serving.response_model(req),
                "choices": choices, "usage": usage(prep.prompts, completion_tokens, cached)}

    async def stream(self, req: CompletionRequest, prep: Prepared) -> AsyncIterator[str]:
        """The answer as SSE events; an error after the first event is reported in-band."""
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
                    start = sent_tokens.get(key, 0)
                    sent_tokens[key] = len(c.token_ids)
                    completion_tokens += len(c.token_ids) - start
                    if not c.delta_text and not c.finished and c.logprobs is None:
                        continue
                    lp = self._logprobs(c, start, offsets.get(key, 0))
                    offsets[key] = offsets.get(key, 0) + len(c.delta_text)
                    choice = {"index": i * req.n + c.index, "text": c.delta_text, "logprobs": lp,
                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
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
