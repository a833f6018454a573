"""vLLM's render endpoints: the token ids (and sampling parameters) a request would be given, without generating.

`POST /v1/completions/render` and `POST /v1/chat/completions/render` take the bodies of /v1/completions and
/v1/chat/completions, run every check those run (the same limits, 400s and 404s; chat: the server's template
only) and the same tokenization in the same thread pool, and answer what vLLM's answer: one `GenerateRequest`
object per prompt — a list for completions (one per prompt, even for one), a single object for chat. A router
(the EPP's precise prefix routing) thus tokenizes exactly as the engine does, with one call.

The shape follows vLLM's `GenerateRequest` (vllm/entrypoints/scale_out/token_in_token_out/protocol.py at commit
5dfbdc4d4318831ef9b1cc4baf5946e3bd10fa8a) as its render server fills it (vllm/entrypoints/scale_out/render/
serving.py at 0a44ad5bdbdb41937ac718b156fe72d401181430, routes in render/api_router.py at
15a3fd47ef45622a355ab7be62035231891f5e44): `request_id` ("cmpl-…" / "chatcmpl-…"), `token_ids`,
`sampling_params` (the engine's resolved parameters, under vLLM's names; the model's EOS ids, internal to the
engine, left out as vLLM leaves out its own), `model` (as the request named it), `stream`, `stream_options`
(only when streaming), `cache_salt`, `priority`, and vLLM's multimodal / disaggregation fields
(`assistant_tokens_mask`, `token_offsets`, `features`, `kv_transfer_params`) as null: kvgate serves text only.
"""

from __future__ import annotations

import dataclasses
import uuid

from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.server.protocol import SamplingFields

_ENGINE_ONLY = frozenset({"eos_token_ids"})


def sampling_params_body(params: SamplingParams) -> dict:
    body = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.name not in _ENGINE_ONLY}
    so = params.structured_outputs
    if so is not None:  # vLLM's StructuredOutputsParams fields (`param` is kvgate's, for error messages)
        body["structured_outputs"] = {k: v for k, v in dataclasses.asdict(so).items() if k != "param"}
    return body


def generate_request(id_prefix: str, token_ids: list[int], params: SamplingParams, req: SamplingFields) -> dict:
    """One vLLM GenerateRequest body."""
    return {
        "request_id": f"{id_prefix}-{uuid.uuid4().hex}",
        "token_ids": token_ids,
        "assistant_tokens_mask": None,
        "token_offsets": None,
        "features": None,
        "sampling_params": sampling_params_body(params),
        "model": req.model,
        "stream": req.stream,
        "stream_options": req.stream_options.model_dump() if req.stream and req.stream_options else None,
        "cache_salt": req.cache_salt,
        "priority": req.priority,
        "kv_transfer_params": None,
    }
