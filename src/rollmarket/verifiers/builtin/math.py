"""`math`: the answer is mathematically equal to the expected expression (sympy).

reward = 1 if equal(answer, expected) else 0, decided in three stages, cheapest first:

1. sympy's automatic simplification makes `a - b` zero ("2x+1" vs "1+2*x", "sqrt(8)" vs "2*sqrt(2)");
2. numeric sampling: both sides agree (within rel_tol) at `samples` seeded random points of their
   free symbols (one point for constants: "1/2" vs "0.5"); one clear disagreement is "not equal";
3. when sampling cannot decide (every point undefined), `simplify(a - b) == 0` in a child process
   killed after `time_limit_s` (a timeout scores 0 with why "timed out").

Reading an answer never runs model text as code. The text is cut to `max_chars`, LaTeX is turned
into plain syntax, and it must pass a whitelist (digits, letters, `+-*/^().,!` and spaces; a `.`
only before a digit; no `__`, no Python keywords, no sympy internals such as `Pow`) before sympy's
`parse_expr` sees it with a restricted global dict (no builtins) and `evaluate=False`. The
unevaluated tree is then checked for bombs (`9**9**9`, `100000!`, thousands of terms) before
anything is evaluated. A \\boxed{} answer, `$...$`, `x = ...` (the right-hand side) and a trailing
sentence ("... so the answer is 1/2") are read.
"""

from __future__ import annotations

import keyword
import math
import random
import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import sympy
from pydantic import Field
from sympy.parsing.sympy_parser import (
    convert_xor,
    implicit_application,
    implicit_multiplication,
    parse_expr,
    standard_transformations,
)

from ...contracts import TaskSpec, ToolCallRecord, VerifyResult
from ..extract import format_number, last_boxed
from ..limits import CallTimeout, call_in_child
from ..verifier import (
    Verifier,
    VerifierArgs,
    VerifierConfigError,
    register_verifier,
    result,
)

MAX_EXPONENT = 1000
"""A constant exponent larger than this (in magnitude) makes an answer unreadable."""
MAX_DIGITS = 4000
"""A constant power whose result would have more digits than this is unreadable."""
MAX_FACTORIAL = 1000
MAX_NODES = 400
"""Most nodes in an expression tree."""
_ABS_TOL = 1e-12


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


class MathArgs(VerifierArgs):
    rel_tol: float = Field(1e-9, ge=0, allow_inf_nan=False,
                           description="Relative tolerance of the numeric comparison at each sample point.")
    samples: int = Field(6, ge=0, le=64, description="Random points tried per comparison; 0 goes straight to simplify.")
    time_limit_s: float = Field(2.0, gt=0, le=60, description="Wall-clock limit of the simplify stage.")
    max_chars: int = Field(500, ge=1, le=10_000, description="Longer expressions are not read (reward 0).")


def _guarded_factorial(n: Any, **kwargs: Any) -> Any:
    if isinstance(n, sympy.Integer) and abs(int(n)) > MAX_FACTORIAL:
        raise _Unreadable(f"factorial of {n} is too large")
    return sympy.factorial(n, **kwargs)


_USER_NAMES: dict[str, Any] = {
    "sqrt": sympy.sqrt, "exp": sympy.exp, "log": sympy.log, "ln": sympy.log,
    "sin": sympy.sin, "cos": sympy.cos, "tan": sympy.tan, "cot": sympy.cot, "sec": sympy.sec, "csc": sympy.csc,
    "asin": sympy.asin, "acos": sympy.acos, "atan": sympy.atan,
    "arcsin": sympy.asin, "arccos": sympy.acos, "arctan": sympy.atan,
    "sinh": sympy.sinh, "cosh": sympy.cosh, "tanh": sympy.tanh,
    "abs": sympy.Abs, "Abs": sympy.Abs, "floor": sympy.floor, "ceil": sympy.ceiling, "ceiling": sympy.ceiling,
    "factorial": _guarded_factorial,
    "pi": sympy.pi, "e": sympy.E, "E": sympy.E, "oo": sympy.oo, "inf": sympy.oo, "infinity": sympy.oo,
}
"""Names an answer may use; every other identifier becomes a plain symbol."""

_PARSER_NAMES: dict[str, Any] = {
    "Integer": sympy.Integer, "Float": sympy.Float, "Rational": sympy.Rational, "Symbol": sympy.Symbol,
    "Function": sympy.Function, "Add": sympy.Add, "Mul": sympy.Mul, "Pow": sympy.Pow,
    "factorial": _guarded_factorial,
}
"""Names the parser's own generated code calls; an answer may not spell them itself."""

_TRANSFORMS = standard_transformations + (implicit_multiplication, implicit_application, convert_xor)
_ALLOWED = re.compile(r"[0-9A-Za-z_\s+\-*/^().,!]*")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_LATEX_DROP = re.compile(r"\\(?:left|right|displaystyle|!|,|;|:| )|\^\s*\{?\\circ\}?|°|\\\(|\\\)|\\\[|\\\]|\$")
_LATEX_WORDS = {"cdot": "*", "times": "*", "div": "/", "infty": "oo", "pi": "pi", "ln": "log", "log": "log",
                "exp": "exp", "sin": "sin", "cos": "cos", "tan": "tan", "cot": "cot", "sec": "sec", "csc": "csc",
                "arcsin": "asin", "arccos": "acos", "arctan": "atan", "sinh": "sinh", "cosh": "cosh",
                "tanh": "tanh"}
_LEAD_IN = re.compile(r"(?:answer\s*(?:is|:)|=|:|\bis\b)\s*", re.IGNORECASE)


class _Unreadable(ValueError):
    """The text is not an expression this verifier will read."""


def _group(text: str, i: int) -> tuple[str, int]:
    """The `{...}` group (or single character) at `text[i:]` and the index after it."""
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        raise _Unreadable("a LaTeX command is missing its argument")
    if text[i] != "{":
        return text[i], i + 1
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j], j + 1
    raise _Unreadable("unbalanced braces")


def _plain(text: str) -> str:
    """LaTeX math to the plain syntax parse_expr reads: \\frac{a}{b} -> ((a)/(b)), \\sqrt[n]{a}, ^{..}, \\cdot."""
    text = re.sub(r"\\text\{([^{}]*)\}", r" \1 ", text)
    text = _LATEX_DROP.sub(" ", text)
    out: list[str] = []
    i = 0
    while i < len(text):
        if text[i] != "\\":
            out.append(text[i])
            i += 1
            continue
        word = re.match(r"\\([A-Za-z]+)", text[i:])
        if not word:
            raise _Unreadable(f"LaTeX {text[i:i + 2]!r} is not supported")
        name, i = word.group(1), i + word.end()
        if name in ("frac", "dfrac", "tfrac"):
            num, i = _group(text, i)
            den, i = _group(text, i)
            out.append(f"(({_plain(num)})/({_plain(den)}))")
        elif name == "sqrt":
            index = None
            if i < len(text) and text[i] == "[":
                close = text.find("]", i)
                if close < 0:
                    raise _Unreadable("unbalanced brackets")
                index, i = text[i + 1:close], close + 1
            arg, i = _group(text, i)
            out.append(f"(({_plain(arg)})**(1/({_plain(index)})))" if index else f"sqrt({_plain(arg)})")
        elif name in _LATEX_WORDS:
            out.append(f" {_LATEX_WORDS[name]} ")
        else:
            raise _Unreadable(f"LaTeX \\{name} is not supported")
    return "".join(out).replace("{", "(").replace("}", ")")


def _screen(text: str) -> str:
    """The whitelist: raise _Unreadable unless `text` is plain arithmetic over names and numbers."""
    if not _ALLOWED.fullmatch(text):
        bad = sorted({c for c in text if not _ALLOWED.fullmatch(c)})[:5]
        raise _Unreadable(f"characters {''.join(bad)!r} are not allowed")
    if "__" in text or re.search(r"\.(?!\d)", text):
        raise _Unreadable("attribute access is not allowed")
    for name in _IDENT.findall(text):
        if keyword.iskeyword(name) or (name in _PARSER_NAMES and name not in _USER_NAMES):
            raise _Unreadable(f"the name {name!r} is not allowed")
    return text


def _magnitude(expr: sympy.Basic) -> float:
    try:
        return abs(complex(expr.evalf(15)))
    except (TypeError, ValueError, OverflowError) as exc:
        raise _Unreadable("an exponent is not a number") from exc


def _guard(expr: sympy.Basic) -> None:
    """Raise _Unreadable if evaluating the unevaluated tree `expr` could blow up."""
    for count, node in enumerate(sympy.postorder_traversal(expr), 1):
        if count > MAX_NODES:
            raise _Unreadable(f"more than {MAX_NODES} terms")
        if isinstance(node, sympy.Pow):
            base, exponent = node.args
            if exponent.free_symbols:
                continue
            size = _magnitude(exponent)
            if size > MAX_EXPONENT:
                raise _Unreadable("an exponent is too large")
            if not base.free_symbols:
                scale = _magnitude(base)
                if scale > 0 and abs(math.log10(scale)) * size > MAX_DIGITS:
                    raise _Unreadable("a power is too large")
        elif isinstance(node, sympy.factorial) and not node.args[0].free_symbols:
            if _magnitude(node.args[0]) > MAX_FACTORIAL:
                raise _Unreadable("a factorial is too large")


def _parse(text: str) -> sympy.Expr:
    names = {"__builtins__": {}, **_PARSER_NAMES, **_USER_NAMES}
    try:
        raw = parse_expr(text, local_dict={}, global_dict=dict(names), transformations=_TRANSFORMS, evaluate=False)
        _guard(raw)
        value = parse_expr(text, local_dict={}, global_dict=dict(names), transformations=_TRANSFORMS)
    except _Unreadable:
        raise
    except Exception as exc:  # SyntaxError, TypeError, TokenError, sympy's own errors: not an expression
        raise _Unreadable(f"not an expression ({type(exc).__name__})") from None
    if not isinstance(value, sympy.Expr):
        raise _Unreadable(f"not a single expression ({type(value).__name__})")
    return value


def _candidates(text: str) -> list[str]:
    """Spans of `text` that may be the answer, most specific first."""
    boxed = last_boxed(text)
    spans = [boxed] if boxed is not None else []
    dollars = re.findall(r"\$+([^$]+)\$+", text)
    if dollars:
        spans.append(dollars[-1])
    spans.append(text)
    lead_ins = list(_LEAD_IN.finditer(text))
    if lead_ins:
        spans.append(text[lead_ins[-1].end():])
    out = []
    for span in spans:
        span = span.strip().rstrip(".").strip()
        if "=" in span:
            span = span.rsplit("=", 1)[1].strip()
        if span and span not in out:
            out.append(span)
    return out


@lru_cache(maxsize=4096)
def _read_span(span: str) -> sympy.Expr | str:
    try:
        return _parse(_screen(_plain(span)))
    except _Unreadable as exc:
        return str(exc)


def read_expression(text: str, max_chars: int = 500) -> tuple[sympy.Expr | None, str]:
    """The expression `text` states and the span it was read from, or (None, why it could not be read)."""
    why = "empty answer"
    for span in _candidates(text):
        if len(span) > max_chars:
            why = f"expression longer than {max_chars} characters"
            continue
        value = _read_span(span)
        if isinstance(value, sympy.Expr):
            return value, span
        why = value
    return None, why


def canonical(expr: sympy.Expr) -> str:
    """A voting key: the value of a constant to 12 digits, else sympy's printed form."""
    if not expr.free_symbols:
        try:
            value = complex(expr.evalf(15))
        except (TypeError, ValueError, OverflowError):
            return str(expr)
        if math.isfinite(value.real) and math.isfinite(value.imag):
            if abs(value.imag) <= _ABS_TOL * max(1.0, abs(value.real)):
                return format_number(value.real)
            return f"{format_number(value.real)}{value.imag:+.12g}j"
    return str(expr)


def _value(expr: sympy.Expr, point: dict) -> complex | None:
    try:
        value = complex(expr.evalf(30, subs=point))
    except (TypeError, ValueError, OverflowError, ZeroDivisionError):
        return None
    return value if math.isfinite(value.real) and math.isfinite(value.imag) else None


def numeric_verdict(a: sympy.Expr, b: sympy.Expr, samples: int, rel_tol: float) -> bool | None:
    """True if a and b agree at every seeded random point where both are defined, False at the
    first point where they differ, None when fewer than min(samples, 3) points were defined."""
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    points = 1 if not symbols else samples
    rng = random.Random(0)
    agreed = 0
    for _ in range(points):
        point = {s: sympy.Float(rng.choice((-1, 1)) * rng.uniform(0.2, 3.0), 30) for s in symbols}
        va, vb = _value(a, point), _value(b, point)
        if va is None or vb is None:
            continue
        if abs(va - vb) > rel_tol * max(abs(va), abs(vb)) + _ABS_TOL:
            return False
        agreed += 1
    return True if agreed >= min(points, 3) else None


def simplify_is_zero(a: sympy.Expr, b: sympy.Expr) -> bool:
    """Run in a child process (the expressions arrive pickled): does simplify(a - b) vanish?"""
    return bool(sympy.simplify(a - b) == 0)


@register_verifier
class MathVerifier(Verifier):
    name = "math"
    Args = MathArgs

    def expected(self, task: TaskSpec, args: MathArgs) -> sympy.Expr:
        value = task.answer
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise VerifierConfigError(f"verifier 'math' on {task.task_id}: the expected answer must be "
                                      f"an expression as text or a number, not {value!r}")
        expr, why = read_expression(str(value), max(args.max_chars, len(str(value))))
        if expr is None:
            raise VerifierConfigError(f"verifier 'math' on {task.task_id}: cannot read the expected answer "
                                      f"{value!r}: {why}")
        return expr

    def score(self, task: TaskSpec, answer: str | None, tool_calls: Sequence[ToolCallRecord],
              args: MathArgs, expected: sympy.Expr) -> VerifyResult:
        want = str(expected)
        if answer is None or not answer.strip():
            return result(0.0, canonical=None, expected=want, why="no answer" if answer is None else "empty answer")
        got, span = read_expression(answer, args.max_chars)
        if got is None:
            return result(0.0, canonical=None, expected=want, why=f"could not read the answer: {span}")
        key, parsed = canonical(got), str(got)
        if (got - expected) == 0:
            return result(1.0, canonical=key, expected=want, parsed=parsed, stage="automatic")
        if args.samples:
            verdict = numeric_verdict(got, expected, args.samples, args.rel_tol)
            if verdict is not None:
                return result(float(verdict), canonical=key, expected=want, parsed=parsed, stage="numeric",
                              why=None if verdict else f"{_short(parsed)} is not equal to {_short(want)}")
        try:
            equal = call_in_child(simplify_is_zero, (got, expected),
                                  timeout_s=args.time_limit_s)
        except CallTimeout:
            return result(0.0, canonical=key, expected=want, parsed=parsed, stage="simplify",
                          why=f"simplify timed out after {args.time_limit_s:g}s")
        return result(float(equal), canonical=key, expected=want, parsed=parsed, stage="simplify",
                      why=None if equal else f"{_short(parsed)} is not equal to {_short(want)}")
