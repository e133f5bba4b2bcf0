"""NeMo Gym's /verify body, read into what our verifiers score, and its answer written back.

Gym's resources servers take ``BaseVerifyRequest``: ``responses_create_params`` (the Responses
request the agent started from, ``input`` included) and ``response`` (the Responses object the
agent ended with, whose ``output`` holds the whole run: ``function_call`` and
``function_call_output`` items, then the final assistant ``message``). They answer
``BaseVerifyResponse``: the request echoed, plus ``reward``. Per-task fields sit beside these two
at the top level; ours is ``task`` (a TaskSpec), else the session's task is used.

The final answer is the text of the last assistant message; the tool calls are every
``function_call`` in the input and the output, each paired with the ``function_call_output`` of
the same ``call_id``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, ValidationError

from ..contracts import Record, TaskSpec, ToolCallRecord, ToolOutcome, ToolResult, VerifyResult
from ..contracts.limits import MAX_ITEMS

GYM_KEYS = ("responses_create_params", "response")


class GymBodyError(ValueError):
    """A Gym-shaped /verify body that cannot be read; the message names the field."""


class GymVerifyRequest(Record):
    """NeMo Gym's BaseVerifyRequest, with our task beside it."""

    model_config = Record.model_config | {"extra": "allow"}

    responses_create_params: dict[str, Any] = Field(description="The Responses request the run started from.")
    response: dict[str, Any] = Field(description="The Responses object the run ended with (its `output` items).")
    task: TaskSpec | None = Field(default=None, description="The task; default: the row's Gym dataset fields, "
                                  "else the session's task.")
    # A Gym dataset row's own fields (verifiers/gym_rows.py reads and checks them; typed here only for
    # the schema, so that a row that does not fit gets the row reader's message, naming the field).
    expected_answer: Any = Field(default=None, description="math and mcqa rows: the expected answer (mcqa: a letter).")
    options: Any = Field(default=None, description='mcqa rows: [{"A": text}, {"B": text}, ...].')
    grading_mode: Any = Field(default=None, description="mcqa rows: strict_single_letter_boxed (Gym's default), "
                              "lenient_boxed or lenient_answer_colon.")
    template_metadata: Any = Field(default=None, description="mcqa rows: {output_regex: a regex or a list}, "
                                   "read before the grading mode.")
    verifier_metadata: Any = Field(default=None, description="code_gen rows: {unit_tests: {inputs, outputs, "
                                   "fn_name}} or {unit_tests: {packed, fn_name}}.")
    instruction_id_list: Any = Field(default=None, description="instruction_following rows: IFEval instruction ids.")
    kwargs: Any = Field(default=None, description="instruction_following rows: one object of arguments per id.")


def is_gym_body(payload: Any) -> bool:
    """True when a /verify body is Gym-shaped (it names `responses_create_params` or `response`)."""
    return isinstance(payload, dict) and any(key in payload for key in GYM_KEYS)


def read_gym_body(payload: dict[str, Any]) -> GymVerifyRequest:
    """The body as a GymVerifyRequest; a GymBodyError naming the first bad field otherwise."""
    ours = [key for key in ("answer", "tool_calls", "trajectory") if key in payload]
    if ours:
        raise GymBodyError(f"{', '.join(ours)}: give NeMo Gym's responses_create_params and response, or our "
                           "answer/tool_calls/trajectory, not both")
    missing = [key for key in GYM_KEYS if key not in payload]
    if missing:
        raise GymBodyError(f"{missing[0]}: required in a NeMo Gym verify body")
    try:
        body = GymVerifyRequest.model_validate(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise GymBodyError(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    _items(body.response.get("output"), "response.output", required=True)
    _items(body.responses_create_params.get("input"), "responses_create_params.input", required=False)
    return body


def _items(value: Any, where: str, *, required: bool) -> list[dict[str, Any]]:
    if value is None and not required:
        return []
    if isinstance(value, str) and not required:
        return []  # a plain-text input: a user message, no items to read
    if not isinstance(value, list):
        raise GymBodyError(f"{where}: must be a list of items")
    if len(value) > MAX_ITEMS:
        raise GymBodyError(f"{where}: at most {MAX_ITEMS} items")
    for i, item in enumerate(value):
        if not isinstance(item, dict):
            raise GymBodyError(f"{where}.{i}: must be an object")
    return value


def content_text(content: Any) -> str:
    """The text of a Responses content: a string, or the `text` of each part joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def final_answer(body: GymVerifyRequest) -> str | None:
    """The text of the last assistant message of the response; None when it ended without one."""
    for item in reversed(_items(body.response.get("output"), "response.output", required=True)):
        if item.get("type", "message") == "message" and item.get("role", "assistant") == "assistant":
            return content_text(item.get("content"))
    return None


def run_tool_calls(body: GymVerifyRequest) -> list[ToolCallRecord] | None:
    """Every function call of the run with its output; None when the run holds no function call."""
    items = [*_items(body.responses_create_params.get("input"), "responses_create_params.input", required=False),
             *_items(body.response.get("output"), "response.output", required=True)]
    outputs = {item.get("call_id"): item.get("output") for item in items if item.get("type") == "function_call_output"}
    calls = []
    for i, item in enumerate(items):
        if item.get("type") != "function_call":
            continue
        name, raw = item.get("name"), item.get("arguments", "")
        if not isinstance(name, str) or not isinstance(raw, str):
            raise GymBodyError(f"function_call {item.get('call_id')!r}: `name` and `arguments` must be strings")
        try:
            parsed = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError:
            parsed = None
        call_id = str(item.get("call_id") or item.get("id") or f"call_{i}")
        output = outputs.get(call_id)
        # A call with no output never ran: the verifier sees it as a call that produced an error.
        result = ToolResult(name=name, content=content_text(output) if output is not None else "error: no output",
                            outcome=ToolOutcome.ok if output is not None else ToolOutcome.error)
        calls.append(ToolCallRecord(id=call_id, name=name, raw_arguments=raw,
                                    arguments=parsed if isinstance(parsed, dict) else None, result=result))
    return calls or None


def gym_answer(payload: dict[str, Any], verdict: VerifyResult, reward: float | None = None,
               extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Gym's BaseVerifyResponse (the request echoed, plus `reward`: the verdict's unless given, and any
    `extra` fields), with our verdict beside it."""
    return {**payload, **(extra or {}), "reward": verdict.reward if reward is None else reward,
            "verification": verdict.model_dump(mode="json")}
