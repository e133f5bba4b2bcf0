"""Agent runs as records: each model turn with the exact ids the engine returned, each tool call,
how the run ended, and what the verifier made of it."""

from __future__ import annotations

from enum import Enum
from pydantic import Field, ValidationError, ValidatorFunctionWrapHandler, field_validator

from .arrays import Logprobs, RoutedExperts, TokenIds
from .base import Record
from .limits import MAX_ITEMS, MAX_NAMES, Count, Int64, JsonObject, Key, Name, Text


class TerminalReason(str, Enum):
    """Why an agent run stopped. Every run ends with exactly one."""

    final_answer = "final_answer"
    """The model answered without calling a tool."""
    max_steps = "max_steps"
    """The step budget ran out while the model still called tools."""
    length = "length"
    """A turn hit max_tokens or the context filled up before the model finished."""
    model_error = "model_error"
    """The model server failed or answered something unusable (e.g. no token ids)."""
    aborted = "aborted"
    """The caller stopped the run (a cancelled lease, a shutdown)."""


class ToolOutcome(str, Enum):
    """How one tool call went. Anything but ok still becomes a tool message the model reads."""

    ok = "ok"
    bad_arguments = "bad_arguments"
    """The arguments were not JSON, or did not match the tool's schema."""
    unknown_tool = "unknown_tool"
    error = "error"
    """The tool ran and failed (division by zero, no such file, an exception in the code)."""
    refused = "refused"
    """The sandbox refused the action (a path outside the task directory, a network call)."""
    timeout = "timeout"
    resource_limit = "resource_limit"
    """Memory, process or output limits were hit."""
    unavailable = "unavailable"
    """The tool cannot run on this machine (python_eval without its sandbox); the message says how to fix it."""


class ToolResult(Record):
    """What a tool call produced: the text the model sees next, and how it went."""

    name: Name
    content: Text = Field(description="The tool message content fed back to the model.")
    outcome: ToolOutcome = ToolOutcome.ok
    elapsed_s: float = Field(default=0.0, ge=0)
    truncated: bool = Field(default=False, description="True when the output was cut to the size limit.")

    @property
    def ok(self) -> bool:
        return self.outcome is ToolOutcome.ok


class ToolCallRecord(Record):
    """One tool call the model made and its result."""

    id: Key = Field(description="The call id the model (or the server's parser) gave it.")
    name: Name
    raw_arguments: Text = Field(description="The arguments exactly as the model wrote them.")
    arguments: JsonObject | None = Field(
        default=None, description="The parsed arguments; None when they were not a JSON object (or one "
                                  "beyond the JSON limits: raw_arguments keeps them as written)."
    )
    result: ToolResult

    @field_validator("arguments", mode="wrap")
    @classmethod
    def _arguments_or_none(cls, value, handler: ValidatorFunctionWrapHandler):
        # A model (or a client of the resources server) may write arguments nested deeper than the
        # limits allow; the call is still a call, recorded with its raw text, not a crash.
        try:
            return handler(value)
        except ValidationError:
            return None


class AgentStep(Record):
    """One assistant turn: the request's prompt ids and the response exactly as the engine returned them."""

    index: Count
    prompt_token_ids: TokenIds | None = Field(
        default=None, description="int32 [P_i]: the whole context of this turn, as the engine tokenized it."
    )
    response_token_ids: TokenIds | None = Field(default=None, description="int32 [R_i]: the sampled tokens.")
    logprobs: Logprobs | None = Field(default=None, description="float32 [R_i]: behaviour logprobs.")
    routed_experts: RoutedExperts | None = Field(
        default=None, description="int16 [R_i, L, K]: experts that produced each sampled token (MoE)."
    )
    content: Text = Field(default="", description="The assistant text (tool-call markup removed).")
    reasoning: Text | None = None
    tool_calls: list[ToolCallRecord] = Field(default_factory=list, max_length=MAX_NAMES)
    finish_reason: Name = Field(description="The engine's finish reason for this turn.")
    latency_s: float = Field(default=0.0, ge=0)

    @property
    def num_response_tokens(self) -> int:
        return 0 if self.response_token_ids is None else int(self.response_token_ids.shape[0])


class VerifyResult(Record):
    """A verifier's verdict: a reward, the named parts it is made of, and what it looked at."""

    reward: float
    passed: bool = Field(description="Whether the answer counts as right: what pass@k and majority@k count.")
    components: dict[Name, float] = Field(default_factory=dict, max_length=MAX_NAMES)
    info: JsonObject = Field(default_factory=dict)


class AgentTrajectory(Record):
    """One agent run of one task: the conversation, every turn's ids, and its reward."""

    task_id: Key
    sample_index: Count = 0
    seed: Int64 | None = None
    model: Key = Field(default="", description="The model name the server reported.")
    messages: list[JsonObject] = Field(max_length=MAX_ITEMS,
                                       description="The whole conversation, prompt included, as sent.")
    steps: list[AgentStep] = Field(default_factory=list, max_length=MAX_ITEMS)
    final_answer: Text | None = Field(default=None, description="The last assistant text, if the run ended on one.")
    terminal_reason: TerminalReason
    error: Text | None = Field(default=None, description="What went wrong, for model_error and aborted.")
    verification: VerifyResult | None = None
    wall_time_s: float = Field(default=0.0, ge=0)

    @property
    def reward(self) -> float:
        return 0.0 if self.verification is None else self.verification.reward

    @property
    def tool_calls(self) -> list[ToolCallRecord]:
        return [call for step in self.steps for call in step.tool_calls]

    @property
    def num_response_tokens(self) -> int:
        return sum(step.num_response_tokens for step in self.steps)
