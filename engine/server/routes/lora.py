"""vLLM's runtime LoRA endpoints, POST /v1/load_lora_adapter and /v1/unload_lora_adapter, behind vLLM's switch
(VLLM_ALLOW_RUNTIME_LORA_UPDATING, off by default): the adapter path is read by this server with its own
permissions, so only trusted callers may reach them. create_app includes this router only when the switch is on."""

from __future__ import annotations

import os

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from kvgate.common.errors import InvalidRequestError
from kvgate.engine.server.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from kvgate.engine.server.responses import error_response
from kvgate.engine.server.state import server_state

# vLLM's switch for these endpoints ("1" or "true"; off by default).
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

router = APIRouter()


def runtime_lora_updating_allowed() -> bool:
    return os.environ.get(RUNTIME_LORA_ENV, "0").strip().lower() in ("1", "true")


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoRAAdapterRequest, request: Request):
    server = server_state(request)
    server.require_ready()
    if req.lora_name == server.served_model_name:
        raise InvalidRequestError(f"{req.lora_name!r} is the base model's name", param="lora_name")
    await server.llm.add_lora(req.lora_name, req.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoRAAdapterRequest, request: Request):
    server = server_state(request)
    server.require_ready()
    if not await server.llm.remove_lora(req.lora_name):
        return error_response(404, f"The lora adapter '{req.lora_name}' cannot be found.", "not_found_error",
                              "lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
