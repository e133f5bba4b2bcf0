"""Request bodies of the OpenAI endpoints we serve, with vLLM's extensions.

Unknown fields are accepted and ignored, as vLLM does, so clients written for other servers work;
fields we know are type-checked and a bad value is a 400 with OpenAI's error shape. Every number
has bounds and every list a most length, so that no value a client sends reaches the engine as
something it cannot hold (an integer beyond 64 bits, a million stop strings).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_STOP = 64
"""Most stop strings (and stop token ids) one request may give."""
MAX_STOP_CHARS = 1024
MAX_PROMPTS = 256
"""Most prompts in one completions request."""

TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]

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

    model: str | None = Field(
        None, max_length=1024,
        description="The served model's name; absent: the one model served (as vLLM; NeMo Gym's agents send none).")
    n: int = Field(1, ge=1, le=64)
    temperature: float = Field(1.0, ge=0, le=10)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=-1, le=INT32_MAX, description="vLLM extension; 0 or -1 = off.")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    stop: str | list[str] | None = Field(
        None, description=f"Up to {MAX_STOP} stop strings of 1 to {MAX_STOP_CHARS} characters.")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP)
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
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"at most {MAX_STOP} stop strings of at most {MAX_STOP_CHARS} characters")
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
    max_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    add_generation_prompt: bool = True


class CompletionRequest(_Common):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]] = Field(
        description=f"Text, token ids, or up to {MAX_PROMPTS} of either.")
    logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(16, ge=1, le=INT32_MAX)
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, value):
        if isinstance(value, list) and value and not isinstance(value[0], int) and len(value) > MAX_PROMPTS:
            raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
        return value


class TokenizeRequest(BaseModel):
    """Body of POST /tokenize: `prompt` (text) or chat `messages` (rendered with the chat template)."""

    model_config = ConfigDict(extra="allow")

    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(None, min_length=1)
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(BaseModel):
    """Body of POST /detokenize."""

    model_config = ConfigDict(extra="allow")

    tokens: list[TokenId]


class ResponsesRequest(_Common):
    """Body of POST /v1/responses (OpenAI's Responses API) with the same RL extensions as chat.

    ``input`` is a string (one user message) or a list of input items: messages (``role`` and
    ``content``), ``function_call`` items the model made and ``function_call_output`` items with
    their results. ``return_token_ids`` puts NeMo Gym's ``prompt_token_ids``,
    ``generation_token_ids`` and ``generation_log_probs`` on the last output item.
    """

    input: str | list[dict[str, Any]] = Field(description="A user message, or a list of input items.")
    instructions: str | None = Field(None, description="A system message put before the input.")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT32_MAX)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    include: list[str] | None = Field(None, max_length=MAX_STOP)
    previous_response_id: str | None = Field(
        None, max_length=1024, description="Continue the conversation of this stored response.")
    store: bool = Field(True, description="Keep this response for a later previous_response_id.")

    @field_validator("input")
    @classmethod
    def _non_empty(cls, value):
        if not value:
            raise ValueError("input must not be empty")
        return value
