"""`code`: the answer's Python passes the task's unit tests, run in the python_eval sandbox.

args: {"tests": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"],
       "io": [{"stdin": "2 3\\n", "stdout": "5\\n"}], "setup": "", "timeout_s": 10, "memory_mb": 512}

The code is the last ```python (or bare ```) fenced block of the answer, else the whole answer.
One sandboxed run (python_eval's bubblewrap sandbox, standard library only, no network) executes
`setup`, then the code, then each test statement on its own in the namespace the code left; then,
for each io case, `setup` and the code afresh as `__main__` reading the case's stdin, its printed
lines compared with the case's stdout (trailing spaces and blank ends ignored; sys.exit(0) is a
normal end). reward = tests and cases passed / their number; passed = all of them.

Typed failures (info.failure): `no_code`, `syntax_error` (the code does not compile; nothing
ran), `crashed` (the code raised before any test statement ran: info.error; MemoryError there is
`resource_limit`), `tests_failed` (info.results: one {"test", "ok", "error"} per test, io cases
named `io[i]`), `timeout` (the wall-clock or CPU limit: the whole run is
killed, reward 0), `resource_limit` (memory, output), `refused` (the sandbox refused an action),
`no_report` (the run ended without its report: the code exited or killed itself early),
`unavailable` (the sandbox cannot run here; the message says how to fix it).

The tests guard against mistakes, not against code written to fool them: the code runs in the same
interpreter as the test harness and could, with effort, forge its report. The sandbox keeps such
code off the host either way.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
from collections.abc import Sequence
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ...agents.tool import ToolContext, ToolFailure
from ...agents.tools.python_eval import MiB, PythonEval, SandboxLimits
from ...contracts import TaskSpec, ToolCallRecord, ToolOutcome, VerifyResult
from ..verifier import (
    Verifier,
    VerifierArgs,
    VerifierConfigError,
    register_verifier,
    result,
)


class CodeFailure(StrEnum):
    """Why a code answer scored below a pass."""

    no_code = "no_code"
    syntax_error = "syntax_error"
    crashed = "crashed"
    tests_failed = "tests_failed"
    timeout = "timeout"
    resource_limit = "resource_limit"
    refused = "refused"
    no_report = "no_report"
    unavailable = "unavailable"


class IoCase(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    stdin: str = Field("", description="What the program reads.")
    stdout: str = Field(description="What it must print (compared line by line, trailing spaces ignored).")


class CodeArgs(VerifierArgs):
    tests: list[str] = Field(default_factory=list, max_length=200, description="Python statements; a test passes "
                             "when it runs without raising (assert ...).")
    io: list[IoCase] = Field(default_factory=list, max_length=200, description="Program cases: the code runs as "
                             "__main__ on stdin and must print stdout.")
    setup: str = Field("", description="Python run before the code (imports, helpers the tests use).")
    timeout_s: float = Field(10.0, gt=0, le=120, description="Wall-clock limit of the whole run.")
    memory_mb: int = Field(512, ge=64, le=8192, description="Address-space limit of the run.")

    @model_validator(mode="after")
    def _some(self) -> CodeArgs:
        if not self.tests and not self.io:
            raise ValueError("give tests, io cases or both")
        return self


_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

_HARNESS = """
import io as _io, json as _json, sys as _sys, traceback as _traceback
from contextlib import redirect_stdout as _redirect_stdout
def _why(_exc):
    return _traceback.format_exception_only(type(_exc), _exc)[-1].strip()[:300]
def _lines(_text):
    return [_line.rstrip() for _line in _text.strip().splitlines()]
_results = []
_error = None
if {tests!r}:
    _ns = {{"__name__": "__solution__"}}
    try:
        exec(compile({setup!r}, "<setup>", "exec"), _ns)
        exec(compile({code!r}, "<solution>", "exec"), _ns)
    except BaseException as _exc:
        _error = _why(_exc)
    if _error is None:
        for _test in {tests!r}:
            try:
                exec(compile(_test, "<test>", "exec"), _ns)
                _results.append([True, None])
            except BaseException as _exc:
                _results.append([False, _why(_exc)])
if _error is None:
    for _stdin, _want in {io!r}:
        _out, _stdin_was = _io.StringIO(), _sys.stdin
        _sys.stdin = _io.StringIO(_stdin)
        try:
            with _redirect_stdout(_out):
                _ns = {{"__name__": "__main__"}}
                try:
                    exec(compile({setup!r}, "<setup>", "exec"), _ns)
                    exec(compile({code!r}, "<solution>", "exec"), _ns)
                except SystemExit as _exit:  # a program may end with sys.exit(0)
                    if _exit.code not in (None, 0):
                        raise
            _same = _lines(_out.getvalue()) == _lines(_want)
            _results.append([_same, None if _same else "printed " + repr(_out.getvalue()[:200])])
        except BaseException as _exc:
            _results.append([False, _why(_exc)])
        finally:
            _sys.stdin = _stdin_was
_sys.stdout.flush()
print()
print({marker!r} + _json.dumps({{"error": _error, "results": _results}}))
"""

_OUTCOMES = {ToolOutcome.timeout: CodeFailure.timeout, ToolOutcome.resource_limit: CodeFailure.resource_limit,
             ToolOutcome.refused: CodeFailure.refused, ToolOutcome.unavailable: CodeFailure.unavailable}


def extract_code(answer: str) -> str:
    """The last fenced code block of `answer`, else the whole answer, stripped."""
    blocks = _FENCE.findall(answer)
    return (blocks[-1] if blocks else answer).strip()


@register_verifier
class CodeVerifier(Verifier):
    name = "code"
    Args = CodeArgs

    def expected(self, task: TaskSpec, args: CodeArgs) -> list[str]:
        """The test names, in report order: each test statement, then `io[i]` for each program case."""
        for where, source in (("setup", args.setup), *((f"tests[{i}]", t) for i, t in enumerate(args.tests))):
            try:
                ast.parse(source)
            except SyntaxError as exc:
                raise VerifierConfigError(f"verifier 'code' on {task.task_id}: {where} is not Python: {exc.msg}") \
                    from None
        return [*args.tests, *(f"io[{i}]" for i in range(len(args.io)))]

    def score(self, task: TaskSpec, answer: str | None, tool_calls: Sequence[ToolCallRecord],
              args: CodeArgs, expected: list[str]) -> VerifyResult:
        shown: Any = {"tests": len(expected)}
        code = extract_code(answer or "")
        if not code:
            return result(0.0, canonical=None, expected=shown, why="no code in the answer", failure=CodeFailure.no_code)
        try:
            ast.parse(code)
        except SyntaxError as exc:
            return result(0.0, canonical=None, expected=shown, why=f"the code does not compile: {exc.msg} "
                          f"(line {exc.lineno})", failure=CodeFailure.syntax_error)
        marker = f"@@rollmarket-code-report-{secrets.token_hex(8)}@@"
        program = _HARNESS.format(setup=args.setup, code=code, tests=list(args.tests),
                                  io=[(case.stdin, case.stdout) for case in args.io], marker=marker)
        tool = PythonEval(SandboxLimits(timeout_s=args.timeout_s, memory_bytes=args.memory_mb * MiB))
        try:
            printed = tool.run({"code": program}, ToolContext())
        except ToolFailure as exc:
            failure = _OUTCOMES.get(exc.outcome, CodeFailure.crashed)
            return result(0.0, canonical=None, expected=shown, failure=failure,
                          why=f"{failure.value}: {str(exc).splitlines()[0][:200] if str(exc) else exc.outcome.value}")
        report = next((line[len(marker):] for line in reversed(printed.splitlines()) if line.startswith(marker)), None)
        if report is None:
            return result(0.0, canonical=None, expected=shown, failure=CodeFailure.no_report,
                          why="the run ended without the test report (the code exited early)")
        body = json.loads(report)
        if body["error"] is not None:
            # MemoryError is the address-space limit biting inside the harness, not a bug of the code's own.
            failure = CodeFailure.resource_limit if body["error"].startswith("MemoryError") else CodeFailure.crashed
            return result(0.0, canonical=None, expected=shown, error=body["error"], failure=failure,
                          why=f"the code raised before the tests ran: {body['error'][:200]}")
        results = [{"test": test[:200], "ok": ok, "error": error} for test, (ok, error) in zip(expected, body["results"],
                                                                                                 strict=True)]
        passed = sum(r["ok"] for r in results)
        reward = passed / len(results)
        if passed == len(results):
            return result(1.0, canonical=None, expected=shown, results=results)
        first = next(r for r in results if not r["ok"])
        return result(reward, canonical=None, expected=shown, results=results, failure=CodeFailure.tests_failed,
                      why=f"{len(results) - passed} of {len(results)} tests failed; first: {first['error']}")
