"""`multiple_choice`: the answer picks the expected option, by its letter or by its text.

args: {"options": ["Paris", "Lyon", "Nice"]}; task.answer is the right option's letter ("A") or
its exact text ("Paris"). reward = 1 if the one option the answer picks is the expected one.

What the answer picks, first rule that finds something wins:

1. the last \\boxed{} content, read as a letter or as an option's text;
2. an explicit statement, the last one counting: "answer: B", "answer is (B)", "option B" (in
   text only the options' own letters, in upper case, are read);
3. the whole answer is one letter, with optional brackets or a period: "B", "(B)", "B.";
4. letters standing alone as options ("(B)", "B)", "B." at a word start): exactly one distinct;
5. option texts quoted in full (case-insensitive, whole words): exactly one distinct.

`read` narrows where the pick is read, the way NeMo Gym's mcqa server grades (its `grading_mode`):

- `any` (default): the rules above;
- `boxed_letter` (Gym's `strict_single_letter_boxed`, its default): only the last \\boxed{}, holding one
  upper-case letter among non-letters ("[C]") or a letter then a label mark ("C: text", "C) text");
- `boxed` (Gym's `lenient_boxed`): that, else the one option whose text the last \\boxed{} contains;
- `answer_colon` (Gym's `lenient_answer_colon`): the first "answer:" line's rest, a letter in either
  case or one option's exact text.

In every reading a \\boxed{} content wrapped in \\text{...} is read unwrapped. `patterns` (Gym's
`template_metadata.output_regex`) are tried first, in order: the last match of the first pattern
whose match reads as a pick wins (case-insensitive; its group, else the whole match, as a letter
in either case or as one option's exact text; Arabic, Bengali and full-width A-D read as A-D).

Typed failures (info.failure): `no_answer` (None or blank), `no_choice` (nothing picked),
`ambiguous` (rules 4 or 5 found two or more different options: info.candidates lists them),
`out_of_range` (a whole answer that is a letter with no option), `wrong` (a clear pick, not the expected one).
"""

from __future__ import annotations

import re
import string
from functools import lru_cache
from collections.abc import Sequence
from enum import StrEnum

from pydantic import Field, field_validator

from ...contracts import TaskSpec, ToolCallRecord, VerifyResult
from ..extract import last_boxed
from ..verifier import (
    Verifier,
    VerifierArgs,
    VerifierConfigError,
    register_verifier,
    result,
)

LETTERS = string.ascii_uppercase
MAX_PATTERNS = 16
MAX_PATTERN_CHARS = 500


class ChoiceFailure(StrEnum):
    """Why a multiple-choice answer scored 0."""

    no_answer = "no_answer"
    no_choice = "no_choice"
    ambiguous = "ambiguous"
    out_of_range = "out_of_range"
    wrong = "wrong"


class ChoiceReading(StrEnum):
    """Where the pick is read from the answer (the module docstring has each rule)."""

    any = "any"
    boxed_letter = "boxed_letter"
    boxed = "boxed"
    answer_colon = "answer_colon"


class MultipleChoiceArgs(VerifierArgs):
    options: list[str] = Field(min_length=2, max_length=len(LETTERS),
                               description="The options in order; the first is A.")
    read: ChoiceReading = Field(ChoiceReading.any, description="Where the pick is read: any, boxed_letter, "
                                "boxed or answer_colon (NeMo Gym's mcqa grading modes).")
    patterns: list[str] = Field(default_factory=list, max_length=MAX_PATTERNS,
                                description="Regular expressions tried before `read`, in order (NeMo Gym's "
                                "template_metadata.output_regex); at most one group each.")

    @field_validator("patterns")
    @classmethod
    def _compiles(cls, patterns: list[str]) -> list[str]:
        for pattern in patterns:
            if len(pattern) > MAX_PATTERN_CHARS:
                raise ValueError(f"a pattern is longer than {MAX_PATTERN_CHARS} characters")
            try:
                groups = re.compile(pattern).groups
            except re.error as exc:
                raise ValueError(f"pattern {pattern!r} is not a regular expression ({exc})") from None
            if groups > 1:
                raise ValueError(f"pattern {pattern!r} has {groups} groups; the pick is one group or the match")
        return patterns


_ALONE = re.compile(r"^\s*[(\[]?\s*([A-Za-z])\s*[)\].]?\s*$")


@lru_cache(maxsize=32)
def _patterns(count: int) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """(explicit statements, bracketed letters) for options A up to the count-th letter. Only those
    letters, in upper case, are read inside text: "the answer is a guess" and "I think" pick nothing."""
    letter = f"([A-{LETTERS[count - 1]}])"
    stated = re.compile(r"(?i:answer(?:\s+is)?|option|choice)\s*[:=]?\s*[(\[]?\s*" + letter + r"\s*[)\].]?(?![A-Za-z])")
    bracketed = re.compile(r"(?:(?<![A-Za-z])\(" + letter + r"\)|(?<![A-Za-z(])" + letter + r"[).](?=\s|$))")
    return stated, bracketed


_TEXT_WRAP = re.compile(r"\\text\{\s*(.*?)\s*\}", re.S)
_BOXED_LONE_LETTER = re.compile(r"^[^A-Za-z]*([A-Z])[^A-Za-z]*$")
_BOXED_LABEL = re.compile(r"^\s*([A-Z])\s*[:).\-]")
_ANSWER_COLON = re.compile(r"(?i)answer\s*:\s*(.+)")


def _unwrap_text(span: str) -> str:
    """`span` without the \\text{...} wrappers around all of it ("\\text{E}" is "E")."""
    while (whole := _TEXT_WRAP.fullmatch(span)) is not None:
        span = whole.group(1)
    return span


def _folded(text: str) -> str:
    return " ".join(text.split()).casefold()


def _boxed_letter(answer: str) -> str | None:
    """The letter of the last \\boxed{} when it holds one alone or as a label; else None."""
    boxed = last_boxed(answer)
    if boxed is None:
        return None
    inner = _unwrap_text(boxed.strip())
    found = _BOXED_LONE_LETTER.match(inner) or _BOXED_LABEL.match(inner)
    return found.group(1) if found else None


def _boxed_option_text(answer: str, options: list[str]) -> str | None:
    """The letter of the one option whose text the last \\boxed{} contains (any case); else None."""
    boxed = last_boxed(answer)
    if boxed is None:
        return None
    spans = {_folded(boxed), _folded(_unwrap_text(boxed.strip()))}
    hits = {LETTERS[i] for i, option in enumerate(options)
            if _folded(option) and any(_folded(option) in span for span in spans)}
    return hits.pop() if len(hits) == 1 else None


def _answer_colon(answer: str, options: list[str]) -> str | None:
    """The first "answer:" line's rest read as one letter (either case) or one option's exact text."""
    stated = _ANSWER_COLON.search(answer)
    if stated is None:
        return None
    span = _unwrap_text(stated.group(1)).strip()
    if len(span) == 1 and span.isalpha():
        return span.upper()
    hits = [LETTERS[i] for i, option in enumerate(options) if _folded(option) == _folded(span)]
    return hits[0] if hits else None


# Option letters other scripts write (NeMo Gym's mcqa reads them in its prompts' own languages).
_FOREIGN_LETTERS = str.maketrans({"أ": "A", "ب": "B", "ج": "C", "د": "D", "অ": "A", "ব": "B", "ড": "C", "ঢ": "D",
                                  "Ａ": "A", "Ｂ": "B", "Ｃ": "C", "Ｄ": "D"})


def _patterned(answer: str, patterns: list[str], options: list[str]) -> str | None:
    """The pick of the first pattern whose last match reads as a letter or one option's exact text."""
    for pattern in patterns:
        matches = list(re.finditer(pattern, answer, re.IGNORECASE))
        if not matches:
            continue
        last = matches[-1]
        span = (last.group(1) if last.re.groups else last.group(0)) or ""
        span = span.translate(_FOREIGN_LETTERS).strip()
        if len(span) == 1 and span.isalpha():
            return span.upper()
        hits = [LETTERS[i] for i, option in enumerate(options) if _folded(option) == _folded(span)]
        if hits:
            return hits[0]
    return None


def _letter_or_text(span: str, options: list[str]) -> str | None:
    """A letter when `span` is one letter (bracketed or not) or exactly one option's text; else None."""
    span = _unwrap_text(span.strip())
    alone = _ALONE.match(span)
    if alone:
        return alone.group(1).upper()
    folded = " ".join(span.split()).strip(" .").casefold()
    hits = [LETTERS[i] for i, option in enumerate(options) if " ".join(option.split()).casefold() == folded]
    return hits[0] if len(hits) == 1 else None


def pick(answer: str, options: list[str], read: ChoiceReading = ChoiceReading.any,
         patterns: Sequence[str] = ()) -> tuple[str | None, list[str]]:
    """(the letter the answer picks or None, the distinct candidates seen when it is ambiguous)."""
    if patterns and (letter := _patterned(answer, list(patterns), options)) is not None:
        return letter, []
    if read is ChoiceReading.boxed_letter:
        return _boxed_letter(answer), []
    if read is ChoiceReading.boxed:
        return _boxed_letter(answer) or _boxed_option_text(answer, options), []
    if read is ChoiceReading.answer_colon:
        return _answer_colon(answer, options), []
    boxed = last_boxed(answer)
    if boxed is not None and (letter := _letter_or_text(boxed, options)):
        return letter, []
    stated_pattern, bracketed_pattern = _patterns(len(options))
    stated = stated_pattern.findall(answer)
    if stated:
        return stated[-1].upper(), []
    if (alone := _ALONE.match(answer)) is not None:
        return alone.group(1).upper(), []
    bracketed = list(dict.fromkeys(a or b for a, b in bracketed_pattern.findall(answer)))
    if len(bracketed) == 1:
        return bracketed[0], []
    if len(bracketed) > 1:
        return None, bracketed
    folded = answer.casefold()
    quoted = [LETTERS[i] for i, option in enumerate(options)
              if re.search(r"(?<!\w)" + re.escape(" ".join(option.split()).casefold()) + r"(?!\w)", folded)]
    if len(quoted) == 1:
        return quoted[0], []
    return None, quoted


@register_verifier
class MultipleChoiceVerifier(Verifier):
    name = "multiple_choice"
    Args = MultipleChoiceArgs

    def expected(self, task: TaskSpec, args: MultipleChoiceArgs) -> str:
        want = task.answer
        if isinstance(want, str):
            letter = _letter_or_text(want, args.options)
            if letter is not None and LETTERS.index(letter) < len(args.options):
                return letter
        raise VerifierConfigError(f"verifier 'multiple_choice' on {task.task_id}: expected answer {want!r} is "
                                  f"neither a letter A-{LETTERS[len(args.options) - 1]} nor one option's text")

    def score(self, task: TaskSpec, answer: str | None, tool_calls: Sequence[ToolCallRecord],
              args: MultipleChoiceArgs, expected: str) -> VerifyResult:
        if answer is None or not answer.strip():
            return result(0.0, canonical=None, expected=expected, why="no answer", failure=ChoiceFailure.no_answer)
        letter, candidates = pick(answer, args.options, args.read, args.patterns)
        if letter is None and len(candidates) > 1:
            return result(0.0, canonical=None, expected=expected, candidates=candidates,
                          why=f"the answer names several options ({', '.join(candidates)})",
                          failure=ChoiceFailure.ambiguous)
        if letter is None:
            return result(0.0, canonical=None, expected=expected, why="the answer picks no option",
                          failure=ChoiceFailure.no_choice)
        if LETTERS.index(letter) >= len(args.options):
            return result(0.0, canonical=letter, expected=expected, failure=ChoiceFailure.out_of_range,
                          why=f"there is no option {letter} (options A-{LETTERS[len(args.options) - 1]})")
        if letter == expected:
            return result(1.0, canonical=letter, expected=expected)
        return result(0.0, canonical=letter, expected=expected, why=f"picked {letter}, not {expected}",
                      failure=ChoiceFailure.wrong)
