"""Collect one call's capture on the way through, then build the `Capture` record off the hot path.

`CallRecorder` runs on the event loop: it only picks references out of the JSON the proxy parsed
anyway (a whole answer, or one streamed chunk at a time), never copies token lists element by
element, never builds numpy arrays. `build_capture` runs on the store's writer thread: it turns
the draft into a validated `Capture`, one array at a time, so that one malformed field becomes a
note on the record instead of a lost capture.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from datetime import datetime, timezone
from itertools import chain
from typing import Any

import numpy as np

from ..contracts import upstream
from ..contracts.arrays import LOGPROBS, ROUTED_EXPERTS, TOKEN_IDS, ArraySpec
from ..contracts.capture import (
    Capture,
    CapturedChoice,
    CapturedToolCall,
    CaptureOutcome,
    CaptureTimings,
    ConversationSource,
)
from ..contracts.responses import ResponsesInputError, input_messages
from . import linking
from .augment import CHAT, COMPLETIONS, RESPONSES

log = logging.getLogger(__name__)

_REQUEST_FIELDS = ("messages", "tools", "prompt", "model")


class _Choice:
    """What one choice has produced so far."""

    __slots__ = ("index", "content", "reasoning", "tool_calls", "finish_reason", "token_ids", "logprobs",
                 "experts", "packed_experts", "sgl_experts", "prompt_token_ids", "prompt_logprobs", "logprobs_missing")

    def __init__(self, index: int):
        self.index = index
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, list[Any]] = {}  # index -> [id, name, [argument pieces]]
        self.finish_reason: str | None = None
        self.token_ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.experts: list[Any] = []
        self.packed_experts: Any = None  # vLLM's base64 .npy over the whole sequence
        self.sgl_experts: Any = None
        self.prompt_token_ids: list[int] | None = None
        self.prompt_logprobs: Any = None
        self.logprobs_missing = False

    def add_tool_calls(self, calls: list[Any], *, streamed: bool) -> None:
        for position, call in enumerate(calls):
            if not isinstance(call, dict):
                continue
            index = call.get("index", position) if streamed else position
            slot = self.tool_calls.setdefault(index, [None, None, []])
            function = call.get("function") or {}
            if call.get("id"):
                slot[0] = call["id"]
            if function.get("name") and slot[1] is None:
                slot[1] = function["name"]
            if function.get("arguments") is not None:
                arguments = function["arguments"]
                slot[2].append(arguments if isinstance(arguments, str) else json.dumps(arguments))

    def add_extras(self, choice: dict[str, Any], *, chat: bool) -> None:
        ids = choice.get("token_ids")
        if ids is None and "meta_info" in choice:  # SGLang's return_meta_info: ids beside the logprobs
            ids = upstream.sglang_output_ids(choice)
        if ids:
            self.token_ids.extend(ids)
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            if chat:
                entries = logprobs.get("content") or ()
                self.logprobs.extend(entry.get("logprob") for entry in entries)
            else:
                self.logprobs.extend(logprobs.get("token_logprobs") or ())
        elif ids:
            self.logprobs_missing = True
        experts = choice.get("routed_experts")
        if isinstance(experts, list):
            self.experts.extend(experts)
        elif experts is not None:
            self.packed_experts = experts
        sglang = upstream.sglang_experts_field({}, choice)
        if sglang is not None:
            self.sgl_experts = sglang
        prompt_ids = choice.get("prompt_token_ids")
        if prompt_ids:
            self.prompt_token_ids = prompt_ids
        if choice.get("prompt_logprobs") is not None:
            self.prompt_logprobs = choice["prompt_logprobs"]
        reason = choice.get("finish_reason")
        if reason is not None:
            self.finish_reason = reason

    def calls(self) -> list[tuple[str | None, str, str]]:
        return [(call_id, name or "", "".join(pieces))
                for _, (call_id, name, pieces) in sorted(self.tool_calls.items())]

    def text(self) -> str | None:
        return "".join(self.content) if self.content else None


@dataclass
class CaptureDraft:
    """Everything a capture holds, as plain Python, waiting for the writer thread."""

    endpoint: str
    stream: bool
    upstream: str
    request: dict[str, Any] | None
    augmented: list[str]
    header_conversation: str | None
    status_code: int
    outcome: CaptureOutcome
    timings: dict[str, Any]
    upstream_model: str | None = None
    prompt_token_ids: list[int] | None = None
    choices: list[_Choice] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    error: Any = None
    notes: list[str] = field(default_factory=list)
    prompt_logprobs: Any = None
    sgl_experts: Any = None
    """SGLang's routed experts at the top of the answer (`sglext`), which are the first choice's."""
    response_id: str | None = None
    """The id of a Responses answer, which a next call may name as `previous_response_id`."""
    earlier: list[Any] | None = None
    """The turns (chat messages) of the response a Responses call continues, resolved by the store."""

    @property
    def previous_response_id(self) -> str | None:
        previous = (self.request or {}).get("previous_response_id") if self.endpoint == RESPONSES else None
        return previous if isinstance(previous, str) else None

    def _responses_turns(self) -> list[Any] | None:
        """A Responses call's conversation without its instructions: the turns it continues, then
        its input items read as chat messages (None when they cannot be read; the upstream judges)."""
        try:
            return [*(self.earlier or ()), *input_messages((self.request or {}).get("input") or [])]
        except ResponsesInputError:
            return None

    @property
    def messages(self) -> list[Any] | None:
        """The call's chat messages; for a Responses call, the ones the model is shown (instructions
        as the system message, the turns `previous_response_id` names, the input items)."""
        if self.endpoint == RESPONSES:
            turns = self._responses_turns()
            instructions = (self.request or {}).get("instructions")
            if turns is None or not (instructions and isinstance(instructions, str)):
                return turns
            return [{"role": "system", "content": instructions}, *turns]
        messages = (self.request or {}).get("messages")
        return messages if isinstance(messages, list) else None

    def _reply(self, choice: _Choice) -> dict[str, Any]:
        return linking.reply_message(choice.text(), [(name, arguments) for _, name, arguments in choice.calls()])

    def responses_turns(self) -> list[Any] | None:
        """What a call naming this response as `previous_response_id` continues: the turns and the
        reply; None for anything but an answered Responses call the upstream keeps (`store`)."""
        if self.endpoint != RESPONSES or not self.response_id or self.outcome is not CaptureOutcome.ok \
                or not self.choices or (self.request or {}).get("store") is False:
            return None
        turns = self._responses_turns()
        return None if turns is None else [*turns, self._reply(self.choices[0])]

    def reply_keys(self) -> list[tuple[int, str]]:
        """(choice index, key) for every choice a next turn may continue."""
        messages = self.messages
        if messages is None or self.endpoint == COMPLETIONS or self.outcome is not CaptureOutcome.ok:
            return []
        return [(choice.index, linking.reply_key(messages, self._reply(choice))) for choice in self.choices]


class CallRecorder:
    """Accumulates the capture of one call while its answer passes through the proxy."""

    def __init__(self, *, endpoint: str, stream: bool, upstream: str, request: dict[str, Any] | None,
                 augmented: list[str], header_conversation: str | None, received_at: float):
        self.endpoint = endpoint
        self.stream = stream
        self.upstream = upstream
        self.request = request
        self.augmented = augmented
        self.header_conversation = header_conversation
        self.received_at = received_at
        self.chat = endpoint == CHAT
        self.model: str | None = None
        self.prompt_token_ids: list[int] | None = None
        self.usage: dict[str, Any] | None = None
        self.error: Any = None
        self.prompt_logprobs: Any = None
        self.sgl_experts: Any = None
        self.notes: list[str] = []
        self.saw_output = False
        self.response_id: str | None = None
        self._choices: dict[int, _Choice] = {}

    def _choice(self, index: int) -> _Choice:
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = _Choice(index)
        return choice

    def _top(self, body: dict[str, Any]) -> None:
        if body.get("model"):
            self.model = body["model"]
        ids = body.get("prompt_token_ids")
        if ids:
            self.prompt_token_ids = ids
        if body.get("usage"):
            self.usage = body["usage"]
        if body.get("error") is not None:
            self.error = body["error"]
        if body.get("prompt_logprobs") is not None:  # vLLM's chat answer holds them at the top
            self.prompt_logprobs = body["prompt_logprobs"]
        ext = body.get("sglext")
        if isinstance(ext, dict) and ext.get("routed_experts") is not None:
            self.sgl_experts = ext["routed_experts"]

    def response(self, body: dict[str, Any]) -> None:
        """A whole (non-streamed) answer."""
        self._top(body)
        if self.endpoint == RESPONSES:
            self._output_items(body)
            return
        for position, choice in enumerate(body.get("choices") or ()):
            if not isinstance(choice, dict):
                continue
            state = self._choice(choice.get("index", position))
            if self.chat:
                message = choice.get("message") or {}
                if message.get("content") is not None:
                    state.content.append(message["content"])
                reasoning = message.get("reasoning_content") or message.get("reasoning")
                if reasoning:
                    state.reasoning.append(reasoning)
                if message.get("tool_calls"):
                    state.add_tool_calls(message["tool_calls"], streamed=False)
            elif choice.get("text") is not None:
                state.content.append(choice["text"])
            state.add_extras(choice, chat=self.chat)

    def _output_items(self, body: dict[str, Any]) -> None:
        """A Responses answer is one choice: its message text, its function calls, and NeMo Gym's
        token fields on the item that carries them."""
        if isinstance(body.get("id"), str):
            self.response_id = body["id"]
        state = self._choice(0)
        calls = []
        for item in body.get("output") or ():
            if not isinstance(item, dict):
                continue
            if item.get("type") == "message":
                state.content.extend(part["text"] for part in item.get("content") or ()
                                     if isinstance(part, dict) and isinstance(part.get("text"), str))
            elif item.get("type") == "function_call":
                calls.append({"id": item.get("call_id"), "function": {
                    "name": item.get("name"), "arguments": item.get("arguments")}})
            elif item.get("type") == "reasoning":
                state.reasoning.extend(part["text"] for part in item.get("summary") or ()
                                       if isinstance(part, dict) and isinstance(part.get("text"), str))
            if item.get("generation_token_ids") is not None:
                state.add_extras({"token_ids": item["generation_token_ids"],
                                  "prompt_token_ids": item.get("prompt_token_ids"),
                                  "routed_experts": item.get("routed_experts")}, chat=True)
                state.logprobs.extend(item.get("generation_log_probs") or ())
                state.logprobs_missing = item.get("generation_log_probs") is None
        if calls:
            state.add_tool_calls(calls, streamed=False)
        incomplete = body.get("status") == "incomplete"
        state.finish_reason = "length" if incomplete else "tool_calls" if calls else "stop"
        if state.prompt_token_ids and not self.prompt_token_ids:
            self.prompt_token_ids = state.prompt_token_ids

    def _response_event(self, event: dict[str, Any]) -> None:
        """One event of a streamed Response: the last (`response.completed`, or `.incomplete`,
        `.failed`) holds the whole Response, which is what gets recorded; until it comes, the
        deltas' tokens are (text deltas and tool calls' arguments deltas), so that a stream cut
        short keeps what it carried."""
        kind = event.get("type") or ""
        if kind.endswith(".delta"):
            self.saw_output = True
        if kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            self._text_delta(event, text=kind == "response.output_text.delta")
        response = event.get("response")
        if kind in ("response.completed", "response.incomplete", "response.failed") and isinstance(response, dict):
            self._choices.pop(0, None)  # the whole Response replaces what the deltas built
            self.response(response)
        elif kind == "error":
            self.error = {key: event.get(key) for key in ("message", "code", "param")}

    def _text_delta(self, event: dict[str, Any], *, text: bool = True) -> None:
        state = self._choice(0)
        if text and isinstance(event.get("delta"), str):
            state.content.append(event["delta"])
        ids = event.get("generation_token_ids")
        if not isinstance(ids, list) or not ids:
            return
        state.token_ids.extend(ids)
        logprobs = event.get("generation_log_probs")
        if isinstance(logprobs, list):
            state.logprobs.extend(logprobs)
        else:
            state.logprobs_missing = True
        experts = event.get("routed_experts")
        if isinstance(experts, list):
            state.experts.extend(experts)

    def chunk(self, chunk: dict[str, Any]) -> None:
        """One streamed chunk."""
        if self.endpoint == RESPONSES:
            self._response_event(chunk)
            return
        self._top(chunk)
        for position, choice in enumerate(chunk.get("choices") or ()):
            if not isinstance(choice, dict):
                continue
            self.saw_output = True
            state = self._choice(choice.get("index", position))
            if self.chat:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    state.content.append(delta["content"])
                reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                if reasoning:
                    state.reasoning.append(reasoning)
                if delta.get("tool_calls"):
                    state.add_tool_calls(delta["tool_calls"], streamed=True)
            elif choice.get("text"):
                state.content.append(choice["text"])
            state.add_extras(choice, chat=self.chat)

    def draft(self, *, status_code: int, outcome: CaptureOutcome, timings: dict[str, Any],
              error: Any = None) -> CaptureDraft:
        if outcome is CaptureOutcome.ok and self.error is not None:
            outcome = CaptureOutcome.upstream_error
        return CaptureDraft(
            endpoint=self.endpoint, stream=self.stream, upstream=self.upstream, request=self.request,
            augmented=self.augmented, header_conversation=self.header_conversation,
            status_code=status_code, outcome=outcome, timings=timings, upstream_model=self.model,
            prompt_token_ids=self.prompt_token_ids,
            choices=[self._choices[i] for i in sorted(self._choices)], usage=self.usage,
            error=error if error is not None else self.error, notes=self.notes,
            prompt_logprobs=self.prompt_logprobs, sgl_experts=self.sgl_experts, response_id=self.response_id,
        )


def parse_error_body(raw: bytes) -> Any:
    """An upstream error body as data: parsed JSON when it is JSON, else its text."""
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


# -- on the writer thread ------------------------------------------------------------------------

def _array(spec: ArraySpec, values: Any, what: str, notes: list[str]) -> np.ndarray | None:
    if values is None or (isinstance(values, list) and not values):
        return None
    try:
        if spec is LOGPROBS and any(v is None for v in values):
            raise ValueError("some tokens have no logprob")
        return spec.validate(np.asarray(values) if spec is not LOGPROBS else np.asarray(values, dtype=np.float64))
    except Exception as exc:  # one unreadable field is a note, never a lost capture
        notes.append(f"{what}: {str(exc).splitlines()[0][:200]}")
        return None


def _objects(values: Any, what: str, notes: list[str]) -> list[dict[str, Any]] | None:
    """`values` when it is a list of JSON objects (what the contract holds), else None and a note:
    the upstream judged the request; the capture keeps everything else about the call."""
    if values is None:
        return None
    if isinstance(values, list) and all(isinstance(v, dict) for v in values):
        return values
    notes.append(f"{what}: not a list of objects; not recorded")
    return None


def _params(request: dict[str, Any] | None) -> dict[str, Any]:
    if not request:
        return {}
    return {k: v for k, v in request.items() if k not in _REQUEST_FIELDS}


def _fast_experts(experts: list) -> np.ndarray:
    """[T][L][K] nested lists as one int16 array, without numpy's per-element inference."""
    T, L, K = len(experts), len(experts[0]), len(experts[0][0])
    if set(map(len, experts)) != {L}:
        raise ValueError("ragged routed experts")
    flat = np.fromiter(chain.from_iterable(chain.from_iterable(experts)), dtype=np.int64)
    if flat.size != T * L * K:
        raise ValueError("ragged routed experts")
    return flat.reshape(T, L, K)


def _packed_experts(choice: _Choice, prompt_ids: list[int] | None, experts_shape: tuple[int, int] | None,
                    prompt_start: int, sgl_experts: Any, notes: list[str], what: str) -> upstream.SplitExperts | None:
    """vLLM's or SGLang's routed experts over the whole sequence, cut into prompt and response
    parts (`contracts.upstream`); None, with a note, when they cannot be read."""
    sglang = choice.sgl_experts if choice.sgl_experts is not None else sgl_experts
    if choice.packed_experts is None and sglang is None:
        return None
    prompt_tokens = len(prompt_ids) if prompt_ids else None
    try:
        if choice.packed_experts is not None:
            return upstream.read_choice_experts(choice.packed_experts, prompt_tokens=prompt_tokens,
                                                response_tokens=len(choice.token_ids), prompt_start=prompt_start)
        if experts_shape is None:
            notes.append(f"{what}: SGLang routed experts present but --moe-shape not set; not recorded")
            return None
        return upstream.read_sglang_experts(sglang, layers=experts_shape[0], top_k=experts_shape[1],
                                            prompt_tokens=prompt_tokens, response_tokens=len(choice.token_ids),
                                            prompt_start=prompt_start)
    except upstream.RoutedExpertsError as exc:
        notes.append(f"{what} routed_experts: {type(exc).__name__}: {str(exc)[:200]}")
        return None


def _choice_record(choice: _Choice, prompt_ids: list[int] | None, experts_shape: tuple[int, int] | None,
                   notes: list[str], *, prompt_start: int = 0, sgl_experts: Any = None) -> CapturedChoice:
    """One choice as a record: arrays validated once on the usual path; field by field, with a
    note for each unreadable one, when that fails."""
    what = f"choice {choice.index}"
    scalars: dict[str, Any] = dict(
        index=choice.index,
        content=choice.text(),
        reasoning_content="".join(choice.reasoning) if choice.reasoning else None,
        tool_calls=[CapturedToolCall(id=call_id, name=name, arguments=arguments)
                    for call_id, name, arguments in choice.calls()],
        finish_reason=choice.finish_reason,
    )
    own_prompt = choice.prompt_token_ids if choice.prompt_token_ids and choice.prompt_token_ids != prompt_ids else None
    experts: Any = choice.experts or None
    prompt_experts = None
    if experts is None:
        packed = _packed_experts(choice, own_prompt or prompt_ids, experts_shape, prompt_start, sgl_experts,
                                 notes, what)
        if packed is not None:
            experts, prompt_experts = packed.response_RLK, packed.prompt_PLK
    scalars["prompt_routed_experts"] = prompt_experts
    tokens = len(choice.token_ids)
    if not choice.logprobs_missing and len(choice.logprobs) in (0, tokens) and (
            experts is None or len(experts) == tokens):
        try:
            logprobs = np.array(choice.logprobs, dtype=np.float64) if choice.logprobs else None
            if logprobs is not None and np.isnan(logprobs).any():
                raise ValueError("some tokens have no logprob")
            return CapturedChoice(
                **scalars,
                response_token_ids=np.array(choice.token_ids, dtype=np.int64) if tokens else None,
                logprobs=logprobs,
                routed_experts=_fast_experts(experts) if isinstance(experts, list) else experts,
                prompt_token_ids=np.array(own_prompt, dtype=np.int64) if own_prompt else None,
            )
        except Exception:  # something is off: take the careful path below, which says what
            pass
    ids = _array(TOKEN_IDS, choice.token_ids, f"{what} token_ids", notes)
    logprobs = _array(LOGPROBS, choice.logprobs, f"{what} logprobs", notes)
    if choice.logprobs_missing and logprobs is not None:
        notes.append(f"{what} logprobs: missing on some chunks; not recorded")
        logprobs = None
    experts = _array(ROUTED_EXPERTS, experts, f"{what} routed_experts", notes)
    for name, array in (("logprobs", logprobs), ("routed_experts", experts)):
        if array is not None and ids is not None and array.shape[0] != len(ids):
            notes.append(f"{what} {name}: {array.shape[0]} entries for {len(ids)} tokens")
    return CapturedChoice(**scalars, response_token_ids=ids, logprobs=logprobs, routed_experts=experts,
                          prompt_token_ids=_array(TOKEN_IDS, own_prompt, f"{what} prompt_token_ids", notes))


def _prompt_logprobs(draft: CaptureDraft, prompt_ids: list[int] | None, notes: list[str]) -> np.ndarray | None:
    """vLLM's prompt_logprobs of the call's prompt: at the top of a chat answer, on the choices of a
    completions answer (the first whose prompt is the call's)."""
    entries = draft.prompt_logprobs
    if entries is None:
        entries = next((c.prompt_logprobs for c in draft.choices if c.prompt_logprobs is not None
                        and (not c.prompt_token_ids or c.prompt_token_ids == prompt_ids)), None)
    try:
        return upstream.read_prompt_logprobs(entries, prompt_ids)
    except upstream.PromptLogprobsError as exc:
        notes.append(f"prompt_logprobs: {str(exc)[:200]}; not recorded")
        return None


def build_capture(draft: CaptureDraft, *, conversation_id: str, source: ConversationSource,
                  parent: tuple[str, int] | None, experts_shape: tuple[int, int] | None = None) -> Capture:
    """The validated record of a draft, with its conversation resolved by the store."""
    notes = list(draft.notes)
    request = draft.request or {}
    prompt_ids = draft.prompt_token_ids
    if prompt_ids is None:
        per_choice = [c.prompt_token_ids for c in draft.choices if c.prompt_token_ids]
        prompt_ids = per_choice[0] if per_choice else None
    # vLLM's and SGLang's names for "leave out the first prompt positions"
    start = request.get("routed_experts_prompt_start", request.get("routed_experts_start_len", 0))
    prompt_start = start if isinstance(start, int) and not isinstance(start, bool) else 0
    choices = [_choice_record(choice, prompt_ids, experts_shape, notes, prompt_start=prompt_start,
                              sgl_experts=draft.sgl_experts if choice.index == 0 else None)
               for choice in draft.choices]
    messages = draft.messages
    recorded_messages = _objects(messages, "messages", notes)
    tools = request.get("tools")
    recorded_tools = _objects(tools, "tools", notes) if tools is not None else None
    timings = dict(draft.timings)
    timings["received_at"] = datetime.fromtimestamp(timings["received_at"], timezone.utc)
    return Capture(
        conversation_id=conversation_id,
        conversation_source=source,
        parent_capture_id=parent[0] if parent else None,
        parent_choice=parent[1] if parent else None,
        turn_index=linking.turn_index(messages) if messages else 0,
        prefix_hash=linking.prefix_hash(messages) if messages else None,
        endpoint=draft.endpoint,
        stream=draft.stream,
        upstream=draft.upstream,
        model=request.get("model") if isinstance(request.get("model"), str) else None,
        upstream_model=draft.upstream_model,
        messages=recorded_messages,
        tools=recorded_tools,
        prompt=request.get("prompt"),
        params=_params(request),
        augmented=draft.augmented,
        prompt_token_ids=_array(TOKEN_IDS, prompt_ids, "prompt_token_ids", notes),
        prompt_logprobs=_prompt_logprobs(draft, prompt_ids, notes),
        choices=choices,
        usage=draft.usage if isinstance(draft.usage, dict) else None,
        status_code=draft.status_code,
        outcome=draft.outcome,
        error=draft.error,
        notes=notes,
        timings=CaptureTimings(**timings),
    )
