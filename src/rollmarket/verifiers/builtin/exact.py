"""`exact`: the answer equals the expected text (or one of its aliases) after normalization.

reward = 1 if normalize(answer) is in {normalize(e) for e in [task.answer, *aliases]} else 0.
normalize: the last \\boxed{} content if any (extract_boxed), surrounding quotes, backticks and
periods stripped, runs of whitespace made one space, lower case unless case_sensitive.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field

from ...contracts import TaskSpec, ToolCallRecord, VerifyResult
from ...tasks.answers import normalize
from ..extract import answer_span
from ..verifier import (
    Verifier,
    VerifierArgs,
    VerifierConfigError,
    register_verifier,
    result,
)


class ExactArgs(VerifierArgs):
    case_sensitive: bool = Field(False, description="Compare case as written.")
    aliases: list[str] = Field(default_factory=list, description="Other answers that also count as right.")
    extract_boxed: bool = Field(True, description="Compare the last \\boxed{} content when the answer has one.")


def _normalize(text: str, case_sensitive: bool) -> str:
    if not case_sensitive:
        return normalize(text)
    return " ".join(text.strip().strip(".\"'`").split())


@register_verifier
class ExactVerifier(Verifier):
    name = "exact"
    Args = ExactArgs

    def expected(self, task: TaskSpec, args: ExactArgs) -> list[str]:
        answers = task.answer if isinstance(task.answer, list) else [] if task.answer is None else [task.answer]
        answers = [*answers, *args.aliases]
        if not answers or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in answers):
            raise VerifierConfigError(f"verifier 'exact' on {task.task_id}: the expected answer must be text "
                                      "(or a list of texts, or aliases)")
        return [_normalize(str(a), args.case_sensitive) for a in answers]

    def score(self, task: TaskSpec, answer: str | None, tool_calls: Sequence[ToolCallRecord],
              args: ExactArgs, expected: list[str]) -> VerifyResult:
        shown: Any = expected[0] if len(expected) == 1 else expected
        if answer is None:
            return result(0.0, canonical=None, expected=shown, why="no answer")
        got = _normalize(answer_span(answer, boxed=args.extract_boxed), args.case_sensitive)
        if not got:
            return result(0.0, canonical=None, expected=shown, why="empty answer")
        if got in expected:
            return result(1.0, canonical=got, expected=shown, matched=got)
        return result(0.0, canonical=got, expected=shown, why=f"{got[:80]!r} is not the expected answer")
