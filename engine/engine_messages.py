"""The messages between AsyncLLM and its engine loop: commands in, step reports out.

They are plain picklable dataclasses, so the same messages cross a thread's queue or a process's pipe
(engine/engine_client.py), and one loop (engine/engine_loop.py) serves both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.engine.llm_engine import EngineStats
from kvgate.engine.lora.request import LoRARequest
from kvgate.engine.outputs import RequestOutput
from kvgate.engine.sampling_params import SamplingParams

# -- commands (front -> loop) -------------------------------------------------------------------


@dataclass
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None
    arrival_time: float | None = None
    lora_request: LoRARequest | None = None
    # Set on the engine's side by engine_loop.arrival_probe, never sent by the front: the prompt's leading block
    # hashes the probe computed, which the request then starts with instead of computing them again.
    block_hashes: list[bytes] | None = None


@dataclass
class LoRACall:
    """Add (`lora`) or remove (`name`) an adapter; answered by a LoRAReply with the same call id."""

    call_id: int
    lora: LoRARequest | None = None
    name: str | None = None


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class Shutdown:
    pass


# -- reports (loop -> front) --------------------------------------------------------------------


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
class LoRAReply:
    call_id: int
    result: object  # add: None; remove: whether it existed; or the exception it raised


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


@dataclass
class ArrivalProbe:
    """The prefill an AddRequest brings, as the prefix cache stood when it reached the engine's side (before the
    loop takes it, which waits for the running step): the front counts these tokens in its prefill backlog until a
    StepResult covers the request, instead of the whole prompt (engine_loop.arrival_probe says why)."""

    add_number: int  # the request is the add_number-th AddRequest sent (StepResult.adds_received counts the same)
    uncached_tokens: int  # (prompt - its cached prefix) x n


@dataclass
class LoopDied:
    """The engine process's last message when its loop raised: the error as text (it may not pickle)."""

    error: str
