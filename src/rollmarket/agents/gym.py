"""NeMo Gym's `/run` bodies, read into our task and written from our trajectory.

A Gym run request is a dataset row: `responses_create_params` (the OpenAI Responses API request:
`input`, `tools`, `temperature`, `top_p`, `max_output_tokens`) beside the task's own fields. Here
those fields are TaskSpec's (`verifier`, `answer` or Gym's `expected_answer`, `verifier_args`,
`files`, `task_id`, `metadata`), or, without `verifier`, a Gym dataset row's own fields
(verifiers/gym_rows.py: math, mcqa, code_gen, instruction_following). The answer is Gym's verify response: the request's fields, the
`response` (a Responses API object whose output items carry Gym's training fields
`prompt_token_ids`, `generation_token_ids`, `generation_log_probs`) and the `reward`.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from ..contracts import AgentTrajectory, SamplingConfig, TaskSpec, canonical_json
from ..verifiers.gym_rows import GymRowError, gym_reward, has_row_fields, task_from_row

GYM_KEY = "responses_create_params"
"""The field that marks a body as Gym's."""

_TASK_FIELDS = ("task_id", "prompt", "verifier", "answer", "verifier_args", "files", "metadata")


class GymBodyError(ValueError):
    """A Gym-shaped body that cannot be read as a task (the message says which field)."""


def is_gym_body(data: Any) -> bool:
    """Whether a /run body is Gym's shape (it has `responses_create_params`)."""
    return isinstance(data, dict) and GYM_KEY in data


def _text(content: Any) -> str:
    # Responses API content is a string or a list of parts ({"type": "input_text", "text": ...}).
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    raise GymBodyError(f"{GYM_KEY}.input: a message's content must be a string or a list of parts")


def _messages(params: dict) -> list[dict]:
    raw = params.get("input")
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise GymBodyError(f"{GYM_KEY}.input: required, a string or a non-empty list of messages")
    messages = []
    for item in raw:
        if not isinstance(item, dict) or item.get("type", "message") != "message" or "role" not in item:
            raise GymBodyError(f"{GYM_KEY}.input: only messages ({{role, content}}) start a run")
        role = "system" if item["role"] == "developer" else str(item["role"])  # chat templates know system
        messages.append({"role": role, "content": _text(item.get("content", ""))})
    return messages


def gym_task(data: dict) -> tuple[TaskSpec, SamplingConfig]:
    """The task and sampling of a Gym run request. Raises GymBodyError, or pydantic's
    ValidationError for task fields that do not fit TaskSpec."""
    params = data.get(GYM_KEY)
    if not isinstance(params, dict):
        raise GymBodyError(f"{GYM_KEY}: must be an object")
    tools = []
    for tool in params.get("tools") or []:
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or "name" not in tool:
            raise GymBodyError(f"{GYM_KEY}.tools: only function tools with a name are offered")
        tools.append(str(tool["name"]))
    fields = {key: data[key] for key in _TASK_FIELDS if key in data}
    if "verifier" not in fields and has_row_fields(data):
        # A row of one of Gym's datasets (math, mcqa, code_gen, instruction_following): its own
        # fields name the verifier and its args, as the resources server reads them on /verify.
        try:
            row = task_from_row(data)
        except GymRowError as exc:
            raise GymBodyError(str(exc)) from None
        fields = {"task_id": row.task_id, **fields, "verifier": row.verifier, "answer": row.answer,
                  "verifier_args": row.verifier_args, "metadata": {**row.metadata, **fields.get("metadata", {})}}
    if "answer" not in fields and "expected_answer" in data:
        fields["answer"] = data["expected_answer"]
    messages = _messages(params)
    # A row without an id is named by its content, so its reruns share a task id.
    fields.setdefault("task_id", "gym-" + hashlib.sha256(canonical_json(data)).hexdigest()[:16])
    task = TaskSpec.model_validate({**fields, "messages": messages, "tools": tools})
    sampling = {key: params[name] for key, name in (("temperature", "temperature"), ("top_p", "top_p"),
                                                    ("max_tokens", "max_output_tokens"), ("seed", "seed"))
                if params.get(name) is not None}
    return task, SamplingConfig.model_validate(sampling)


def _listed(array: Any) -> list:
    return [] if array is None else array.tolist()


def gym_response(data: dict, run: AgentTrajectory, task: TaskSpec | None = None) -> dict[str, Any]:
    """Gym's verify response for a run: the request's fields, `response` and `reward` (all or nothing
    for a task made from a Gym code or instructions row, as Gym's servers give it)."""
    output: list[dict[str, Any]] = []
    for step in run.steps:
        training = {
            "prompt_token_ids": _listed(step.prompt_token_ids),
            "generation_token_ids": _listed(step.response_token_ids),
            "generation_log_probs": _listed(step.logprobs),
        }
        if step.reasoning:
            output.append({"type": "reasoning", "id": f"rs_{run.task_id}_{step.index}",
                           "summary": [{"type": "summary_text", "text": step.reasoning}]})
        if step.content or not step.tool_calls:
            output.append({"type": "message", "id": f"msg_{step.index}", "role": "assistant",
                           "status": "completed", **training,
                           "content": [{"type": "output_text", "text": step.content, "annotations": []}]})
            training = {}
        for call in step.tool_calls:
            output.append({"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.name,
                           "arguments": call.raw_arguments, "status": "completed", **training})
            training = {}
            output.append({"type": "function_call_output", "call_id": call.id,
                           "output": json.dumps(call.result.model_dump(mode="json"))})
    incomplete = {"reason": "max_output_tokens"} if run.terminal_reason.value == "length" else None
    response = {"id": f"resp_{run.task_id}_{run.sample_index}", "object": "response", "created_at": int(time.time()),
                "model": run.model, "output": output, "status": "incomplete" if incomplete else "completed",
                "incomplete_details": incomplete, "parallel_tool_calls": True, "tool_choice": "auto",
                "tools": data[GYM_KEY].get("tools") or []}
    reward = gym_reward(task, run.verification) if task is not None and run.verification is not None else run.reward
    return {**data, "response": response, "reward": reward}
