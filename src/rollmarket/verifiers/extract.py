"""Reading an answer out of model text: a \\boxed{} span, a number, a JSON value.

Every function here is total on any string: it returns None (or raises `NoJSON`, for JSON)
instead of failing in some other way, and is linear or capped in the length of its input.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from ..tasks.answers import parse_number

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_WHOLE_NUMBER = re.compile(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?")
_FRACTION = re.compile(r"([+-]?\d+)\s*/\s*(\d+)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?:\D|$))")
_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
MAX_BOX_TRIES = 8
"""How many of the last `\\boxed{` openings `last_boxed` tries (bounds the work on unclosed ones)."""
MAX_JSON_STARTS = 64
"""How many `{`/`[` positions `extract_json` tries before giving up (bounds the work on garbage)."""


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if none is closed."""
    for match in list(_BOX.finditer(text))[-MAX_BOX_TRIES:][::-1]:
        depth, start = 1, match.end()
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i]
    return None


def answer_span(text: str, *, boxed: bool = True) -> str:
    """The part of `text` that is the answer: the last \\boxed{} content if there is one, else all of it."""
    if boxed:
        inner = last_boxed(text)
        if inner is not None:
            return inner
    return text


def read_number(text: str) -> float | None:
    """The number `text` states, or None. The whole text as one number first ('1e-3', '-.5',
    '1,234.5', '3/4', '391.'), else the last number in it (`tasks.answers.parse_number`).
    Never NaN or infinite: 'nan' and 'inf' are not numbers here."""
    span = answer_span(text).strip().strip("$").strip()
    span = _THOUSANDS.sub("", span.rstrip(".").strip())
    if _WHOLE_NUMBER.fullmatch(span):
        value = float(span)
        return value if math.isfinite(value) else None
    fraction = _FRACTION.fullmatch(span)
    if fraction and int(fraction.group(2)) != 0:
        value = int(fraction.group(1)) / int(fraction.group(2))
        return value if math.isfinite(value) else None
    try:
        value = parse_number(span)
    except (ValueError, OverflowError):
        return None
    return value if value is not None and math.isfinite(value) else None


def format_number(value: float) -> str:
    """A canonical spelling for voting: 391, 391.0 and 3.91e2 all read '391'; 12 significant digits."""
    text = f"{value:.12g}"
    return "0" if text == "-0" else text


class NoJSON(ValueError):
    """No JSON value could be read from the text."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _loads(text: str) -> Any:
    return json.loads(text, parse_constant=_reject_constant)


def extract_json(text: str) -> tuple[Any, str]:
    """The JSON value in `text` and where it was found: 'whole' (the text is JSON), 'fence' (the
    last ```json fenced block that parses) or 'embedded' (the first `{...}` or `[...]` in prose
    that parses). NaN and Infinity are not JSON. Raises NoJSON."""
    try:
        return _loads(text), "whole"
    except (ValueError, RecursionError):
        pass
    for match in reversed(list(_FENCE.finditer(text))):
        try:
            return _loads(match.group(2)), "fence"
        except (ValueError, RecursionError):
            continue
    decoder = json.JSONDecoder(parse_constant=_reject_constant)
    tried = 0
    for match in re.finditer(r"[\[{]", text):
        if tried >= MAX_JSON_STARTS:
            break
        tried += 1
        try:
            value, _ = decoder.raw_decode(text, match.start())
        except (ValueError, RecursionError):
            continue
        if isinstance(value, (dict, list)):
            return value, "embedded"
    raise NoJSON("no JSON value found in the answer")
