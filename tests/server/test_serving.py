"""The OpenAI serving classes over a stand-in AsyncLLM: admission, the completions and chat answers and their SSE
streams, with no engine, server or socket (tests/server's other files run the same paths over HTTP)."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvgate.engine.engine_messages import EngineInfo
from kvgate.common.errors import EngineDeadError, InvalidRequestError
from kvgate.engine.generation_defaults import GenerationDefaults
from kvgate.engine.outputs import CompletionOutput, RequestOutput
from kvgate.engine.server.limits import RequestLimits
from kvgate.engine.server.metrics import ServerMetrics
from kvgate.engine.server.openai_serving import OpenAIServing, Overloaded, ShuttingDown
from kvgate.engine.server.protocol import ChatCompletionRequest, CompletionRequest
from kvgate.engine.server.serving_chat import OpenAIServingChat
from kvgate.engine.server.serving_completion import OpenAIServingCompletion


class FakeTokenizer:
    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 90 + 1 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(64 + t % 26) for t in ids)

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
        text = "".join(m["content"] for m in messages)
        return self.encode(text) if tokenize else text


class FakeLLM:
    """generate() answers each prompt with two steps ("a", then "ab" finished), or raises `fail_with`."""

    def __init__(self) -> None:
        self.info = EngineInfo("m", 64, 100, 16, 32, (0,), "")
        self.tokenizer = FakeTokenizer()
        self.loras: dict = {}
        self.stats = None
        self.error = None
        self.config = None
        self.num_unfinished = 0
        self.num_prefill_tokens_pending = 0
        self.num_prefill_tokens_awaiting_step = 0
        self.step_age_s = 0.0
        self.generated: list[tuple[str, list[int]]] = []
        self.fail_with: Exception | None = None

    async def generate(self, request_id, prompt_token_ids, params, **kwargs):
        self.generated.append((request_id, prompt_token_ids))
        for text, ids, finish in (("a", [1], None), ("ab", [1, 2], "stop")):
            if self.fail_with is not None and finish is not None:
                raise self.fail_with
            outputs = [CompletionOutput(j, text, ids, finish, delta_text=text[-1], delta_token_ids=ids[-1:])
                       for j in range(params.n)]
            yield RequestOutput(request_id, None, prompt_token_ids, outputs, finish is not None,
                                num_cached_tokens=1)


def make(limits: RequestLimits | None = None):
    llm = FakeLLM()
    serving = OpenAIServing(llm, "m", ServerMetrics(llm, "m"), limits, generation_defaults=GenerationDefaults())
    return llm, serving, OpenAIServingCompletion(serving), OpenAIServingChat(serving)


def events(chunks: list[str]) -> list:
    assert all(c.startswith("data: ") and c.endswith("\n\n") for c in chunks)
    return [c[len("data: "):-2] if c == "data: [DONE]\n\n" else json.loads(c[len("data: "):]) for c in chunks]


async def drain(stream) -> list:
    return events([chunk async for chunk in stream])


def test_a_completion_stream_numbers_choices_by_prompt_and_sample_and_releases_its_admission():
    async def main():
        llm, serving, completions, _ = make()
        req = CompletionRequest(prompt=[[5, 6], [7]], n=2, stream=True, stream_options={"include_usage": True})
        prep = await completions.prepare(req)
        assert serving.in_flight == 4 and serving.open_requests == 1
        got = await drain(completions.stream(req, prep))
        assert got[-1] == "[DONE]"
        choices = [e["choices"][0] for e in got[:-2]]
        assert sorted(c["index"] for c in choices if c["finish_reason"] == "stop") == [0, 1, 2, 3]
        assert "".join(c["text"] for c in choices if c["index"] == 3) == "ab"
        assert got[-2]["usage"] == {"prompt_tokens": 3, "completion_tokens": 8, "total_tokens": 11,
                                    "prompt_tokens_details": {"cached_tokens": 2}}
        assert {rid.rsplit("-", 1)[1] for rid, _ in llm.generated} == {"0", "1"}
        assert serving.in_flight == 0 and serving.open_requests == 0

    asyncio.run(main())


def test_an_engine_death_mid_stream_is_an_in_band_503_then_done():
    async def main():
        llm, _, completions, _ = make()
        llm.fail_with = EngineDeadError("the engine stopped: gone")
        req = CompletionRequest(prompt="hi", stream=True)
        got = await drain(completions.stream(req, await completions.prepare(req)))
        assert got[-2] == {"error": {"message": "the engine stopped: gone", "type": "server_error", "param": None,
                                     "code": 503}}
        assert got[-1] == "[DONE]"

    asyncio.run(main())


def test_a_chat_answer_renders_the_conversation_and_counts_usage():
    async def main():
        llm, _, _, chat = make()
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "hey"}])
        body = await chat.response(req, await chat.prepare(req))
        assert llm.generated[0][1] == FakeTokenizer().encode("hey")
        assert body["object"] == "chat.completion" and body["model"] == "m"
        assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "ab"}, "logprobs": None,
                                    "finish_reason": "stop", "stop_reason": None}]
        assert body["usage"]["prompt_tokens"] == 3 and body["usage"]["completion_tokens"] == 2

        stream = await drain(chat.stream(req, await chat.prepare(req)))
        assert stream[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [e["choices"][0]["delta"] for e in stream[1:-1]] == [{"content": "a"}, {"content": "b"}]

    asyncio.run(main())


def test_admission_refuses_when_draining_or_full_and_a_request_template_unless_trusted():
    async def main():
        _, serving, completions, chat = make(RequestLimits(max_queued_requests=2))
        held = await completions.prepare(CompletionRequest(prompt=[[1], [2]]))
        with pytest.raises(Overloaded, match="2 requests are queued"):
            await completions.prepare(CompletionRequest(prompt=[3]))
        held.tracker.close()
        serving.shutting_down = "the server is shutting down"
        with pytest.raises(ShuttingDown):
            await chat.prepare(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}]))
        serving.shutting_down = None
        with pytest.raises(InvalidRequestError) as refused:
            await chat.render(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                                    chat_template="{{ messages }}"))
        assert refused.value.param == "chat_template"

    asyncio.run(main())
