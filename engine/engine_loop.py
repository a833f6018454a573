"""The engine loop: owns an LLMEngine, takes commands, steps while there is work and reports each step.

It knows nothing of where it runs: `receive` and `send` are a thread's queue and callback or a process's pipe
(engine/engine_client.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvgate.engine.engine_messages import (AbortRequest, AddRequest, ArrivalProbe, EngineInfo, LoRACall, LoRAReply,
                                           RequestFailed, Shutdown, StepResult)
from kvgate.engine.llm_engine import LLMEngine

# A busy loop whose steps produce no output (a long chunked prefill) still reports this often, so the
# watchdog sees it is alive; a step that does produce output is reported at once anyway.
HEARTBEAT_S = 0.25


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
        poll = getattr(engine, "health_poll_s", None)  # None: nothing outside the loop to check on
        while True:
            failures: list[RequestFailed] = []
            replies: list[LoRAReply] = []
            # Idle: wait for a command (waking every `poll` s to check the engine's other processes, whose death
            # ends the loop with its error). Busy: take what has arrived and step.
            command = self.receive(poll if not engine.has_unfinished_requests() else 0.0)
            if poll is not None:
                engine.check_health()
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
                                           arrival_time=command.arrival_time, lora_request=command.lora_request,
                                           block_hashes=command.block_hashes)
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
            if changed and stepped:
                # What the commands changed is reported before the step that takes them: the server then counts
                # those requests in the engine's own backlog (not as awaiting a step), and times the running step
                # from its start (AsyncLLM.step_age_s). One report more per step that takes commands: with
                # --engine-loop process one small pickle to write and read, plus the pipe's syscalls.
                self.send(StepResult([], failures, engine.stats(), adds_received, replies))
                failures, replies, changed = [], [], False
                reported_at, reported_pending = time.monotonic(), engine.scheduler.num_prefill_tokens_pending
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


def arrival_probe(engine: LLMEngine, command: AddRequest, add_number: int) -> ArrivalProbe | None:
    """What a request's prompt finds in the prefix cache as it reaches the engine's side: asked by whoever receives
    the command (the front's thread, or the engine process's pipe reader) while the loop may be in a step.

    Why: the loop takes commands between steps, and until a StepResult covers a request the front can only count
    its whole prompt in `kvgate:num_prefill_tokens_pending`. While a step computes a cold prompt, the warm requests
    that follow it would be counted whole, each by its cached part more than it will cost — the very margin at which
    the EPP's affinity filter leaves a warm replica. Under load such not-yet-reported prompts are a large share of
    the gauge (`kvgate bench routing --workloads small-kv --rates saturation` shows it).

    Read-only (KVCacheManager.probe_prefix), so it is safe beside a running step; the blocks a running step
    computes are already in the table (they are entered when allocated), so a request following a cold one finds
    them. The hashes it computed go with the command (AddRequest.block_hashes), so the prompt is hashed once. None
    when the prompt cannot be hashed (ids the engine will refuse anyway: it counts whole until then)."""
    try:
        cached, command.block_hashes = engine.kv_cache_manager.probe_prefix(
            command.prompt_token_ids, command.cache_salt, command.lora_request)
        n = max(int(command.params.n), 1)
        return ArrivalProbe(add_number, (len(command.prompt_token_ids) - cached) * n)
    except Exception:  # noqa: BLE001 - a hint only: a prompt it cannot read is the engine's to refuse
        return None


def engine_info(engine: LLMEngine) -> EngineInfo:
    tokenizer_path = getattr(engine.tokenizer, "name_or_path", "") or engine.config.model
    return EngineInfo(engine.model_name, engine.max_model_len, engine.vocab_size, engine.config.block_size,
                      engine.kv_cache_manager.num_blocks, engine.eos_token_ids, tokenizer_path,
                      engine.list_loras())
