"""Async front over the engine for the HTTP server: per-request streams, LoRA calls, death and hang detection.

The engine loop runs apart from the asyncio server, in a thread or in a process of its own (`--engine-loop
thread|process`); an EngineClient (engine/engine_client.py), chosen once at construction, is the only thing
here that knows which. Its step reports feed per-request asyncio queues. A request whose consumer goes away
(client disconnect, cancellation) is aborted in the engine, freeing its blocks.

A loop that dies (the client reports it at once) fails every waiting request with an EngineDeadError and calls
`on_dead` (the server turns unhealthy).

A loop that hangs (stuck in one step, as in a deadlocked kernel) raises nothing and closes nothing, so a
watchdog on the event loop takes its place (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S): while requests wait, the
loop reports every step (a step without outputs at most every HEARTBEAT_S, engine/engine_loop.py), and when
none has been reported for `step_timeout` seconds the engine is declared dead the same way (errors, `on_dead`)
and abandoned: an engine process is killed (it holds the accelerator); an engine thread cannot be killed, and
the server exits anyway unless kept alive to be inspected.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable

from kvgate.engine.config import DEFAULT_STEP_TIMEOUT_S, EngineConfig
from kvgate.engine.engine_client import EngineClient, make_engine_client
from kvgate.engine.engine_messages import AbortRequest, AddRequest, ArrivalProbe, EngineInfo, LoRACall, StepResult
from kvgate.common.errors import EngineDeadError, EngineError, LoRAError
from kvgate.engine.llm_engine import EngineStats
from kvgate.engine.lora.request import LoRARequest
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, config: EngineConfig, engine_loop: str = "thread",
                 on_dead: Callable[[BaseException], None] | None = None,
                 step_timeout: float = DEFAULT_STEP_TIMEOUT_S, *, client: EngineClient | None = None) -> None:
        """`client`: the way to the engine loop; by default the one `engine_loop` names (tests pass a stand-in)."""
        if client is None:
            client = make_engine_client(engine_loop, config)
        if not step_timeout > 0:
            raise ValueError(f"step_timeout must be > 0, got {step_timeout}")
        self.config = config
        self._client = client
        self.mode = client.mode
        self.info: EngineInfo | None = None
        self.tokenizer = None
        self.stats: EngineStats | None = None
        self.error: BaseException | None = None  # the engine loop died
        self.on_dead = on_dead  # called once, on the event loop, when the engine loop dies
        self._stopping = False  # shutdown() asked the loop to stop: its end is no death
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.step_timeout = step_timeout
        self._reported_at = 0.0  # when the loop last reported a step (monotonic; written by the loop's side)
        self._waiting_since = 0.0  # when requests started waiting after none were (a report's clock starts)
        self._watchdog: asyncio.Task | None = None
        # Prefill of requests sent to the loop that its last report did not yet include: (add number, prompt tokens
        # x n, or the uncached ones once its ArrivalProbe came). Only the event loop touches these.
        self._adds_sent = 0
        self._unreported_adds: collections.deque[tuple[int, int]] = collections.deque()
        self._unreported_prefill_tokens = 0
        # LoRA adapters as the engine serves them (the front gives out their ids), and calls awaiting replies.
        self.loras: dict[str, LoRARequest] = {}
        self._next_lora_id = 1
        self._lora_calls: dict[int, asyncio.Future] = {}
        self._lora_call_ids = itertools.count()

    @property
    def ready(self) -> bool:
        return self.info is not None and self.error is None

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    @property
    def num_prefill_tokens_pending(self) -> int:
        """The engine's prefill backlog at its last report, plus the prompts sent to it since, which it has not
        reported yet: each one's uncached tokens as its ArrivalProbe found them, its whole prompt until then."""
        engine = self.stats.num_prefill_tokens_pending if self.stats is not None else 0
        return engine + self._unreported_prefill_tokens

    @property
    def num_prefill_tokens_awaiting_step(self) -> int:
        """Of num_prefill_tokens_pending, the prompts of requests the engine has not reported yet. The loop reports
        the commands it took before the step that takes them (engine_loop), so no running step computes these."""
        return self._unreported_prefill_tokens

    @property
    def step_age_s(self) -> float:
        """How long the engine's current step has run: seconds since its last report (the loop reports after every
        step, and before one that takes new commands), or since requests started waiting after none were; 0 when it
        has no requests. With the gauges above it tells a router how much of the reported backlog the running step
        has computed by now (docs/engine.md)."""
        if not self._queues:
            return 0.0
        return max(time.monotonic() - max(self._reported_at, self._waiting_since), 0.0)

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Build the engine (in its thread or process) and start its loop; raises if building fails."""
        self._loop = asyncio.get_running_loop()
        info, self.tokenizer = await self._client.start(self._post, self._on_death)
        self.info = info
        self.loras = {lora.lora_name: lora for lora in info.loras}
        self._next_lora_id = max((lora.lora_int_id for lora in info.loras), default=0) + 1
        self._watchdog = asyncio.create_task(self._watch_steps())
        log.info("engine loop started (%s): %s, %d KV blocks", self.mode, info.model_name, info.num_blocks)

    def _post(self, result: StepResult | ArrivalProbe) -> None:
        """A step report or an arrival probe, on the client's thread."""
        if isinstance(result, ArrivalProbe):  # not a step: it must not make a hung loop look alive
            self._loop.call_soon_threadsafe(self._probed, result)
            return
        # stamped here, on the loop's side, not in _dispatch: a busy event loop must not look like a hung engine
        self._reported_at = time.monotonic()
        self._loop.call_soon_threadsafe(self._dispatch, result)

    def _on_death(self, exc: BaseException) -> None:
        """The client's report that the loop ended unasked, on the client's thread."""
        log.error("engine loop failed", exc_info=exc)  # surfaces as 503s and in /health
        self._loop.call_soon_threadsafe(self._fail_all, exc)

    async def _watch_steps(self) -> None:
        """Declare the engine dead when requests wait and no step has been reported for `step_timeout` s."""
        interval = min(1.0, self.step_timeout / 4)
        while self.error is None and not self._stopping:
            await asyncio.sleep(interval)
            silent = self.step_age_s
            if silent > self.step_timeout:
                self._client.abandon()  # first: the end of the loop it may cause is then no second death
                self._fail_all(RuntimeError(
                    f"the engine loop is hung: no step completed in {silent:.1f} s while {len(self._queues)} "
                    f"requests waited (--engine-step-timeout {self.step_timeout:g})"))
                return

    def _probed(self, probe: ArrivalProbe) -> None:
        """Count a request the loop has not reported yet by what its prompt found in the prefix cache."""
        unreported = self._unreported_adds
        i = probe.add_number - unreported[0][0] if unreported else -1
        if 0 <= i < len(unreported):  # else a report covered it first: the engine's own count rules
            number, tokens = unreported[i]
            unreported[i] = (number, probe.uncached_tokens)
            self._unreported_prefill_tokens += probe.uncached_tokens - tokens

    def _dispatch(self, result: StepResult) -> None:
        self.stats = result.stats
        unreported = self._unreported_adds
        while unreported and unreported[0][0] <= result.adds_received:
            self._unreported_prefill_tokens -= unreported.popleft()[1]
        for failure in result.failures:
            q = self._queues.get(failure.request_id)
            if q is not None:
                q.put_nowait(failure.error)
        for out in result.outputs:
            q = self._queues.get(out.request_id)
            if q is not None:
                q.put_nowait(out)
        for reply in result.lora_replies:
            future = self._lora_calls.pop(reply.call_id, None)
            if future is not None and not future.done():
                future.set_result(reply.result)

    def _fail_all(self, exc: BaseException) -> None:
        if self.error is not None or self._stopping:
            return
        self.error = exc
        log.error("the engine loop died (%s): failing %d in-flight requests", exc, len(self._queues))
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(f"the engine stopped: {exc}"))
        for future in self._lora_calls.values():
            if not future.done():
                future.set_exception(EngineDeadError(f"the engine stopped: {exc}"))
        self._lora_calls.clear()
        if self.on_dead is not None:
            self.on_dead(exc)

    def abort_all(self, reason: str) -> int:
        """Fail every waiting request with EngineError(reason) (their streams abort them in the engine)."""
        for q in self._queues.values():
            q.put_nowait(EngineError(reason))
        return len(self._queues)

    async def shutdown(self) -> None:
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        await self._client.shutdown()
        self.info = None

    # -- LoRA adapters ----------------------------------------------------------------------------

    async def _lora_call(self, call: LoRACall):
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}")
        future = self._loop.create_future()
        self._lora_calls[call.call_id] = future
        try:
            self._client.send(call)
        except EngineError:
            self._lora_calls.pop(call.call_id, None)
            raise
        result = await future
        if isinstance(result, BaseException):
            raise result
        return result

    async def add_lora(self, name: str, path: str) -> LoRARequest:
        """Serve the PEFT adapter in `path` as model `name`; LoRAError when it cannot be served."""
        if name in self.loras or name == (self.info.model_name if self.info else None):
            raise LoRAError(f"the model name {name!r} is already served", param="lora_name")
        lora = LoRARequest(name, self._next_lora_id, path)
        self._next_lora_id += 1  # ids are never reused, even when this add fails
        await self._lora_call(LoRACall(next(self._lora_call_ids), lora=lora))
        self.loras[name] = lora
        return lora

    async def remove_lora(self, name: str) -> bool:
        """Stop serving adapter `name` (requests already running with it finish); False if it is not served."""
        if self.loras.pop(name, None) is None:  # new requests for it are refused from now on
            return False
        return bool(await self._lora_call(LoRACall(next(self._lora_call_ids), name=name)))

    # -- requests ---------------------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                       priority: int = 0, cache_salt: str | None = None, arrival_time: float | None = None,
                       lora_request: LoRARequest | None = None) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; leaving the iteration early aborts it in the engine."""
        if self.error is not None:
            raise EngineError(f"the engine stopped: {self.error}")
        if request_id in self._queues:
            raise EngineError(f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        if not self._queues:
            self._waiting_since = time.monotonic()
        self._queues[request_id] = q
        finished = False
        try:
            self._client.send(AddRequest(request_id, prompt_token_ids, params, priority, cache_salt, arrival_time,
                                  lora_request))
            self._adds_sent += 1
            tokens = len(prompt_token_ids) * params.n
            self._unreported_adds.append((self._adds_sent, tokens))
            self._unreported_prefill_tokens += tokens
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    finished = True  # never entered the engine (or the engine is gone)
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and self.error is None and not self._stopping:
                try:
                    self._client.send(AbortRequest(request_id))
                except EngineError:
                    pass  # the engine is gone: nothing left to abort
