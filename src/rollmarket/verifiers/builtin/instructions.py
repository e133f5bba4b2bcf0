"""`instructions`: the answer keeps the format constraints the task declares (IFEval-like).

args: {"constraints": [{"kind": "words", "min": 50, "max": 100},
                       {"kind": "keywords", "include": ["river"], "exclude": ["ocean"]}],
       "pass": "all" | <threshold>}

Each constraint is one component, named `<index>:<kind>`, scoring 1 (kept) or 0 (broken).
reward = the fraction kept; passed: with "all" (the default) every one kept, with a number,
reward >= it. info.broken lists, for each broken constraint, what was asked and what was found.

Kinds (counts are inclusive bounds; give min, max or both):

- `words` {min, max}: whitespace-separated words;
- `sentences` {min, max}: runs ending in . ! or ? (a trailing run without one counts too);
- `paragraphs` {min, max}: blocks separated by blank lines;
- `bullets` {min, max}: lines starting with `-`, `*`, `+` or `1.`/`1)`;
- `keywords` {include, exclude, min_count}: each include word appears (whole word, any case)
  at least min_count times (default 1); no exclude word appears;
- `json` {}: the whole answer (a ```json fence allowed) is one JSON value;
- `case` {value: "lower" | "upper"}: no letters of the other case;
- `starts_with` / `ends_with` {value}: the stripped answer starts / ends with the text;
- `no_commas` {}: no `,` at all.

A bad constraint (an unknown kind, a bound missing or reversed) is a VerifierConfigError. Failures
are typed: info.failure is `no_answer` or `constraints_broken`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ...contracts import TaskSpec, ToolCallRecord, VerifyResult
from ..verifier import (
    Verifier,
    VerifierArgs,
    VerifierConfigError,
    register_verifier,
    result,
)


class InstructionFailure(StrEnum):
    """Why an instruction-following answer scored below a pass."""

    no_answer = "no_answer"
    constraints_broken = "constraints_broken"


class _Constraint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Counted(_Constraint):
    min: int | None = Field(None, ge=0)
    max: int | None = Field(None, ge=0)

    @model_validator(mode="after")
    def _bounds(self) -> _Counted:
        if self.min is None and self.max is None:
            raise ValueError("give min, max or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min {self.min} is above max {self.max}")
        return self

    def check(self, answer: str) -> str | None:
        """None when kept, else what was found."""
        found = self.count(answer)
        if (self.min is not None and found < self.min) or (self.max is not None and found > self.max):
            return f"{found} {self.kind}"  # type: ignore[attr-defined]
        return None

    def count(self, answer: str) -> int:
        raise NotImplementedError


class Words(_Counted):
    kind: Literal["words"]

    def count(self, answer: str) -> int:
        return len(answer.split())


class Sentences(_Counted):
    kind: Literal["sentences"]

    def count(self, answer: str) -> int:
        return len([s for s in re.split(r"(?<=[.!?])\s+", answer.strip()) if re.search(r"\w", s)])


class Paragraphs(_Counted):
    kind: Literal["paragraphs"]

    def count(self, answer: str) -> int:
        return len([p for p in re.split(r"\n\s*\n", answer) if p.strip()])


_BULLET = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+\S", re.MULTILINE)


class Bullets(_Counted):
    kind: Literal["bullets"]

    def count(self, answer: str) -> int:
        return len(_BULLET.findall(answer))


class Keywords(_Constraint):
    kind: Literal["keywords"]
    include: list[str] = Field(default_factory=list)
    exclude: list[str] = Field(default_factory=list)
    min_count: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _some(self) -> Keywords:
        if not self.include and not self.exclude:
            raise ValueError("give include, exclude or both")
        return self

    def check(self, answer: str) -> str | None:
        def count(word: str) -> int:
            return len(re.findall(r"(?<!\w)" + re.escape(word) + r"(?!\w)", answer, re.IGNORECASE))

        missing = [w for w in self.include if count(w) < self.min_count]
        present = [w for w in self.exclude if count(w) > 0]
        problems = ([f"missing {missing}"] if missing else []) + ([f"forbidden {present}"] if present else [])
        return "; ".join(problems) or None


class Json(_Constraint):
    kind: Literal["json"]

    def check(self, answer: str) -> str | None:
        text = answer.strip()
        fence = re.fullmatch(r"```(?:json)?\s*\n(.*)\n\s*```", text, re.DOTALL)
        try:
            json.loads(fence.group(1) if fence else text)
        except ValueError as exc:
            return f"not JSON ({exc.__class__.__name__}: {str(exc)[:60]})"
        return None


class Case(_Constraint):
    kind: Literal["case"]
    value: Literal["lower", "upper"]

    def check(self, answer: str) -> str | None:
        wrong = [c for c in answer if (c.isupper() if self.value == "lower" else c.islower())]
        return f"{len(wrong)} letters not in {self.value} case" if wrong else None


class StartsWith(_Constraint):
    kind: Literal["starts_with"]
    value: str = Field(min_length=1)

    def check(self, answer: str) -> str | None:
        return None if answer.strip().startswith(self.value) else f"starts with {answer.strip()[:40]!r}"


class EndsWith(_Constraint):
    kind: Literal["ends_with"]
    value: str = Field(min_length=1)

    def check(self, answer: str) -> str | None:
        return None if answer.strip().endswith(self.value) else f"ends with {answer.strip()[-40:]!r}"


class NoCommas(_Constraint):
    kind: Literal["no_commas"]

    def check(self, answer: str) -> str | None:
        return f"{answer.count(',')} commas" if "," in answer else None


Constraint = Annotated[Words | Sentences | Paragraphs | Bullets | Keywords | Json | Case | StartsWith | EndsWith
                       | NoCommas, Field(discriminator="kind")]


class InstructionsArgs(VerifierArgs):
    constraints: list[Constraint] = Field(min_length=1, description="The format constraints, each one component.")
    pass_: Literal["all"] | float = Field("all", alias="pass", description='"all" or a reward threshold.')


@register_verifier
class InstructionsVerifier(Verifier):
    name = "instructions"
    Args = InstructionsArgs

    def expected(self, task: TaskSpec, args: InstructionsArgs) -> list[dict[str, Any]]:
        if isinstance(args.pass_, float) and not 0 <= args.pass_ <= 1:
            raise VerifierConfigError(f"verifier 'instructions' on {task.task_id}: pass must be in [0, 1]")
        return [c.model_dump(exclude_none=True) for c in args.constraints]

    def score(self, task: TaskSpec, answer: str | None, tool_calls: Sequence[ToolCallRecord],
              args: InstructionsArgs, expected: list[dict[str, Any]]) -> VerifyResult:
        if answer is None or not answer.strip():
            return result(0.0, passed=False, canonical=None, expected=expected, why="no answer",
                          failure=InstructionFailure.no_answer)
        components: dict[str, float] = {}
        broken = []
        for index, (constraint, asked) in enumerate(zip(args.constraints, expected, strict=True)):
            found = constraint.check(answer)
            components[f"{index}:{constraint.kind}"] = 0.0 if found else 1.0
            if found:
                broken.append({"constraint": asked, "found": found})
        reward = sum(components.values()) / len(components)
        passed = not broken if args.pass_ == "all" else reward >= args.pass_
        if not broken:
            return result(reward, passed=passed, components=components, canonical=None, expected=expected)
        return result(reward, passed=passed, components=components, canonical=None, expected=expected,
                      broken=broken, failure=InstructionFailure.constraints_broken,
                      why=f"{len(broken)} of {len(components)} constraints broken: {broken[0]['found']}")
