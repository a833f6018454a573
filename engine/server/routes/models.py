"""GET /v1/models: the served model, then each loaded LoRA adapter (vLLM's fields, `parent` naming its base)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from kvgate.engine.server.state import server_state

router = APIRouter()


@router.get("/v1/models")
async def models(request: Request):
    server = server_state(request)
    server.require_ready()
    llm, served_model_name = server.llm, server.served_model_name
    base = {"id": served_model_name, "object": "model", "created": 0, "owned_by": "kvgate",
            "root": llm.config.model, "parent": None, "max_model_len": llm.info.max_model_len}
    adapters = [{"id": lora.lora_name, "object": "model", "created": 0, "owned_by": "kvgate",
                 "root": lora.lora_path, "parent": lora.base_model_name or served_model_name,
                 "max_model_len": llm.info.max_model_len}
                for lora in sorted(llm.loras.values(), key=lambda lora: lora.lora_int_id)]
    return {"object": "list", "data": [base, *adapters]}
