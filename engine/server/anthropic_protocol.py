"""The Anthropic Messages API's request body (POST /v1/messages), the fields kvgate honours.

Content blocks are kept as plain objects here and checked where they become a chat conversation
(serving_messages.py), so a wrong block is a 400 naming the message and block. Unknown fields are accepted and
ignored (`metadata`, `thinking`, `service_tier`, ...), as vLLM's Anthropic server does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant", "system"]  # system: part of the system prompt, as vLLM takes it
    content: str | list[dict[str, Any]]


class AnthropicTool(BaseModel):
    """A client tool: its name, description and the JSON schema of its input (server tools are refused)."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    type: str | None = None  # "custom" or left out; anything else names a server tool


class AnthropicToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # with type "tool"
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)  # required, as Anthropic's API has it
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    metadata: dict[str, Any] | None = None


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages body whose max_tokens may be left out."""

    max_tokens: int | None = Field(default=None, ge=1)
