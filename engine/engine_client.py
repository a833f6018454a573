"""How AsyncLLM reaches its engine loop: one interface, two transports, chosen once (as vLLM V1's core_client.py).

- ThreadEngineClient (`--engine-loop thread`): the loop in a thread of the server process, commands over a queue.
- ProcessEngineClient (`--engine-loop process`): the loop in a spawned process of its own, commands and step
  reports over a pipe.

Either client hands every step report to `on_result` and a death, once, to `on_death`, both on its own thread.
Each AddRequest is also probed against the prefix cache where it reaches the engine's side — in `send` here, or by
the engine process's pipe reader — while the loop may be in a step; the ArrivalProbe goes to `on_result` too
(engine_loop.arrival_probe: the front's prefill backlog then counts the prompt's uncached tokens, not all of them).
A death is an exception in the loop's thread, or any end of the pipe that `shutdown()` or `abandon()` did not ask
for, whatever the exit code says: a process that is killed (SIGKILL, the OOM killer) closes its end before it can
be reaped, so its exit code may still read None. An exception in the engine process is sent over the pipe before
the process exits, so its text reaches the server.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import signal
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable

from kvgate.engine.config import EngineConfig
from kvgate.engine.engine_loop import EngineLoop, arrival_probe, engine_info
from kvgate.engine.engine_messages import AddRequest, ArrivalProbe, EngineInfo, LoopDied, Shutdown, StepResult
from kvgate.common.errors import EngineDeadError, EngineError
from kvgate.engine.llm_engine import LLMEngine

OnResult = Callable[[StepResult | ArrivalProbe], None]
OnDeath = Callable[[BaseException], None]


class EngineClient(ABC):
    """The front's only way to its engine loop: start it, send it commands, learn of its death, stop it."""

    mode: str  # the --engine-loop value this client serves

    @abstractmethod
    async def start(self, on_result: OnResult, on_death: OnDeath) -> tuple[EngineInfo, object]:
        """Build the engine and start its loop: (the engine's info, its tokenizer). Raises if building fails.
        `on_result(step)` is called for every step report and ArrivalProbe, and `on_death(exc)` once if the loop
        ends unasked, on the client's thread (a probe on the thread that called send, which may be the event
        loop's)."""

    @abstractmethod
    def send(self, command: object) -> None:
        """Hand a command (engine/engine_messages.py) to the loop; EngineDeadError when the engine is gone."""

    @abstractmethod
    def is_alive(self) -> bool:
        """Whether the engine loop's thread or process is running."""

    @abstractmethod
    def abandon(self) -> None:
        """The loop is hung: stop counting on it, so its end is no death and shutdown() does not wait for it."""

    @abstractmethod
    async def shutdown(self) -> None:
        """Ask the loop to stop and wait for it, bounded; nothing when nothing was started."""


def _start_thread(target: Callable[[], None], name: str, on_death: OnDeath) -> threading.Thread:
    def run():
        try:
            target()
        except BaseException as exc:  # noqa: BLE001 - the front fails its requests and turns unhealthy
            on_death(exc)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread


class ThreadEngineClient(EngineClient):
    """The engine loop in a thread of this process; commands over a queue, reports by direct call."""

    mode = "thread"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._abandoned = False
        self._engine: LLMEngine | None = None
        self._on_result: OnResult | None = None
        self._adds = 0

    async def start(self, on_result: OnResult, on_death: OnDeath) -> tuple[EngineInfo, object]:
        engine = await asyncio.to_thread(LLMEngine, self.config)
        self._engine, self._on_result = engine, on_result
        self._thread = _start_thread(EngineLoop(engine, self._receive, on_result).run, "kvgate-engine", on_death)
        return engine_info(engine), engine.tokenizer

    def _receive(self, timeout: float | None) -> object | None:
        try:
            return self._commands.get(timeout=timeout) if timeout != 0.0 else self._commands.get_nowait()
        except queue.Empty:
            return None

    def send(self, command: object) -> None:
        if isinstance(command, AddRequest) and self._engine is not None:
            self._adds += 1
            probe = arrival_probe(self._engine, command, self._adds)
            if probe is not None:
                self._on_result(probe)
        self._commands.put(command)

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def abandon(self) -> None:
        self._abandoned = True  # a thread cannot be killed; the server exits anyway unless kept alive

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self.send(Shutdown())
        if not self._abandoned:  # a hung engine thread never returns
            await asyncio.to_thread(self._thread.join, 5.0)


class ProcessEngineClient(EngineClient):
    """The engine loop in a spawned process; a reader thread here takes its reports off the pipe."""

    mode = "process"

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._process: multiprocessing.Process | None = None
        self._conn = None
        self._reader: threading.Thread | None = None
        self._ending = False  # shutdown() or abandon() asked for the end of the pipe

    async def start(self, on_result: OnResult, on_death: OnDeath) -> tuple[EngineInfo, object]:
        ctx = multiprocessing.get_context("spawn")
        parent, child = ctx.Pipe()
        self._process = ctx.Process(target=_process_main, args=(self.config, child, _log_setup()),
                                    name="kvgate-engine", daemon=True)
        self._process.start()
        child.close()
        self._conn = parent
        info = await asyncio.to_thread(self._receive_first)
        from kvgate.common.tokenizer_files import load_tokenizer

        tokenizer = await asyncio.to_thread(load_tokenizer, info.tokenizer_path)
        self._reader = _start_thread(lambda: self._read(on_result), "kvgate-engine-reader", on_death)
        return info, tokenizer

    def _receive_first(self) -> EngineInfo:
        message = self._conn.recv()
        if isinstance(message, BaseException):
            raise message
        return message

    def _read(self, on_result: OnResult) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if self._ending:
                    return
                # A killed process closes the pipe before it is reaped: wait briefly for its exit code, only
                # to name the cause (the death is certain either way).
                self._process.join(0.2)
                raise RuntimeError(f"the engine process {_exit_description(self._process.exitcode)}") from None
            if isinstance(message, LoopDied):
                raise RuntimeError(f"the engine loop failed: {message.error}")
            on_result(message)

    def send(self, command: object) -> None:
        try:
            self._conn.send(command)
        except OSError as exc:  # the engine process is gone; the reader thread reports why
            raise EngineDeadError(f"the engine stopped: {exc}") from exc

    def is_alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def abandon(self) -> None:
        self._ending = True
        self._process.kill()  # it holds the accelerator; the reader then sees it gone

    async def shutdown(self) -> None:
        if self._process is None:
            return
        self._ending = True
        try:
            self.send(Shutdown())
        except EngineError:
            pass
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 5.0)
        await asyncio.to_thread(self._process.join, 5.0)
        if self._process.is_alive():
            self._process.terminate()
            await asyncio.to_thread(self._process.join, 5.0)
        self._conn.close()


ENGINE_CLIENTS: dict[str, type[EngineClient]] = {"thread": ThreadEngineClient, "process": ProcessEngineClient}


def make_engine_client(engine_loop: str, config: EngineConfig) -> EngineClient:
    """The client for `--engine-loop thread|process`."""
    if engine_loop not in ENGINE_CLIENTS:
        raise ValueError(f"engine_loop must be thread or process, got {engine_loop!r}")
    return ENGINE_CLIENTS[engine_loop](config)


def _log_setup() -> tuple[int, str | None]:
    """The server's root log level and format, for the engine process (spawned, it starts with neither, and its
    start-up lines, the derived settings among them, would be lost)."""
    root = logging.getLogger()
    fmt = next((h.formatter._fmt for h in root.handlers if h.formatter is not None), None)
    return root.level, fmt


def _process_main(config: EngineConfig, conn, log_setup: tuple[int, str | None] = (logging.WARNING, None)) -> None:
    """Entry point of the engine process: build the engine, report, then loop on the pipe."""
    level, fmt = log_setup
    if fmt is not None:
        logging.basicConfig(level=level, format=fmt)
    try:
        engine = LLMEngine(config)
    except Exception as exc:  # noqa: BLE001 - the front re-raises it
        conn.send(exc)
        return
    conn.send(engine_info(engine))
    # A reader thread takes commands off the pipe as they come, so that each AddRequest is probed while the loop
    # may be in a step (engine_loop.arrival_probe), and hands them to the loop in order; two threads send.
    commands: queue.SimpleQueue = queue.SimpleQueue()
    send_lock = threading.Lock()

    def send(message) -> None:
        with send_lock:
            conn.send(message)

    def read() -> None:
        adds = 0
        while True:
            try:
                command = conn.recv()
            except (EOFError, OSError):  # the server process is gone
                command = Shutdown()
            except Exception as exc:  # noqa: BLE001 - a message that does not unpickle: the loop dies of it
                commands.put(exc)
                return
            if isinstance(command, AddRequest):
                adds += 1
                probe = arrival_probe(engine, command, adds)
                if probe is not None:
                    try:
                        send(probe)
                    except OSError:  # the server is gone: the loop learns it from the pipe's end
                        pass
            commands.put(command)
            if isinstance(command, Shutdown):
                return

    threading.Thread(target=read, name="kvgate-engine-commands", daemon=True).start()

    def receive(timeout):
        try:
            item = commands.get() if timeout is None else commands.get(timeout=timeout) if timeout > 0 \
                else commands.get_nowait()
        except queue.Empty:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    try:
        EngineLoop(engine, receive, send).run()
    except BaseException as exc:  # noqa: BLE001 - told to the server, then this process exits with 1
        logging.getLogger(__name__).exception("engine loop failed")
        try:
            send(LoopDied(f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        raise SystemExit(1) from None


def _exit_description(exitcode: int | None) -> str:
    if exitcode is None:
        return "closed its pipe"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"
