"""Reference verifiers: does a final answer match the expected one?"""

from __future__ import annotations

import math
import re

VERIFIERS = ("numeric", "exact")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


def normalize(text: str) -> str:
    """Lower case, single spaces, no surrounding punctuation or quotes."""
    return " ".join(text.strip().strip(".\"'`").lower().split())


def parse_number(text: str) -> float | None:
    """The last number in `text` ('1,234' reads as 1234), or None."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    return float(found[-1].replace(",", ""))


def check_answer(verifier: str, answer: str, expected: str) -> bool:
    """True when `answer` is right under `verifier` ('numeric': within 1e-6 relative; 'exact': normalized)."""
    if verifier == "numeric":
        got, want = parse_number(answer), parse_number(expected)
        return got is not None and want is not None and math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
    if verifier == "exact":
        return normalize(answer) == normalize(expected)
    raise ValueError(f"unknown verifier {verifier!r}; expected one of {VERIFIERS}")
