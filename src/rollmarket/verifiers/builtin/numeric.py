"""`numeric`: the number the answer states is within tolerance of the expected number.

reward = 1 if |got - want| <= max(rel_tol * max(|got|, |want|), abs_tol) else 0 (math.isclose).
got: the last \\boxed{} content if any, read whole as one number ('1e-3', '3/4', '1,234', '391.')
or else the last number in the text ('The answer is 1,234.' reads 1234). NaN and infinities
never match.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import Field

from ...contracts import TaskSpec, ToolCallRecord, VerifyResult
from ..extract import format_number, read_number
from ..verifier import (
    Verifier,
    VerifierArgs,
    VerifierConfigError,
    register_verifier,
    result,
)


class NumericArgs(VerifierArgs):
    rel_tol: float = Field(1e-6, ge=0, allow_inf_nan=False, description="Relative tolerance (of the larger magnitude).")
    abs_tol: float = Field(1e-9, ge=0, allow_inf_nan=False, description="Absolute tolerance, for answers near 0.")


@register_verifier
class NumericVerifier(Verifier):
    name = "numeric"
    Args = NumericArgs

    def expected(self, task: TaskSpec, args: NumericArgs) -> float:
        value = task.answer
        if isinstance(value, bool) or value is None:
            want = None
        elif isinstance(value, (int, float)):
            try:  # an int beyond a float's range (JSON has no limit) is as unreadable as NaN
                want = float(value)
            except OverflowError:
                want = None
            if want is not None and not math.isfinite(want):
                want = None
        elif isinstance(value, str):
            want = read_number(value)
        else:
            want = None
        if want is None:
            raise VerifierConfigError(f"verifier 'numeric' on {task.task_id}: expected answer {value!r} "
                                      "is not a finite number")
        return want

    def score(self, task: TaskSpec, answer: str | None, tool_calls: Sequence[ToolCallRecord],
              args: NumericArgs, expected: float) -> VerifyResult:
        want = format_number(expected)
        if answer is None or not answer.strip():
            return result(0.0, canonical=None, expected=want, why="no answer" if answer is None else "empty answer")
        got = read_number(answer)
        if got is None:
            return result(0.0, canonical=None, expected=want, why="no number in the answer")
        error = abs(got - expected)
        if math.isclose(got, expected, rel_tol=args.rel_tol, abs_tol=args.abs_tol):
            return result(1.0, canonical=format_number(got), expected=want, abs_error=error)
        return result(0.0, canonical=format_number(got), expected=want, abs_error=error if math.isfinite(error) else None,
                      why=f"{format_number(got)} is not within tolerance of {want}")
