"""`code`: the answer's Python passes the task's unit tests, run in the python_eval sandbox.

args: {"tests": ["assert add(1, 2) == 3", "assert not is_prime(8)"],
       "io": [{"stdin": "2 3\\n", "stdout": "5\\n"}], "setup": "", "timeout_s": 10, "memory_mb": 512}

The code is the last ```python (or bare ```) fenced block of the answer, else the whole answer.

**The verdict is ours, not the solution's.** The solution runs in the sandbox, in the same
interpreter as the harness that calls it, so anything that interpreter reports could be forged
(a printed success line, a patched builtin, an early `sys.exit(0)`). So the sandbox reports only
*values*, never a verdict, and never sees what they must equal:

- each test is one `assert` statement, split here: its comparison (`==`, `<`, `in`, a chain of
  them), any `not`, and every operand that is a literal (`3`, `[1, 2]`, `"ok"`, `set()`,
  `float("inf")`) stay in this
  process; only the other operands (`add(1, 2)`) go to the sandbox, which evaluates them in the
  namespace the code left and sends back each value as plain data (None, bool, int, float, str,
  bytes, list, tuple, set, frozenset, dict of those; exact types: an object with its own `__eq__`
  is refused). The comparison runs here on the decoded values. A bare `assert f(x)` sends `f(x)`
  and tests its truth here.
- each io case sends only its stdin; the sandbox runs `setup` and the code afresh as `__main__`
  and sends back what it printed, which is compared here with the case's stdout (line by line,
  trailing spaces and blank ends ignored; sys.exit(0) is a normal end).

A forged report can therefore only claim values, which it could as well have computed: a
solution that does not compute the expected values cannot pass. (Operands that are not literals,
and helpers from `setup`, run within the solution's reach: put expected values in the tests as
literals.) reward = tests and cases passed / their number; passed = all of them.

Typed failures (info.failure): `no_code`, `syntax_error` (the code does not compile; nothing
ran), `crashed` (the code raised, or exited, before any test ran: info.error; MemoryError there
is `resource_limit`), `tests_failed` (info.results: one {"test", "ok", "error"} per test, io
cases named `io[i]`), `timeout` (the wall-clock or CPU limit: the whole run is killed, reward 0),
`resource_limit` (memory, output), `refused` (the sandbox refused an action), `no_report` (the
run ended without a readable report: the code exited or killed itself early, or sent a report
that does not fit), `unavailable` (the sandbox cannot run here; the message says how to fix it).
A test that is not one `assert` statement (helpers and imports belong in `setup`) is a
VerifierConfigError.
"""

from __future__ import annotations

import ast
import json
import operator
import re
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    tests: list[str] = Field(default_factory=list, max_length=200, description="One `assert` statement each; "
                             "its literal operands and comparison are checked outside the sandbox.")
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


_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], bool]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_, ast.IsNot: operator.is_not}

_UNSET = object()


@dataclass(frozen=True)
class Check:
    """One test, split: what the sandbox evaluates (`sent`) and what this process decides with."""

    source: str
    negated: bool
    operands: tuple[Any, ...]
    """Per operand: its literal value, or _UNSET where the sandbox's value goes (in `sent` order)."""
    ops: tuple[Callable[[Any, Any], bool], ...]
    """Empty for a bare `assert x` (its truth is tested)."""
    sent: tuple[str, ...]

    def decide(self, values: list[Any]) -> bool:
        """The test's verdict from the sandbox's values of `sent`."""
        given = iter(values)
        operands = [next(given) if operand is _UNSET else operand for operand in self.operands]
        if not self.ops:
            held = bool(operands[0])
        else:
            held = all(op(a, b) for op, a, b in zip(self.ops, operands, operands[1:], strict=False))
        return held is not self.negated


# Calls that build a literal value, read here (not in the sandbox, where the solution could patch them).
_BUILDERS: dict[str, Callable[..., Any]] = {"set": set, "frozenset": frozenset, "tuple": tuple, "list": list,
                                            "dict": dict, "float": float}


def _literal(node: ast.expr) -> Any:
    """The value of a literal operand (`3`, `[1, 2]`, `set()`, `float('inf')`); ValueError otherwise."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _BUILDERS \
            and not node.keywords and len(node.args) <= 1:
        return _BUILDERS[node.func.id](*(ast.literal_eval(arg) for arg in node.args))
    return ast.literal_eval(node)


def split_test(source: str) -> Check:
    """The test as a Check; ValueError when it is not one assert statement."""
    body = ast.parse(source).body
    if len(body) != 1 or not isinstance(body[0], ast.Assert):
        raise ValueError("must be one assert statement (put helpers and imports in setup)")
    node, negated = body[0].test, False
    while isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
        node, negated = node.operand, not negated
    parts, ops = ([node.left, *node.comparators], tuple(_COMPARE[type(op)] for op in node.ops)) \
        if isinstance(node, ast.Compare) else ([node], ())
    operands, sent = [], []
    for part in parts:
        try:
            operands.append(_literal(part))
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            operands.append(_UNSET)
            sent.append(ast.unparse(part))
    if not sent:
        raise ValueError("names nothing the code computes (every operand is a literal)")
    return Check(source=source, negated=negated, operands=tuple(operands), ops=ops, sent=tuple(sent))


_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Runs in the sandbox beside the solution. It reports values, never verdicts: everything it prints
# may be forged by the solution, and nothing it knows (no expected value) helps a forger.
_HARNESS = """
import io as _io, json as _json, sys as _sys, traceback as _traceback
from contextlib import redirect_stdout as _redirect_stdout
_eval, _exec, _compile, _type, _repr = eval, exec, compile, type, repr
def _why(_exc):
    return _traceback.format_exception_only(_type(_exc), _exc)[-1].strip()[:300]
def _plain(_v):
    _t = _type(_v)
    if _v is None or _t is bool or _t is str:
        return ["v", _v]
    if _t is int:  # in hex: decimal conversions of huge ints are refused past 4300 digits
        return ["int", hex(_v)]
    if _t is float:
        return ["float", _repr(_v)]
    if _t is bytes:
        return ["bytes", _v.hex()]
    if _t is list or _t is tuple or _t is set or _t is frozenset:
        return [_t.__name__, [_plain(_x) for _x in _v]]
    if _t is dict:
        return ["dict", [[_plain(_k), _plain(_x)] for _k, _x in _v.items()]]
    raise TypeError("a " + _t.__name__ + " is not a plain value")
_error, _tests, _cases = None, [], []
if {tests!r}:
    _ns = {{"__name__": "__solution__"}}
    try:
        _exec(_compile({setup!r}, "<setup>", "exec"), _ns)
        _exec(_compile({code!r}, "<solution>", "exec"), _ns)
    except BaseException as _exc:
        _error = _why(_exc)
    if _error is None:
        for _sent in {tests!r}:
            _values = []
            try:
                for _source in _sent:
                    _values.append(_plain(_eval(_compile(_source, "<test>", "eval"), _ns)))
                _tests.append(["ok", _values])
            except BaseException as _exc:
                _tests.append(["raised", _why(_exc)])
if _error is None:
    for _stdin in {stdins!r}:
        _out, _stdin_was = _io.StringIO(), _sys.stdin
        _sys.stdin = _io.StringIO(_stdin)
        try:
            with _redirect_stdout(_out):
                _ns = {{"__name__": "__main__"}}
                try:
                    _exec(_compile({setup!r}, "<setup>", "exec"), _ns)
                    _exec(_compile({code!r}, "<solution>", "exec"), _ns)
                except SystemExit as _exit:  # a program may end with sys.exit(0)
                    if _exit.code not in (None, 0):
                        raise
            _cases.append(["ok", _out.getvalue()])
        except BaseException as _exc:
            _cases.append(["raised", _why(_exc)])
        finally:
            _sys.stdin = _stdin_was
_sys.stdout.flush()
print()
print({marker!r} + _json.dumps({{"error": _error, "tests": _tests, "cases": _cases}}))
"""

_OUTCOMES = {ToolOutcome.timeout: CodeFailure.timeout, ToolOutcome.resource_limit: CodeFailure.resource_limit,
             ToolOutcome.refused: CodeFailure.refused, ToolOutcome.unavailable: CodeFailure.unavailable}

_CONTAINERS: dict[str, Callable[[list[Any]], Any]] = {"list": list, "tuple": tuple, "set": set,
                                                      "frozenset": frozenset}


class BadReport(ValueError):
    """The sandbox's report does not have the shape the harness writes (a forger wrote it)."""


def _decode(node: Any) -> Any:
    """A value the harness sent, rebuilt from its tagged form (plain types only)."""
    if not isinstance(node, list) or len(node) != 2 or not isinstance(node[0], str):
        raise BadReport("not a tagged value")
    tag, body = node
    if tag == "v" and (body is None or type(body) in (bool, str)):
        return body
    if tag == "int" and isinstance(body, str):
        return int(body, 16)
    if tag == "float" and isinstance(body, str):
        return float(body)
    if tag == "bytes" and isinstance(body, str):
        return bytes.fromhex(body)
    if tag in _CONTAINERS and isinstance(body, list):
        return _CONTAINERS[tag](_decode(item) for item in body)
    if tag == "dict" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
        return {_decode(key): _decode(value) for key, value in body}
    raise BadReport(f"an unknown value tag {tag!r}")


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.strip().splitlines()]


def _shown(values: list[Any]) -> str:
    text = ", ".join(repr(value) for value in values)
    return text if len(text) <= 200 else text[:200] + "..."


def _judge_test(check: Check, entry: Any) -> tuple[bool, str | None]:
    match entry:
        case ["raised", str(why)]:
            return False, why
        case ["ok", list(sent)] if len(sent) == len(check.sent):
            values = [_decode(value) for value in sent]
        case _:
            raise BadReport("a test entry does not fit")
    try:
        held = check.decide(values)
    except Exception as exc:  # `<` between a str and an int: the test fails, as it would have raised
        return False, f"{type(exc).__name__}: {exc}"[:300]
    if held:
        return True, None
    return False, f"AssertionError: {check.source[:120]} (the code gave {_shown(values)})"


def _judge_case(case: IoCase, entry: Any) -> tuple[bool, str | None]:
    match entry:
        case ["raised", str(why)]:
            return False, why
        case ["ok", str(printed)]:
            same = _lines(printed) == _lines(case.stdout)
            return same, None if same else "printed " + repr(printed[:200])
    raise BadReport("an io entry does not fit")


def extract_code(answer: str) -> str:
    """The last fenced code block of `answer`, else the whole answer, stripped."""
    blocks = _FENCE.findall(answer)
    return (blocks[-1] if blocks else answer).strip()


@register_verifier
class CodeVerifier(Verifier):
    name = "code"
    Args = CodeArgs

    def expected(self, task: TaskSpec, args: CodeArgs) -> list[Check]:
        """Each test split into what the sandbox evaluates and what is decided here."""
        try:
            ast.parse(args.setup)
        except SyntaxError as exc:
            raise VerifierConfigError(f"verifier 'code' on {task.task_id}: setup is not Python: {exc.msg}") from None
        checks = []
        for i, test in enumerate(args.tests):
            try:
                checks.append(split_test(test))
            except SyntaxError as exc:
                raise VerifierConfigError(f"verifier 'code' on {task.task_id}: tests[{i}] is not Python: "
                                          f"{exc.msg}") from None
            except ValueError as exc:
                raise VerifierConfigError(f"verifier 'code' on {task.task_id}: tests[{i}] {exc}") from None
        return checks

    def score(self, task: TaskSpec, answer: str | None, tool_calls: Sequence[ToolCallRecord],
              args: CodeArgs, expected: list[Check]) -> VerifyResult:
        names = [*args.tests, *(f"io[{i}]" for i in range(len(args.io)))]
        shown: Any = {"tests": len(names)}
        code = extract_code(answer or "")
        if not code:
            return result(0.0, canonical=None, expected=shown, why="no code in the answer", failure=CodeFailure.no_code)
        try:
            ast.parse(code)
        except SyntaxError as exc:
            return result(0.0, canonical=None, expected=shown, why=f"the code does not compile: {exc.msg} "
                          f"(line {exc.lineno})", failure=CodeFailure.syntax_error)
        marker = f"@@rollmarket-code-report-{secrets.token_hex(8)}@@"
        program = _HARNESS.format(setup=args.setup, code=code, tests=[list(check.sent) for check in expected],
                                  stdins=[case.stdin for case in args.io], marker=marker)
        tool = PythonEval(SandboxLimits(timeout_s=args.timeout_s, memory_bytes=args.memory_mb * MiB))
        try:
            printed = tool.run({"code": program}, ToolContext())
        except ToolFailure as exc:
            failure = _OUTCOMES.get(exc.outcome, CodeFailure.crashed)
            return result(0.0, canonical=None, expected=shown, failure=failure,
                          why=f"{failure.value}: {str(exc).splitlines()[0][:200] if str(exc) else exc.outcome.value}")
        report = next((line[len(marker):] for line in reversed(printed.splitlines()) if line.startswith(marker)), None)
        try:
            body = json.loads(report) if report is not None else None
            if body is None:
                raise BadReport("no report")
            if body.get("error") is not None:
                if not isinstance(body["error"], str):
                    raise BadReport("error is not text")
                # MemoryError is the address-space limit biting inside the harness, not a bug of the code's own.
                failure = CodeFailure.resource_limit if body["error"].startswith("MemoryError") else CodeFailure.crashed
                return result(0.0, canonical=None, expected=shown, error=body["error"], failure=failure,
                              why=f"the code raised before the tests ran: {body['error'][:200]}")
            tests, cases = body.get("tests"), body.get("cases")
            if not isinstance(tests, list) or not isinstance(cases, list) or \
                    (len(tests), len(cases)) != (len(expected), len(args.io)):
                raise BadReport("the report does not list every test and case")
            verdicts = [*(_judge_test(check, entry) for check, entry in zip(expected, tests, strict=True)),
                        *(_judge_case(case, entry) for case, entry in zip(args.io, cases, strict=True))]
        except (BadReport, ValueError, TypeError, AttributeError, RecursionError) as exc:
            return result(0.0, canonical=None, expected=shown, failure=CodeFailure.no_report,
                          why=f"the run ended without a readable test report ({str(exc)[:100]}): the code exited "
                          "early or wrote a report of its own")
        results = [{"test": name[:200], "ok": ok, "error": error} for name, (ok, error) in zip(names, verdicts,
                                                                                             strict=True)]
        passed = sum(r["ok"] for r in results)
        reward = passed / len(results)
        if passed == len(results):
            return result(1.0, canonical=None, expected=shown, results=results)
        first = next(r for r in results if not r["ok"])
        return result(reward, canonical=None, expected=shown, results=results, failure=CodeFailure.tests_failed,
                      why=f"{len(results) - passed} of {len(results)} tests failed; first: {first['error']}")
