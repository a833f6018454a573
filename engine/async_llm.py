"""Async front over the engine for the HTTP server.

The engine loop runs apart from the asyncio server — in a thread of the server process or in a process
of its own (`--engine-loop thread|process`) — and feeds per-request asyncio queues. Messages are plain
picklable objects, so both modes share one loop (`EngineLoop`) and one front (`AsyncLLM`). A request
whose consumer goes away (client disconnect, cancellation) is aborted in the engine, freeing its blocks.

A loop that dies — an exception in the thread, or the engine process exiting for any reason (an exception,
SIGKILL, the OOM killer) — is noticed at once: an exception is reported over the pipe before the process
exits, and any end of the pipe that `shutdown()` did not ask for is a death, whatever the exit code says
(a process that is killed closes its end before it can be reaped, so its exit code may still read None).
Every waiting request then gets an EngineDeadError and `on_dead` is called (the server turns unhealthy).

A loop that hangs — stuck in one step, as in a deadlocked kernel — raises nothing and closes nothing, so a
watchdog on the event loop takes its place (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S): while requests wait, the
loop reports every step (a step without outputs at most every HEARTBEAT_S), and when none has been reported
for `step_timeout` seconds the engine is declared dead the same way — errors, `on_dead` — and an engine
process is killed (it holds the accelerator; an engine thread cannot be killed, and the server exits anyway
unless kept alive to be inspected).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import multiprocessing
import queue
import itertools
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kvgate.engine.config import EngineConfig
from kvgate.engine.errors import EngineDeadError, EngineError, LoRAError
from kvgate.engine.llm_engine import EngineStats, LLMEngine
from kvgate.engine.lora.request import LoRARequest
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# A busy loop whose steps produce no output (a long chunked prefill) still reports this often, so the
# watchdog sees it is alive; a step that does produce output is reported at once anyway.
HEARTBEAT_S = 0.25
# vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S default: far above any sane step (a full 2048-token batch of a large
# model on a slow accelerator takes seconds), far below a client's patience.
DEFAULT_STEP_TIMEOUT_S = 60.0


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float | None = None
    lora_request: LoRARequest | None = None


@dataclass
class LoRACall:
    """Add (`lora`) or remove (`name`) an adapter; answered by a LoRAReply with the same call id."""

    call_id: int
    lora: LoRARequest | None = None
    name: str | None = None


@dataclass
class LoRAReply:
    call_id: int
    result: object  # add: None; remove: whether it existed; or the exception it raised


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Shutdown:
    pass


@dataclass
class EngineInfo:
    """What the front needs to know about the engine, sent once when it is ready."""

    model_name: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    eos_token_ids: tuple[int, ...]
    tokenizer_path: str
    loras: list[LoRARequest] = field(default_factory=list)  # served from the start (--lora-modules)


@dataclass
class LoopDied:
    """The engine process's last message when its loop raised: the error as text (it may not pickle)."""

    error: str


@dataclass
class RequestFailed:
    request_id: str
    error: Exception


@dataclass
class StepResult:
    outputs: list[RequestOutput]
    failures: list[RequestFailed]
    stats: EngineStats
    # AddRequest commands the loop has taken so far: the front then knows which of the requests it sent are
    # in these stats and which are still on their way (in the command queue or the pipe).
    adds_received: int = 0
    lora_replies: list[LoRAReply] = field(default_factory=list)


class EngineLoop:
    """Owns an LLMEngine: takes commands, steps while there is work, blocks (no spinning) when idle."""

    def __init__(self, engine: LLMEngine, receive: Callable[[float | None], object | None],
                 send: Callable[[StepResult], None]) -> None:
        self.engine = engine
        self.receive = receive  # receive(timeout) -> a command, or None on timeout
        self.send = send

    def run(self) -> None:
        try:
            self._run()
        finally:
            self.engine.close()

    def _run(self) -> None:
        engine = self.engine
        reported_at = time.monotonic()
        adds_received = 0
        reported_pending = 0
        while True:
            failures: list[RequestFailed] = []
            replies: list[LoRAReply] = []
            # Idle: wait for a command. Busy: take what has arrived and step.
            command = self.receive(None if not engine.has_unfinished_requests() else 0.0)
            changed = False
            while command is not None:
                if isinstance(command, Shutdown):
                    return
                changed = True
                if isinstance(command, AddRequest):
                    adds_received += 1
                    try:
                        engine.add_request(command.request_id, command.prompt_token_ids, command.params,
                                           priority=command.priority, cache_salt=command.cache_salt,
                                           arrival_time=command.arrival_time, lora_request=command.lora_request)
                    except Exception as exc:  # noqa: BLE001 - reported to that request, the loop goes on
                        failures.append(RequestFailed(command.request_id, exc))
                elif isinstance(command, LoRACall):
                    try:
                        result = engine.add_lora(command.lora) if command.lora is not None else \
                            engine.remove_lora(command.name)
                    except Exception as exc:  # noqa: BLE001 - reported to the caller, the loop goes on
                        result = exc
                    replies.append(LoRAReply(command.call_id, result))
                elif isinstance(command, AbortRequest):
                    engine.abort_request(command.request_id)
                command = self.receive(0.0)
            stepped = engine.has_unfinished_requests()
            outputs = engine.step() if stepped else []
            failures += [RequestFailed(rid, exc) for rid, exc in engine.take_failures()]
            now = time.monotonic()
            # A prefill chunk yields no output but moves the prefill backlog: reported too, so the
            # kvgate:num_prefill_tokens_pending gauge follows every step.
            pending = engine.scheduler.num_prefill_tokens_pending
            if (outputs or failures or changed or pending != reported_pending
                    or (stepped and now - reported_at >= HEARTBEAT_S)):
                self.send(StepResult(outputs, failures, engine.stats(), adds_received, replies))
                reported_at = now
                reported_pending = pending


def _tokenizer_path(engine: LLMEngine) -> str:
    return getattr(engine.tokenizer, "name_or_path", "") or engine.config.model


def _engine_info(engine: LLMEngine) -> EngineInfo:
    return EngineInfo(engine.model_name, engine.max_model_len, engine.vocab_size, engine.config.block_size,
                      engine.kv_cache_manager.num_blocks, engine.eos_token_ids, _tokenizer_path(engine),
                      engine.list_loras())


def _process_main(config: EngineConfig, conn) -> None:
    """Entry point of the engine process: build the engine, report, then loop on the pipe."""
    try:
        engine = LLMEngine(config)
    except Exception as exc:  # noqa: BLE001 - the front re-raises it
        conn.send(exc)
        return
    conn.send(_engine_info(engine))

    def receive(timeout):
        if timeout is None or conn.poll(timeout):
            try:
                return conn.recv()
            except EOFError:  # the server process is gone
                return Shutdown()
        return None

    try:
        EngineLoop(engine, receive, conn.send).run()
    except BaseException as exc:  # noqa: BLE001 - told to the server, then this process exits with 1
        logging.getLogger(__name__).exception("engine loop failed")
        try:
            conn.send(LoopDied(f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        raise SystemExit(1) from None


def _exit_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "closed its pipe"
    if exitcode < 0:
        import signal

        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


class AsyncLLM:
    def __init__(self, config: EngineConfig, engine_loop: str = "thread",
                 on_dead: Callable[[BaseException], None] | None = None,
                 step_timeout: float = DEFAULT_STEP_TIMEOUT_S) -> None:
        if engine_loop not in ("thread", "process"):
            raise ValueError(f"engine_loop must be thread or process, got {engine_loop!r}")
        if not step_timeout > 0:
            raise ValueError(f"step_timeout must be > 0, got {step_timeout}")
        self.config = config
        self.mode = engine_loop
        self.info: EngineInfo | None = None
        self.tokenizer = None
        self.stats: EngineStats | None = None
        self.error: BaseException | None = None  # the engine loop died
        self.on_dead = on_dead  # called once, on the event loop, when the engine loop dies
        self._stopping = False  # shutdown() asked the loop to stop: the end of the pipe is expected
        self._queues: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._commands: queue.SimpleQueue | None = None
        self._conn = None
        self._process = None
        self._threads: list[threading.Thread] = []
        self.step_timeout = step_timeout
        self._reported_at = 0.0  # when the loop last reported a step (monotonic; written by the loop's side)
        self._waiting_since = 0.0  # when requests started waiting after none were (a report's clock starts)
        self._hung = False
        self._watchdog: asyncio.Task | None = None
        # Prompt tokens of requests sent to the loop that its last report did not yet include: (add number,
        # prompt tokens x n). Only the event loop touches these.
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
        """The engine's prefill backlog at its last report, plus the prompts sent to it since (which it has not
        seen yet: they wait in full)."""
        engine = self.stats.num_prefill_tokens_pending if self.stats is not None else 0
        return engine + self._unreported_prefill_tokens

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        """Build the engine (in its thread or process) and start its loop; raises if building fails."""
        self._loop = asyncio.get_running_loop()
        if self.mode == "thread":
            engine = await asyncio.to_thread(LLMEngine, self.config)
            self.tokenizer = engine.tokenizer
            self._commands = queue.SimpleQueue()

            def receive(timeout):
                try:
                    return self._commands.get(timeout=timeout) if timeout != 0.0 else self._commands.get_nowait()
                except queue.Empty:
                    return None

            loop = EngineLoop(engine, receive, self._post)
            self._start_thread(loop.run, "kvgate-engine")
            info = _engine_info(engine)
        else:
            ctx = multiprocessing.get_context("spawn")
            parent, child = ctx.Pipe()
            self._process = ctx.Process(target=_process_main, args=(self.config, child), name="kvgate-engine",
                                        daemon=True)
            self._process.start()
            child.close()
            self._conn = parent
            info = await asyncio.to_thread(self._receive_first)
            from kvgate.engine.loader import load_tokenizer

            self.tokenizer = await asyncio.to_thread(load_tokenizer, info.tokenizer_path)
            self._start_thread(self._pipe_reader, "kvgate-engine-reader")
        self.info = info
        self.loras = {lora.lora_name: lora for lora in info.loras}
        self._next_lora_id = max((lora.lora_int_id for lora in info.loras), default=0) + 1
        self._watchdog = asyncio.create_task(self._watch_steps())
        log.info("engine loop started (%s): %s, %d KV blocks", self.mode, info.model_name, info.num_blocks)

    def _receive_first(self) -> EngineInfo:
        message = self._conn.recv()
        if isinstance(message, BaseException):
            raise message
        return message

    def _start_thread(self, target, name: str) -> None:
        def run():
            try:
                target()
            except BaseException as exc:  # noqa: BLE001 - surfaces as 503s and in /health
                log.exception("engine loop failed")
                self._loop.call_soon_threadsafe(self._fail_all, exc)

        thread = threading.Thread(target=run, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _pipe_reader(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if self._stopping or self._hung:  # asked for, or the watchdog killed a hung process
                    return
                # A killed process closes the pipe before it is reaped: wait briefly for its exit code, only
                # to name the cause (the death is certain either way).
                self._process.join(0.2)
                raise RuntimeError(f"the engine process {_exit_description(self._process.exitcode)}") from None
            if isinstance(message, LoopDied):
                raise RuntimeError(f"the engine loop failed: {message.error}")
            self._post(message)

    def _post(self, result: StepResult) -> None:
        # stamped here, on the loop's side, not in _dispatch: a busy event loop must not look like a hung engine
        self._reported_at = time.monotonic()
        self._loop.call_soon_threadsafe(self._dispatch, result)

    async def _watch_steps(self) -> None:
        """Declare the engine dead when requests wait and no step has been reported for `step_timeout` s."""
        interval = min(1.0, self.step_timeout / 4)
        while self.error is None and not self._stopping:
            await asyncio.sleep(interval)
            if not self._queues:
                continue
            silent = time.monotonic() - max(self._reported_at, self._waiting_since)
            if silent > self.step_timeout:
                self._hung = True
                self._fail_all(RuntimeError(
                    f"the engine loop is hung: no step completed in {silent:.1f} s while {len(self._queues)} "
                    f"requests waited (--engine-step-timeout {self.step_timeout:g})"))
                if self._process is not None:
                    self._process.kill()  # it holds the accelerator; the pipe reader then sees it gone
                return

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

    def _send(self, command) -> None:
        try:
            if self.mode == "thread":
                self._commands.put(command)
            else:
                self._conn.send(command)
        except OSError as exc:  # the engine process is gone; the reader thread reports why
            raise EngineDeadError(f"the engine stopped: {exc}") from exc

    async def shutdown(self) -> None:
        if self.info is None and self._process is None:
            return
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        try:
            self._send(Shutdown())
        except EngineError:
            pass
        for thread in self._threads:
            if not (self._hung and self.mode == "thread"):  # a hung engine thread never returns
                await asyncio.to_thread(thread.join, 5.0)
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 5.0)
            if self._process.is_alive():
                self._process.terminate()
                await asyncio.to_thread(self._process.join, 5.0)
            self._conn.close()
        self.info = None

    # -- LoRA adapters ----------------------------------------------------------------------------

    async def _lora_call(self, call: LoRACall):
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped: {self.error}")
        future = self._loop.create_future()
        self._lora_calls[call.call_id] = future
        try:
            self._send(call)
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
            self._send(AddRequest(request_id, prompt_token_ids, params, priority, cache_salt, arrival_time,
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
                    self._send(AbortRequest(request_id))
                except EngineError:
                    pass  # the engine is gone: nothing left to abort
