"""What the capture proxy records about one call to an OpenAI-compatible server.

A capture is one HTTP call (chat or completions, streamed or not): what the client sent, what the
engine produced token by token, how the call links to the turn before it, and how long it took.
Token arrays are numpy like every other contract: binary (msgpack ext) at rest, lists in JSON.
"""

from __future__ import annotations

from enum import Enum

from pydantic import Field

from .arrays import Logprobs, RoutedExperts, TokenIds
from .base import Identifier, Record, UtcDatetime, new_id
from .limits import MAX_ITEMS, MAX_NAMES, Count, JsonData, JsonObject, Key, Name, Text, Url


class CaptureOutcome(str, Enum):
    """How the call ended, as the proxy saw it."""

    ok = "ok"
    """The upstream answered 2xx and, when streamed, finished the stream."""
    upstream_error = "upstream_error"
    """The upstream answered 4xx/5xx (passed to the client unchanged), or sent an error event mid-stream."""
    upstream_unreachable = "upstream_unreachable"
    """No connection to the upstream; the client got 502."""
    upstream_timeout = "upstream_timeout"
    """The upstream did not answer within the proxy's timeout; the client got 504."""
    upstream_broken = "upstream_broken"
    """The upstream closed the connection before or during its answer, or sent bytes that are not HTTP."""
    client_disconnected = "client_disconnected"
    """The client went away mid-stream; the upstream call was cancelled. The capture holds the tokens up to then."""


class ConversationSource(str, Enum):
    """Where a capture's conversation id came from."""

    header = "header"
    """The client named it in the conversation header."""
    prefix = "prefix"
    """The request's messages continue an earlier capture's messages and reply (see `prefix_hash`)."""
    previous_response = "previous_response"
    """A Responses call names, as `previous_response_id`, the answer of an earlier capture."""
    root = "root"
    """None of these: this call starts a conversation, whose id derives from its capture id."""


class CapturedToolCall(Record):
    """One tool call the model made, as the upstream parsed it."""

    id: Key | None = None
    name: Name
    arguments: Text = Field(description="The arguments exactly as the upstream returned them (usually JSON text).")


class CapturedChoice(Record):
    """One sampled continuation of a call (`n` of them per call)."""

    index: Count
    content: Text | None = Field(
        default=None, description="Chat: the assistant message content; completions: the generated text."
    )
    reasoning_content: Text | None = Field(default=None, description="Reasoning text, where the upstream splits it off.")
    tool_calls: list[CapturedToolCall] = Field(default_factory=list, max_length=MAX_NAMES)
    finish_reason: Name | None = Field(
        default=None, description="As the upstream said it: stop, length, tool_calls, or whatever else it uses."
    )
    response_token_ids: TokenIds | None = Field(default=None, description="int32 [T]: the tokens the engine sampled.")
    logprobs: Logprobs | None = Field(
        default=None, description="float32 [T]: logprob of each sampled token as the upstream reported it."
    )
    routed_experts: RoutedExperts | None = Field(
        default=None, description="int16 [T, L, K]: top-k expert ids per MoE layer per response token."
    )
    prompt_routed_experts: RoutedExperts | None = Field(
        default=None,
        description="int16 [P-1, L, K]: the experts of prompt positions 0 .. P-2 (from vLLM's "
        "`routed_experts_prompt_start` or SGLang's `routed_experts_start_len` on, where the client set "
        "it), where the upstream returns them "
        "(vLLM and SGLang route the whole sequence; `rollmarket serve-model` the response only).",
    )
    prompt_token_ids: TokenIds | None = Field(
        default=None,
        description="int32 [P]: set only where this choice's prompt differs from the call's "
        "(a completions call with several prompts).",
    )

    @property
    def num_response_tokens(self) -> int:
        return 0 if self.response_token_ids is None else int(self.response_token_ids.shape[0])


class CaptureTimings(Record):
    """Where the time went. Durations are seconds from the moment the proxy received the request.

    They end when the response is complete at the proxy, before the capture is written and the
    last bytes go to the client (the capture is written first, so it cannot time that write).
    """

    received_at: UtcDatetime
    upstream_headers_s: float | None = Field(default=None, description="Until the upstream's status line and headers.")
    first_token_s: float | None = Field(
        default=None, description="Until the first event carrying output came from the upstream (streamed calls)."
    )
    upstream_s: float | None = Field(default=None, description="From sending to the upstream to its last byte.")
    total_s: float = Field(description="Until the response was complete at the proxy.")
    proxy_s: float = Field(description="total_s - upstream_s: time spent in the proxy itself.")


class Capture(Record):
    """One call through the capture proxy."""

    capture_id: Identifier = Field(default_factory=lambda: new_id("cap"))
    conversation_id: Key = Field(description="Shared by every turn of one conversation.")
    conversation_source: ConversationSource
    parent_capture_id: Key | None = Field(
        default=None, description="The capture whose messages and reply this call's messages continue."
    )
    parent_choice: Count | None = Field(default=None, description="Which choice of the parent was continued.")
    turn_index: Count = Field(description="Assistant messages in the request: 0 for a first turn.")
    prefix_hash: Key | None = Field(
        default=None, description="sha256 of the normalized messages up to the last assistant message (chat only)."
    )
    endpoint: Url = Field(description="The path called, e.g. /v1/chat/completions.")
    stream: bool = False
    upstream: Url = Field(description="Base URL of the upstream server.")
    model: Key | None = Field(default=None, description="The model the client asked for.")
    upstream_model: Key | None = Field(default=None, description="The model the upstream said answered.")
    messages: list[JsonObject] | None = Field(
        default=None, max_length=MAX_ITEMS, description="Chat: the messages as the client sent them."
    )
    tools: list[JsonObject] | None = Field(default=None, max_length=MAX_NAMES,
                                           description="Chat: the tools offered, as sent.")
    prompt: JsonData = Field(default=None, description="Completions: the prompt as sent (text, ids or a list of them).")
    params: JsonObject = Field(
        default_factory=dict, description="Every other field of the client's request (sampling, n, stop, ...)."
    )
    augmented: list[Name] = Field(
        default_factory=list, max_length=MAX_NAMES,
        description="Request fields the proxy added because the client did not ask (logprobs, "
        "return_token_ids, return_routed_experts, stream_options.include_usage).",
    )
    prompt_token_ids: TokenIds | None = Field(default=None, description="int32 [P]: the prompt as the engine saw it.")
    prompt_logprobs: Logprobs | None = Field(
        default=None,
        description="float32 [P-1]: the engine's logprob of prompt tokens 1 .. P-1, each given the tokens "
        "before it, where the client asked the upstream for vLLM's `prompt_logprobs`.",
    )
    choices: list[CapturedChoice] = Field(default_factory=list, max_length=MAX_ITEMS)
    usage: JsonObject | None = None
    status_code: int = Field(ge=100, le=599, description="The HTTP status the client received.")
    outcome: CaptureOutcome = CaptureOutcome.ok
    error: JsonData = Field(
        default=None,
        description="The error body the client received (the upstream's, parsed when JSON), or the "
        "error event of a stream.",
    )
    notes: list[Text] = Field(
        default_factory=list, max_length=MAX_NAMES, description="What the proxy could not read from the upstream's answer, if anything."
    )
    timings: CaptureTimings

    @property
    def num_response_tokens(self) -> int:
        return sum(choice.num_response_tokens for choice in self.choices)
