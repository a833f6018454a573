"""Completions' echo and logit_bias inputs at their limits, over the serving classes with a stand-in engine: each is
taken at its bound and is a 400 naming its field one past it."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.common.errors import InvalidRequestError
from kvgate.engine.server.limits import RequestLimits
from kvgate.engine.server.protocol import CompletionRequest
from tests.server.test_serving import make

VOCAB = 100  # the stand-in engine's (tests/server/test_serving.FakeLLM)


def render(limits: RequestLimits | None = None, **body):
    _, _, completions, _ = make(limits)
    return asyncio.run(completions.render(CompletionRequest(**body)))


def refused(param: str, limits: RequestLimits | None = None, **body) -> str:
    with pytest.raises(InvalidRequestError) as info:
        render(limits, **body)
    assert info.value.param == param, (info.value.param, str(info.value))
    return str(info.value)


def test_echo_with_logprobs_scores_at_most_max_prompt_logprob_tokens():
    limits = RequestLimits(max_prompt_logprob_tokens=12)
    prompts, params = render(limits, prompt=[[1, 2, 3], [4, 5, 6]], n=2, echo=True, logprobs=1, max_tokens=0)
    assert sum(map(len, prompts)) * 2 == 12
    assert [(p.prompt_logprobs, p.logprobs, p.max_tokens) for p in params] == [(1, 1, 1)] * 2
    message = refused("echo", limits, prompt=[[1, 2, 3], [4, 5, 6, 7]], n=2, echo=True, logprobs=1, max_tokens=0)
    assert "14 prompt tokens" in message and "--max-prompt-logprob-tokens" in message
    # echo without logprobs scores nothing: not counted
    _, params = render(limits, prompt=[[1, 2, 3], [4, 5, 6, 7]], n=2, echo=True, max_tokens=0)
    assert all(p.prompt_logprobs is None for p in params)


def test_logprobs_of_echo_at_max_logprobs():
    limits = RequestLimits(max_logprobs=5)
    _, params = render(limits, prompt="hi", echo=True, logprobs=5)
    assert params[0].prompt_logprobs == params[0].logprobs == 5
    refused("logprobs", limits, prompt="hi", echo=True, logprobs=6)
    _, params = render(prompt="hi", echo=True, logprobs=20)  # the default and most, vLLM's
    assert params[0].prompt_logprobs == 20
    refused("logprobs", prompt="hi", echo=True, logprobs=21)


def test_max_tokens_0_only_with_echo():
    _, params = render(prompt="hi", echo=True, max_tokens=0)
    assert params[0].max_tokens == 1  # one token ends the prefill; the answer leaves it out
    refused("max_tokens", prompt="hi", max_tokens=0)
    refused("max_tokens", prompt="hi", echo=True, max_tokens=-1)


def test_logit_bias_at_its_count_and_the_vocabulary_edge():
    limits = RequestLimits(max_logit_bias=3)
    _, params = render(limits, prompt="hi", logit_bias={"0": 1, "1": -100, str(VOCAB - 1): 100})
    assert params[0].logit_bias == {0: 1, 1: -100, VOCAB - 1: 100}
    refused("logit_bias", limits, prompt="hi", logit_bias={str(t): 1 for t in range(4)})
    refused("logit_bias", prompt="hi", logit_bias={str(VOCAB): 1})
    refused("logit_bias", prompt="hi", logit_bias={"1": 100.5})


def test_vllm_prompt_logprobs_field_at_its_limits():
    _, params = render(prompt="hi", prompt_logprobs=20)
    assert params[0].prompt_logprobs == 20 and params[0].logprobs is None
    refused("prompt_logprobs", prompt="hi", prompt_logprobs=21)
    refused("prompt_logprobs", prompt="hi", prompt_logprobs=1, stream=True)  # vLLM's rule: not streamed
    limits = RequestLimits(max_prompt_logprob_tokens=3)
    render(limits, prompt=[[1, 2, 3]], prompt_logprobs=0)
    refused("echo", limits, prompt=[[1, 2, 3, 4]], prompt_logprobs=0)
