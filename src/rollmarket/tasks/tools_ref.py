"""Reference tools: small, deterministic implementations used to compute gold trajectories and to
score the tiny models. The agents' real tools replace them; their names, argument schemas and
output formats are the contract these define.

Every tool takes keyword arguments from the model's JSON and returns a string; a bad call
returns a string starting with `error:` (a bad call is data the model sees, not a crash).
"""

from __future__ import annotations

import ast
import math
import operator
import re
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from .world import Doc, World

CALCULATOR: dict[str, Any] = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
WEB_SEARCH: dict[str, Any] = {"type": "function", "function": {
    "name": "web_search", "description": "Search the documents.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}
READ_FILE: dict[str, Any] = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}
TOOL_SCHEMAS: dict[str, dict[str, Any]] = {"calculator": CALCULATOR, "web_search": WEB_SEARCH, "read_file": READ_FILE}
SEARCH_TOP_K = 2
MAX_RESULT_BITS = 4096
"""Integer powers larger than this fail before they are computed (a float holds at most 1024 bits)."""

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNOPS: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def format_number(value: float) -> str:
    """Integers print bare (391); other values to 6 significant digits (12.5, 0.333333)."""
    if isinstance(value, bool) or not math.isfinite(value):
        raise ValueError("not a finite number")
    if float(value).is_integer():
        return str(int(value))
    return f"{value:.6g}"


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 64:
            raise ValueError("exponent too large")
        if isinstance(node.op, ast.Pow) and isinstance(left, int) and isinstance(right, int) \
                and abs(left).bit_length() * right > MAX_RESULT_BITS:
            # Nested powers, ((9**64)**64)**64, would otherwise build a gigabyte integer first.
            raise ValueError("result too large")
        return _BINOPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNOPS:
        return _UNOPS[type(node.op)](_eval(node.operand))
    raise ValueError("only numbers, + - * / // % ** and parentheses are allowed")


def calculator(expression: str) -> str:
    """Evaluate arithmetic safely: '17 * 23' -> '391'."""
    if not isinstance(expression, str) or len(expression) > 200:
        return "error: expression must be a string of at most 200 characters"
    try:
        return format_number(_eval(ast.parse(expression.replace("^", "**"), mode="eval")))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError) as exc:
        return f"error: {exc}"


_WORD = re.compile(r"[a-z0-9]+")


def _terms(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class BM25:
    """Okapi BM25 (k1=1.2, b=0.75) over a list of documents' title + text."""

    def __init__(self, docs: list[Doc], k1: float = 1.2, b: float = 0.75):
        self.docs = docs
        self.k1, self.b = k1, b
        self.tf = [Counter(_terms(f"{d.title} {d.text}")) for d in docs]
        self.len = [sum(tf.values()) for tf in self.tf]
        self.avg = sum(self.len) / max(len(docs), 1)
        df = Counter(term for tf in self.tf for term in tf)
        n = len(docs)
        self.idf = {t: math.log(1 + (n - f + 0.5) / (f + 0.5)) for t, f in df.items()}

    def search(self, query: str, k: int = SEARCH_TOP_K) -> list[Doc]:
        """The best `k` documents with a positive score, best first (ties keep corpus order)."""
        terms = _terms(query)
        scored = []
        for i, tf in enumerate(self.tf):
            score = 0.0
            for t in terms:
                f = tf.get(t, 0)
                if f:
                    score += self.idf[t] * f * (self.k1 + 1) / (f + self.k1 * (1 - self.b + self.b * self.len[i] / self.avg))
            if score > 0:
                scored.append((-score, i))
        return [self.docs[i] for _, i in sorted(scored)[:k]]


_INDEXES: dict[int, BM25] = {}


def web_search(query: str, world: World) -> str:
    """The top documents for `query`, one per line as 'Title: text'."""
    if not isinstance(query, str) or not query.strip():
        return "error: query must be a non-empty string"
    index = _INDEXES.get(id(world))
    if index is None or index.docs is not world.docs:
        index = _INDEXES[id(world)] = BM25(world.docs)
    hits = index.search(query)
    if not hits:
        return "no results"
    return "\n".join(f"{d.title}: {d.text}" for d in hits)


def read_file(path: str, files: Mapping[str, str]) -> str:
    """The content of `path` among the task's files (paths are relative; no escaping the directory)."""
    if not isinstance(path, str):
        return "error: path must be a string"
    clean = path.strip().lstrip("./")
    if clean not in files:
        return f"error: no such file: {path}"
    return files[clean].rstrip("\n")


def run_tool(name: str, arguments: Mapping[str, Any], *, world: World, files: Mapping[str, str]) -> str:
    """Run reference tool `name` on the model's `arguments`; any misuse comes back as 'error: ...'."""
    if not isinstance(arguments, Mapping):
        return "error: arguments must be a JSON object"
    try:
        if name == "calculator":
            return calculator(**arguments)
        if name == "web_search":
            return web_search(**arguments, world=world)
        if name == "read_file":
            return read_file(**arguments, files=files)
    except TypeError as exc:
        return f"error: bad arguments for {name}: {exc}"
    return f"error: unknown tool: {name}"
