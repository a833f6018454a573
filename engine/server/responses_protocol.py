"""The OpenAI Responses API's request body (POST /v1/responses), the fields kvgate honours.

Input items are kept as plain objects here and checked where they become a chat conversation
(serving_responses.py), so a wrong item is a 400 naming `input` and the item's index. Unknown fields are accepted
and ignored, as OpenAI-compatible servers do; vLLM's sampling extensions (top_k, seed, stop, structured_outputs,
...) are passed on to the chat request (serving_responses.PASSED_ON).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# a stored response's id: "resp_" and 40 hex digits here (common/response_ids.py); longer ids are none of ours
MAX_RESPONSE_ID_CHARS = 128


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=MAX_RESPONSE_ID_CHARS)
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    metadata: dict[str, Any] | None = None
    user: str | None = None
