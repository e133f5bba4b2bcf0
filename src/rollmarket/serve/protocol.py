"""Request bodies of the OpenAI endpoints we serve, with vLLM's extensions.

Unknown fields are accepted and ignored, as vLLM does, so clients written for other servers work;
fields we know are type-checked and a bad value is a 400 with OpenAI's error shape.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class OpenAIError(Exception):
    """An error returned to the client in OpenAI's ``{"error": {...}}`` shape."""

    def __init__(self, message: str, *, status: int = 400, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    n: int = Field(1, ge=1, le=64)
    temperature: float = Field(1.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, description="vLLM extension; 0 or -1 = off.")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False
    """vLLM: prompt_token_ids on the response and token_ids on each choice."""
    return_routed_experts: bool = False
    """vLLM/SGLang R3: routed_experts [tokens][moe_layers][top_k] on each choice."""
    ignore_eos: bool = False
    logprobs_mode: Literal["processed", "raw"] = "processed"

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        if isinstance(value, list) and any(not s for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatRequest(_Common):
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    add_generation_prompt: bool = True


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
