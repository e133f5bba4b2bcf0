"""The open-questions page: each question of the research agenda the project started from (the
issue's anchor, future-research.md) with our answer in a sentence and its evidence, or "open".

The content is `questions.toml` beside this module, validated on load: a bad file is a
`QuestionsFileError` naming the file and what is wrong, never a half-rendered page. Evidence is a
file of the repository (a doc section or committed results), a campaign page when that campaign is
under --runs, or a section of /metrics.
"""

from __future__ import annotations

import tomllib
from enum import Enum
from pathlib import Path

from pydantic import ConfigDict, Field, ValidationError, model_validator

from ..contracts import Record
from .campaigns import Campaigns

QUESTIONS_FILE = Path(__file__).with_name("questions.toml")


class QuestionsFileError(ValueError):
    """questions.toml does not parse or does not validate."""


class Status(str, Enum):
    answered = "answered"
    """An experiment answered it; the answer says what it found."""
    partly = "partly answered"
    """An experiment or the system answers part of it; the answer says which part is open."""
    built = "built"
    """A design question the system settles by what it does."""
    open = "open"


class Evidence(Record):
    """Where an answer's support is: a repository file (optionally a section of it), a campaign page,
    or a metric explained on /metrics."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    label: str = Field(min_length=1)
    file: str | None = Field(default=None, description="A path in the repository (docs/…, experiments/results/…).")
    section: str | None = Field(default=None, description="A heading of `file`, as written after its #s.")
    campaign: str | None = Field(default=None, description="A campaign id: linked when it is under --runs.")
    metric: str | None = Field(default=None, description="A metric of /metrics (its anchor).")
    present: bool = Field(default=False, description="Whether `campaign` is under --runs (set when served).")

    @model_validator(mode="after")
    def _points_somewhere(self) -> "Evidence":
        if not (self.file or self.campaign or self.metric):
            raise ValueError(f"evidence {self.label!r} names no file, campaign or metric")
        if self.section and not self.file:
            raise ValueError(f"evidence {self.label!r} has a section but no file")
        return self


class Question(Record):
    model_config = ConfigDict(extra="forbid", frozen=True)

    number: str = Field(pattern=r"^[0-9]+[a-z]?$", description="The agenda's number (9b included).")
    heading: str = Field(min_length=1, description="The agenda's heading of it, verbatim.")
    title: str = Field(min_length=1, description="A short title, in our words.")
    status: Status
    answer: str = Field(min_length=1, description="One sentence: the answer, or what exists and what is open.")
    evidence: list[Evidence] = Field(default_factory=list)

    @model_validator(mode="after")
    def _answers_have_evidence(self) -> "Question":
        if self.status is not Status.open and not self.evidence:
            raise ValueError(f"question {self.number} is {self.status.value} but cites no evidence")
        return self


class QuestionsFile(Record):
    model_config = ConfigDict(extra="forbid", frozen=True)

    anchor: str = Field(description="The agenda the questions come from, relative to the repository.")
    questions: list[Question]

    @model_validator(mode="after")
    def _numbers_once(self) -> "QuestionsFile":
        seen: set[str] = set()
        for q in self.questions:
            if q.number in seen:
                raise ValueError(f"question {q.number} is listed twice")
            seen.add(q.number)
        return self


class QuestionsPage(Record):
    anchor: str
    questions: list[Question]
    counts: dict[str, int] = Field(description="Questions per status.")


def load_questions(path: Path = QUESTIONS_FILE) -> QuestionsFile:
    """questions.toml, validated; QuestionsFileError says what is wrong with it."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise QuestionsFileError(f"{path}: {exc}") from None
    try:
        return QuestionsFile.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'file'}: {e['msg']}" for e in exc.errors())
        raise QuestionsFileError(f"{path}: {problems}") from None


def questions_page(campaigns: Campaigns, path: Path = QUESTIONS_FILE) -> QuestionsPage:
    """The page: every question, with campaign evidence marked present when it is under --runs."""
    content = load_questions(path)
    here = set(campaigns.ids())
    questions = [q.model_copy(update={"evidence": [e.model_copy(update={"present": e.campaign in here})
                                                   for e in q.evidence]}) for q in content.questions]
    counts = {s.value: sum(q.status is s for q in questions) for s in Status}
    return QuestionsPage(anchor=content.anchor, questions=questions, counts=counts)
