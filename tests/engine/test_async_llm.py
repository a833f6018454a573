"""AsyncLLM over a stand-in EngineClient, and EngineLoop over a stand-in engine: the front's request streams,
aborts, LoRA calls, death and hang handling, and the loop's command handling, with no thread, process or
socket (the real transports are exercised end to end by tests/server)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from kvgate.engine.async_llm import AsyncLLM
from kvgate.engine.engine_client import (ENGINE_CLIENTS, EngineClient, ProcessEngineClient, ThreadEngineClient,
                                         make_engine_client)
from kvgate.engine.engine_loop import EngineLoop
from kvgate.engine.engine_messages import (AbortRequest, AddRequest, ArrivalProbe, EngineInfo, LoRACall, LoRAReply,
                                           RequestFailed, Shutdown, StepResult)
from kvgate.common.errors import EngineDeadError, EngineError
from kvgate.engine.llm_engine import EngineStats
from kvgate.engine.outputs import CompletionOutput, RequestOutput
from kvgate.engine.sampling_params import SamplingParams

INFO = EngineInfo("m", 64, 100, 16, 32, (0,), "")
STATS = EngineStats(0, 0, 0.0, 32, 16, 0, 0, 0)


class FakeClient(EngineClient):
    """Records commands; the test plays the loop through `report` and `die`."""

    mode = "fake"

    def __init__(self) -> None:
        self.sent: list = []
        self.abandoned = self.shut_down = False
        self.on_result = self.on_death = None

    async def start(self, on_result, on_death):
        self.on_result, self.on_death = on_result, on_death
        return INFO, "tokenizer"

    def send(self, command) -> None:
        self.sent.append(command)

    def is_alive(self) -> bool:
        return self.on_result is not None and not self.shut_down

    def abandon(self) -> None:
        self.abandoned = True

    async def shutdown(self) -> None:
        self.shut_down = True

    def report(self, outputs=(), failures=(), adds=0, replies=()) -> None:
        self.on_result(StepResult(list(outputs), list(failures), STATS, adds, list(replies)))

    def sent_of(self, kind) -> list:
        return [c for c in self.sent if isinstance(c, kind)]


def output(rid: str, text: str, finish_reason: str | None = None) -> RequestOutput:
    return RequestOutput(rid, None, [1], [CompletionOutput(0, text, [1], finish_reason)], finish_reason is not None)


async def started(**kwargs) -> tuple[AsyncLLM, FakeClient]:
    client = FakeClient()
    llm = AsyncLLM(SimpleNamespace(model="m"), client=client, **kwargs)
    await llm.start()
    return llm, client


async def until(predicate, timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.001)


def test_the_client_is_chosen_once_by_engine_loop():
    assert ENGINE_CLIENTS == {"thread": ThreadEngineClient, "process": ProcessEngineClient}
    assert isinstance(make_engine_client("thread", None), ThreadEngineClient)
    assert AsyncLLM(None, "process").mode == "process"
    with pytest.raises(ValueError, match="engine_loop must be thread or process, got 'fiber'"):
        AsyncLLM(None, "fiber")
    with pytest.raises(ValueError, match="step_timeout must be > 0"):
        AsyncLLM(None, "thread", step_timeout=0)


def test_a_request_streams_its_outputs_and_ends_when_finished():
    async def main():
        llm, client = await started()
        assert llm.ready and llm.tokenizer == "tokenizer" and llm.mode == "fake"
        got = []

        async def consume():
            async for out in llm.generate("r", [1, 2, 3], SamplingParams(n=2)):
                got.append(out.outputs[0].text)

        task = asyncio.create_task(consume())
        await until(lambda: client.sent_of(AddRequest))
        assert llm.num_unfinished == 1 and llm.num_prefill_tokens_pending == 6  # 3 tokens x n=2, unreported
        client.report([output("r", "a")], adds=1)
        client.report([output("r", "ab", "stop")])
        await task
        assert got == ["a", "ab"] and llm.num_unfinished == 0 and llm.num_prefill_tokens_pending == 0
        assert not client.sent_of(AbortRequest)  # finished: nothing to abort
        await llm.shutdown()
        assert client.shut_down and llm.info is None

    asyncio.run(main())


def test_leaving_a_stream_early_aborts_it_and_a_failure_reaches_its_request():
    async def main():
        llm, client = await started()
        stream = llm.generate("r", [1], SamplingParams())
        first = asyncio.ensure_future(stream.__anext__())
        await until(lambda: client.sent_of(AddRequest))
        client.report([output("r", "a")])
        await first
        await stream.aclose()
        assert [c.request_id for c in client.sent_of(AbortRequest)] == ["r"]

        failing = llm.generate("bad", [1], SamplingParams())
        pending = asyncio.ensure_future(failing.__anext__())
        await until(lambda: len(client.sent_of(AddRequest)) == 2)
        client.report(failures=[RequestFailed("bad", ValueError("refused"))])
        with pytest.raises(ValueError, match="refused"):
            await pending
        assert len(client.sent_of(AbortRequest)) == 1  # it never entered the engine: no abort
        waiting = asyncio.ensure_future(llm.generate("dup", [1], SamplingParams()).__anext__())
        await until(lambda: len(client.sent_of(AddRequest)) == 3)
        with pytest.raises(EngineError, match="already in use"):
            await llm.generate("dup", [1], SamplingParams()).__anext__()
        waiting.cancel()

    asyncio.run(main())


def test_lora_calls_are_answered_by_the_loops_replies():
    async def main():
        llm, client = await started()
        add = asyncio.ensure_future(llm.add_lora("a", "/adapters/a"))
        await until(lambda: client.sent_of(LoRACall))
        call = client.sent_of(LoRACall)[0]
        assert call.lora.lora_name == "a" and call.lora.lora_int_id == 1
        client.report(replies=[LoRAReply(call.call_id, None)])
        assert (await add).lora_name == "a" and "a" in llm.loras

        remove = asyncio.ensure_future(llm.remove_lora("a"))
        await until(lambda: len(client.sent_of(LoRACall)) == 2)
        assert "a" not in llm.loras  # refused for new requests at once
        client.report(replies=[LoRAReply(client.sent_of(LoRACall)[1].call_id, True)])
        assert await remove is True
        assert await llm.remove_lora("a") is False

    asyncio.run(main())


def test_a_death_fails_every_waiting_request_once_and_calls_on_dead():
    async def main():
        deaths = []
        llm, client = await started(on_dead=deaths.append)
        pending = asyncio.ensure_future(llm.generate("r", [1], SamplingParams()).__anext__())
        lora = asyncio.ensure_future(llm.add_lora("a", "/a"))
        await until(lambda: client.sent_of(LoRACall))
        boom = RuntimeError("the engine process was killed by SIGKILL")
        client.on_death(boom)  # as the client does, from its own thread
        with pytest.raises(EngineDeadError, match="SIGKILL"):
            await pending
        with pytest.raises(EngineDeadError):
            await lora
        client.on_death(RuntimeError("again"))
        await asyncio.sleep(0.01)
        assert deaths == [boom] and llm.error is boom and not llm.ready
        assert not client.sent_of(AbortRequest)  # a dead engine is not asked to abort
        with pytest.raises(EngineError, match="the engine stopped"):
            await llm.generate("later", [1], SamplingParams()).__anext__()

    asyncio.run(main())


def test_arrival_probes_count_unreported_requests_by_their_uncached_prompt():
    async def main():
        llm, client = await started()
        streams = [asyncio.ensure_future(llm.generate(f"r{i}", [1] * 100, SamplingParams()).__anext__())
                   for i in range(3)]
        await until(lambda: len(client.sent_of(AddRequest)) == 3)
        assert llm.num_prefill_tokens_pending == 300  # unprobed, unreported: whole
        client.on_result(ArrivalProbe(2, 4))  # the second found 96 tokens cached
        await until(lambda: llm.num_prefill_tokens_pending == 204)
        client.on_result(ArrivalProbe(1, 100))  # the first found nothing
        client.on_result(ArrivalProbe(3, 20))
        await until(lambda: llm.num_prefill_tokens_pending == 124)
        client.report(adds=2)  # the loop took the first two: its stats (STATS: 0 pending) now hold them
        await until(lambda: llm.num_prefill_tokens_pending == 20)
        client.on_result(ArrivalProbe(2, 50))  # late, for a request a report covered: ignored
        client.on_result(ArrivalProbe(9, 50))  # for no request sent: ignored
        await asyncio.sleep(0.01)
        assert llm.num_prefill_tokens_pending == 20
        client.report(adds=3)
        await until(lambda: llm.num_prefill_tokens_pending == 0)
        for s in streams:
            s.cancel()
        await asyncio.gather(*streams, return_exceptions=True)

    asyncio.run(main())


@pytest.mark.parametrize("probes", [False, True])
def test_a_silent_loop_is_declared_hung_and_abandoned(probes):
    """probes: an engine process's pipe reader keeps answering arrival probes while its loop hangs; they are no
    steps, so the loop is declared hung all the same."""
    async def main():
        deaths = []
        llm, client = await started(on_dead=deaths.append, step_timeout=0.2)
        pending = asyncio.ensure_future(llm.generate("r", [1], SamplingParams()).__anext__())

        async def probe_forever():
            for _ in range(200):
                client.on_result(ArrivalProbe(1, 1))
                await asyncio.sleep(0.02)

        prober = asyncio.ensure_future(probe_forever()) if probes else None
        with pytest.raises(EngineDeadError, match="hung: no step completed"):
            await asyncio.wait_for(pending, 5)
        if prober is not None:
            prober.cancel()
        assert client.abandoned and len(deaths) == 1

    asyncio.run(main())


def test_a_death_after_shutdown_is_not_a_death():
    async def main():
        deaths = []
        llm, client = await started(on_dead=deaths.append)
        await llm.shutdown()
        client.on_death(RuntimeError("the engine process closed its pipe"))
        await asyncio.sleep(0.01)
        assert deaths == [] and llm.error is None

    asyncio.run(main())


class StubEngine:
    """What EngineLoop calls on an LLMEngine; one step finishes every request."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        self.calls: list = []
        self.closed = False
        self.scheduler = SimpleNamespace(num_prefill_tokens_pending=0)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, request_id, prompt_token_ids, params, **kwargs) -> None:
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        self.requests.append(request_id)

    def abort_request(self, request_id) -> None:
        self.calls.append(("abort", request_id))
        self.requests.remove(request_id)

    def add_lora(self, lora) -> None:
        raise RuntimeError("no LoRA here")

    def remove_lora(self, name) -> bool:
        return name == "a"

    def step(self) -> list[RequestOutput]:
        done, self.requests = self.requests, []
        return [output(rid, "x", "length") for rid in done]

    def take_failures(self) -> list:
        return []

    def stats(self) -> EngineStats:
        return STATS

    def close(self) -> None:
        self.closed = True


def test_the_engine_loop_applies_commands_reports_steps_and_stops_on_shutdown():
    engine = StubEngine()
    commands = [AddRequest("r1", [1], SamplingParams()), AddRequest("bad", [], SamplingParams()),
                LoRACall(7, name="a"), LoRACall(8, lora=SimpleNamespace()), AddRequest("r2", [1], SamplingParams()),
                AbortRequest("r2"), None, Shutdown()]
    sent: list[StepResult] = []

    def receive(timeout):
        return commands.pop(0)

    EngineLoop(engine, receive, sent.append).run()
    assert engine.closed and engine.calls == [("abort", "r2")]
    # What the commands did is reported before the step that takes them (the server times the step from there and
    # counts the taken requests as the engine's), then the step's outputs.
    assert len(sent) == 2
    taken, step = sent
    assert taken.outputs == [] and taken.adds_received == 3 and taken.stats is STATS
    assert [(f.request_id, str(f.error)) for f in taken.failures] == [("bad", "empty prompt")]
    assert taken.lora_replies[0] == LoRAReply(7, True)
    assert isinstance(taken.lora_replies[1].result, RuntimeError)
    assert [o.request_id for o in step.outputs] == ["r1"] and step.adds_received == 3
    assert step.failures == [] and step.lora_replies == []
