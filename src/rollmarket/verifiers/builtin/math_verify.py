"""`math_verify`: Hugging Face's maintained `math-verify` library decides whether the answer equals the
expected one (the extra `pip install 'rollmarket[math-verify]'`).

args: {"float_rounding": 6, "numeric_precision": 15, "strict": true, "time_limit_s": 5}

Beside `math` (our own sympy checker), for tasks whose answers are LaTeX the way math-verify's
benchmarks write them: both sides are read with math-verify's `parse` (LaTeX with \\boxed{} first,
then plain expressions), and compared with its `verify` (sets, intervals, matrices, equations,
percentages and units as that library treats them). reward = 1 if equal else 0.

math-verify times itself with SIGALRM, which works only in a main thread; here its own timeouts
are off and the whole parse-and-compare runs in a child process killed after time_limit_s
(rollmarket.verifiers.limits), so a resources server's threads can use it.

Typed failures (info.failure): `no_answer`, `unreadable` (math-verify found no expression),
`timeout`, `not_equal`.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from pydantic import Field

from ...contracts import TaskSpec, ToolCallRecord, VerifyResult
from ..limits import CallTimeout, call_in_child
from ..verifier import (
    Verifier,
    VerifierArgs,
    VerifierConfigError,
    register_verifier,
    result,
)

INSTALL_HINT = "pip install 'rollmarket[math-verify]'"


class MathVerifyFailure(StrEnum):
    """Why a math-verify answer scored 0."""

    no_answer = "no_answer"
    unreadable = "unreadable"
    timeout = "timeout"
    not_equal = "not_equal"


class MathVerifyArgs(VerifierArgs):
    float_rounding: int = Field(6, ge=0, le=30, description="Decimal places floats are rounded to before comparing.")
    numeric_precision: int = Field(15, ge=1, le=100, description="Digits of sympy's numeric evaluation.")
    strict: bool = Field(True, description="math-verify's strict mode (variables must match too).")
    time_limit_s: float = Field(5.0, gt=0, le=60, description="Wall-clock limit of one parse-and-compare.")


def _parse(text: str) -> list[Any]:
    """What math-verify reads in `text`; [] when it finds no expression (its fallback, the raw text
    kept as a string, is no reading)."""
    from math_verify import parse

    # It warns on every call that its own timeouts are off: the child's kill is the limit here.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    found = [x for x in parse(text, parsing_timeout=None) if not isinstance(x, str)]
    if not found and "$" not in text:  # a bare LaTeX gold answer such as \frac{1}{2}
        found = [x for x in parse(f"${text}$", parsing_timeout=None) if not isinstance(x, str)]
    return found


def read_and_compare(gold: str, answer: str | None, float_rounding: int, numeric_precision: int,
                     strict: bool) -> tuple[str | None, str | None, bool]:
    """(gold as read, answer as read, equal); None for a side math-verify could not read. Runs in a child."""
    from math_verify import verify

    want = _parse(gold)
    if not want or answer is None:
        return (str(want[0]) if want else None), None, False
    got = _parse(answer)
    if not got:
        return str(want[0]), None, False
    equal = verify(want, got, float_rounding=float_rounding, numeric_precision=numeric_precision, strict=strict,
                   timeout_seconds=None)
    return str(want[0]), str(got[0]), bool(equal)


@register_verifier
class MathVerifyVerifier(Verifier):
    name = "math_verify"
    Args = MathVerifyArgs

    def expected(self, task: TaskSpec, args: MathVerifyArgs) -> str:
        if importlib.util.find_spec("math_verify") is None:
            raise VerifierConfigError(f"verifier 'math_verify' needs the math-verify library: {INSTALL_HINT}")
        want = task.answer
        if isinstance(want, bool) or not isinstance(want, (str, int, float)) or not str(want).strip():
            raise VerifierConfigError(f"verifier 'math_verify' on {task.task_id}: the expected answer must be "
                                      f"a non-empty text or number, not {want!r}")
        return str(want)

    def score(self, task: TaskSpec, answer: str | None, tool_calls: Sequence[ToolCallRecord],
              args: MathVerifyArgs, expected: str) -> VerifyResult:
        if answer is None or not answer.strip():
            return result(0.0, canonical=None, expected=expected, why="no answer", failure=MathVerifyFailure.no_answer)
        try:
            gold, got, equal = call_in_child(
                read_and_compare, (expected, answer, args.float_rounding, args.numeric_precision, args.strict),
                timeout_s=args.time_limit_s)
        except CallTimeout:
            return result(0.0, canonical=None, expected=expected, why=f"timed out after {args.time_limit_s:g}s",
                          failure=MathVerifyFailure.timeout)
        if gold is None:
            raise VerifierConfigError(f"verifier 'math_verify' on {task.task_id}: math-verify cannot read the "
                                      f"expected answer {expected!r}")
        if got is None:
            return result(0.0, canonical=None, expected=gold, why="math-verify found no expression in the answer",
                          failure=MathVerifyFailure.unreadable)
        if equal:
            return result(1.0, canonical=got, expected=gold)
        return result(0.0, canonical=got, expected=gold, why=f"{got[:80]} is not equal to {gold[:80]}",
                      failure=MathVerifyFailure.not_equal)
