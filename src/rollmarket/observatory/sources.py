"""Agent runs from elsewhere: what the capture proxy recorded in front of any engine (vLLM, SGLang,
our server), turned into AgentTrajectory records the runner can teacher-force.

One conversation (the proxy's `conversation_id`) becomes one run; each captured chat call is one
turn, in `turn_index` order, with the prompt ids, response ids, logprobs and routed experts the
upstream returned. Tool results are read back from the next turn's messages. Captures carry no
verdict, so runs from them have no verification.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..contracts import AgentStep, AgentTrajectory, Capture, TerminalReason, ToolCallRecord, ToolOutcome, ToolResult


def _arguments(raw: str) -> dict | None:
    try:
        value = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _tool_results(messages: list[dict]) -> dict[str, str]:
    return {str(m["tool_call_id"]): str(m.get("content") or "") for m in messages
            if m.get("role") == "tool" and m.get("tool_call_id")}


def conversation_run(captures: list[Capture]) -> AgentTrajectory | None:
    """The run of one conversation's chat captures (first choice of each), or None if it has none
    with token ids."""
    turns = sorted((c for c in captures if c.choices and c.messages is not None), key=lambda c: c.turn_index)
    if not turns:
        return None
    later_messages = [m for c in turns for m in (c.messages or [])]
    results = _tool_results(later_messages)
    steps = []
    for i, capture in enumerate(turns):
        choice = capture.choices[0]
        if choice.response_token_ids is None or (capture.prompt_token_ids is None and choice.prompt_token_ids is None):
            return None
        calls = [ToolCallRecord(id=call.id or f"call_{k}", name=call.name, raw_arguments=call.arguments,
                                arguments=_arguments(call.arguments),
                                result=ToolResult(name=call.name, content=results.get(call.id or "", ""),
                                                  outcome=ToolOutcome.ok))
                 for k, call in enumerate(choice.tool_calls)]
        steps.append(AgentStep(
            index=i, prompt_token_ids=choice.prompt_token_ids if choice.prompt_token_ids is not None
            else capture.prompt_token_ids, response_token_ids=choice.response_token_ids,
            logprobs=choice.logprobs, routed_experts=choice.routed_experts, content=choice.content or "",
            tool_calls=calls, finish_reason=choice.finish_reason or "stop"))
    last = steps[-1]
    final = None if last.tool_calls else last.content
    reason = (TerminalReason.length if last.finish_reason == "length"
              else TerminalReason.max_steps if last.tool_calls else TerminalReason.final_answer)
    messages = list(turns[-1].messages or []) + [{"role": "assistant", "content": last.content}]
    return AgentTrajectory(task_id=turns[0].conversation_id, sample_index=0, model=turns[-1].upstream_model or "",
                           messages=messages, steps=steps, final_answer=final, terminal_reason=reason)


def runs_from_captures(store: str | Path) -> list[AgentTrajectory]:
    """Every conversation in a capture store (`rollmarket proxy --store`) as one run, oldest first."""
    from ..proxy.store import CaptureStore

    by_conversation: dict[str, list[Capture]] = {}
    for _, capture in CaptureStore(Path(store)).iter_captures():
        if capture.endpoint.endswith("/chat/completions"):
            by_conversation.setdefault(capture.conversation_id, []).append(capture)
    runs = [conversation_run(captures) for captures in by_conversation.values()]
    return [run for run in runs if run is not None]
