"""`tool_use`: did the run call the right tools, with the right arguments, without failures?

Components (only those the args ask for; no_failed_calls always, unless count_failed is off):

* required_called: fraction of `required` tool names called at least once with outcome ok;
* no_forbidden: 1 if no call went to a `forbidden` tool (nor, with only_task_tools, to a tool the
  task does not offer), else 0;
* no_failed_calls: fraction of calls whose outcome is ok (1 when there were no calls);
* arguments_match: fraction of `expected_calls` matched by a distinct call of that name whose
  arguments include the expected ones (strings compared without case and whitespace under
  argument_match "normalized", numbers within 1e-9 relative); with order_matters the matches must
  come in the given order;
* within_max_calls: 1 if there were at most `max_calls` calls, else 0.

reward = the mean of the components (reduce "mean", the default), their product ("product") or
their minimum ("min"). passed = every component is 1. The answer text is not judged; its
normalized form is the voting key. A run that ended without a final answer is still scored.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ...contracts import TaskSpec, ToolCallRecord, ToolOutcome, VerifyResult
from ...tasks.answers import normalize
from ..verifier import (
    Verifier,
    VerifierArgs,
    VerifierConfigError,
    register_verifier,
    result,
)


class ExpectedCall(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="The tool that should be called.")
    arguments: dict[str, Any] = Field(default_factory=dict, description="Arguments the call must include.")


class ToolUseArgs(VerifierArgs):
    required: list[str] = Field(default_factory=list, description="Tools that must be called (successfully).")
    forbidden: list[str] = Field(default_factory=list, description="Tools that must not be called.")
    expected_calls: list[ExpectedCall] = Field(default_factory=list, description="Calls that must be made.")
    max_calls: int | None = Field(None, ge=0, description="Most tool calls allowed in the run.")
    order_matters: bool = Field(False, description="expected_calls must be made in the given order.")
    only_task_tools: bool = Field(True, description="A call to a tool the task does not offer counts as forbidden.")
    count_failed: bool = Field(True, description="Include the no_failed_calls component.")
    argument_match: Literal["exact", "normalized"] = Field(
        "normalized", description="How string arguments compare: exactly, or without case and whitespace.")
    reduce: Literal["mean", "product", "min"] = Field("mean", description="How components combine into the reward.")


def _same(want: Any, got: Any, mode: str) -> bool:
    if isinstance(want, bool) or isinstance(got, bool):
        return want is got
    if isinstance(want, (int, float)) and isinstance(got, (int, float)):
        return math.isclose(want, got, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(want, str) and isinstance(got, str) and mode == "normalized":
        return "".join(want.lower().split()) == "".join(got.lower().split())
    if isinstance(want, dict) and isinstance(got, dict):
        return want.keys() == got.keys() and all(_same(want[k], got[k], mode) for k in want)
    if isinstance(want, list) and isinstance(got, list):
        return len(want) == len(got) and all(_same(w, g, mode) for w, g in zip(want, got))
    return want == got


def _matches(expected: ExpectedCall, call: ToolCallRecord, mode: str) -> bool:
    arguments = call.arguments or {}
    return call.name == expected.name and all(
        key in arguments and _same(value, arguments[key], mode) for key, value in expected.arguments.items())


def match_calls(expected: Sequence[ExpectedCall], calls: Sequence[ToolCallRecord], *, ordered: bool,
                mode: str) -> list[int | None]:
    """For each expected call, the index of the call matched to it (each call used once), or None.
    Greedy: unordered, the first unused match; ordered, the first match after the previous one."""
    used: set[int] = set()
    matched: list[int | None] = []
    cursor = 0
    for want in expected:
        start = cursor if ordered else 0
        found = next((i for i in range(start, len(calls)) if i not in used and _matches(want, calls[i], mode)), None)
        matched.append(found)
        if found is not None:
            used.add(found)
            cursor = found + 1
    return matched


@register_verifier
class ToolUseVerifier(Verifier):
    name = "tool_use"
    Args = ToolUseArgs
    needs_final_answer = False
    judges_answer = False

    def expected(self, task: TaskSpec, args: ToolUseArgs) -> dict[str, Any]:
        checks = {
            "required": args.required, "forbidden": args.forbidden,
            "expected_calls": [c.model_dump() for c in args.expected_calls], "max_calls": args.max_calls,
        }
        if not (args.count_failed or any(v not in (None, []) for v in checks.values())):
            raise VerifierConfigError(f"verifier 'tool_use' on {task.task_id}: nothing to check (give required, "
                                      "forbidden, expected_calls or max_calls, or keep count_failed)")
        return {k: v for k, v in checks.items() if v not in (None, [])}

    def score(self, task: TaskSpec, answer: str | None, tool_calls: Sequence[ToolCallRecord],
              args: ToolUseArgs, expected: dict[str, Any]) -> VerifyResult:
        components: dict[str, float] = {}
        problems: list[str] = []
        succeeded = {c.name for c in tool_calls if c.result.outcome is ToolOutcome.ok}
        if args.required:
            missing = [name for name in args.required if name not in succeeded]
            components["required_called"] = 1 - len(missing) / len(args.required)
            if missing:
                problems.append(f"not called: {', '.join(missing)}")
        offered = set(task.tools) if args.only_task_tools and task.tools else None
        if args.forbidden or offered is not None:
            bad = sorted({c.name for c in tool_calls
                          if c.name in args.forbidden or (offered is not None and c.name not in offered)})
            components["no_forbidden"] = 0.0 if bad else 1.0
            if bad:
                problems.append(f"forbidden: {', '.join(bad)}")
        if args.count_failed:
            failed = [c for c in tool_calls if c.result.outcome is not ToolOutcome.ok]
            components["no_failed_calls"] = 1 - len(failed) / len(tool_calls) if tool_calls else 1.0
            if failed:
                problems.append(f"{len(failed)} failed call(s): "
                                + ", ".join(sorted({f"{c.name} ({c.result.outcome.value})" for c in failed})))
        matched: list[int | None] = []
        if args.expected_calls:
            matched = match_calls(args.expected_calls, tool_calls, ordered=args.order_matters,
                                  mode=args.argument_match)
            hits = sum(m is not None for m in matched)
            components["arguments_match"] = hits / len(matched)
            if hits < len(matched):
                problems.append(f"{len(matched) - hits} expected call(s) not made")
        if args.max_calls is not None:
            components["within_max_calls"] = float(len(tool_calls) <= args.max_calls)
            if len(tool_calls) > args.max_calls:
                problems.append(f"{len(tool_calls)} calls > max_calls {args.max_calls}")
        values = list(components.values())
        reward = (sum(values) / len(values) if args.reduce == "mean"
                  else math.prod(values) if args.reduce == "product" else min(values))
        passed = all(v == 1.0 for v in values)
        canonical = normalize(answer) if answer and answer.strip() else None
        return result(reward, passed=passed, components=components, canonical=canonical, expected=expected,
                      why="; ".join(problems) if problems else None, calls=[c.name for c in tool_calls],
                      matched_calls=matched)
