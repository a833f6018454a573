"""How `kvgate serve` stops: a graceful drain on SIGTERM, and an exit when the engine loop dies.

SIGTERM (or the first Ctrl-C) does not close the listening socket, as uvicorn would: the server keeps
answering, with /health and /metrics 503 at once (readiness false, the EPP stops routing here) and 503 for
any new request (a gateway that still routes here in the moments before it notices gets a clean, retryable
answer rather than a refused connection), while running requests finish for up to --shutdown-timeout
seconds (vLLM's flag name; 0: fail them at once). What is still running then gets a clean error (an SSE
error event, or a 503), and the server exits. A second signal exits at once (uvicorn's own shutdown, which
still gives open responses `FINAL_GRACE_SECONDS`).

When the engine loop dies the server exits too (status 1), as vLLM's does unless
VLLM_KEEP_ALIVE_ON_ENGINE_DEATH is set: every in-flight request has already had its error (AsyncLLM fails
them), a process without an engine can serve nothing, and exiting is what gets it replaced — Kubernetes
restarts the container, `kvgate up` the replica — with no probe having to notice first. The listening
socket closes with the process, so gateways see refused connections (retried elsewhere) rather than 503s.
`--keep-alive-on-engine-death` keeps the server up instead (to inspect it): /health, /live and /metrics
then answer 503 and every request 503, and a liveness probe on /live restarts the container.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable

import uvicorn

from kvgate.engine.server.state import ServerState

log = logging.getLogger(__name__)

# After the drain (or on a second signal): how long uvicorn waits for open responses before cancelling them.
FINAL_GRACE_SECONDS = 5


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, shutdown_timeout: float,
                 start_drain: Callable[[float, Callable[[], None]], None]) -> None:
        super().__init__(config)
        self.shutdown_timeout = shutdown_timeout
        self.start_drain = start_drain
        self.draining = False

    def handle_exit(self, sig: int, frame) -> None:
        # A signal handler: runs on the main (event loop) thread between bytecodes; start_drain only
        # schedules work on the loop.
        if self.draining or self.should_exit or sig not in (signal.SIGTERM, signal.SIGINT):
            return super().handle_exit(sig, frame)
        self.draining = True
        self._captured_signals.append(sig)  # re-raised after shutdown, as uvicorn does
        log.info("%s: draining (up to %g s)", signal.Signals(sig).name, self.shutdown_timeout)
        try:
            self.start_drain(self.shutdown_timeout, self.exit_now)
        except Exception:  # noqa: BLE001 - not started yet (no event loop): plain shutdown
            self.should_exit = True

    def exit_now(self) -> None:
        self.should_exit = True


def start_drain(server: ServerState, shutdown_timeout: float, then: Callable[[], None]) -> None:
    """SIGTERM: refuse new requests (503) and fail /health at once; let running requests finish for up to
    `shutdown_timeout` s, fail what is left with a clean error, then call `then` (the server exits).
    Safe to call from a signal handler: it only schedules the drain on the server's event loop."""
    serving, llm = server.serving, server.llm

    async def run():
        serving.shutting_down = "the server is shutting down"
        open_now = serving.open_requests
        log.info("draining: %d requests running, up to %g s (--shutdown-timeout)", open_now, shutdown_timeout)
        deadline = time.monotonic() + shutdown_timeout
        while serving.open_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if serving.open_requests:
            cut = llm.abort_all(f"the server is shutting down: the request did not finish within "
                                f"{shutdown_timeout:g} s (--shutdown-timeout)")
            log.warning("drain: %d requests did not finish in %g s; failed them", cut, shutdown_timeout)
            await asyncio.sleep(0.1)  # let their error events be written
        else:
            log.info("drained: every running request finished")
        then()

    server.loop.call_soon_threadsafe(lambda: setattr(server, "drain_task", asyncio.ensure_future(run())))
