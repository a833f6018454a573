"""OpenAI request bodies (the fields kvgate honours) and the error shape.

Unknown fields are accepted and ignored, as OpenAI-compatible servers do; wrong types are 400s.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """OpenAI's response_format.json_schema (`strict` is accepted: kvgate always enforces the schema)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(BaseModel):
    """vLLM's `structured_outputs` request object: one of json, json_object, regex, choice, grammar."""

    model_config = ConfigDict(extra="allow")

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    priority: int = 0
    user: str | None = None
    # {token id as a string: bias in [-100, 100]} added to the logits before sampling (openai_serving.logit_bias)
    logit_bias: dict[str, float] | None = None
    # Structured outputs (engine/server/structured_outputs.py): OpenAI's response_format, vLLM's structured_outputs
    # and its older guided_* fields; at most one of them per request.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsFields | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)  # at most --max-logprobs
    echo: bool = False
    prompt_logprobs: int | None = Field(default=None, ge=0)  # vLLM's: the choice's prompt_logprobs (not streamed)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class ToolDefinition(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)  # at most --max-logprobs
    add_generation_prompt: bool = True
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling (engine/server/tool_calls.py)
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # With --reasoning-parser: false drops the thinking from the answer (vLLM's field; chat_output.py)
    include_reasoning: bool = True


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int]


ErrorType = Literal["invalid_request_error", "not_found_error", "server_error", "overloaded_error",
                    "request_too_large"]


def error_body(message: str, err_type: ErrorType, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter (vLLM's body; lora_int_id is taken and not needed)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None
