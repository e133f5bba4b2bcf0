"""The verifier interface: a task and a model's answer (and tool calls) in, a VerifyResult out.

A task names its verifier (`TaskSpec.verifier`) and gives its options (`TaskSpec.verifier_args`).
Implementations live in `verifiers/builtin/`, one file per family, and register themselves here.

Two kinds of failure, kept apart:

* a bad task configuration (an unknown verifier, args that do not fit, a schema that is not one,
  an expected answer the verifier cannot read) raises `VerifierConfigError`: it is the task
  author's bug and no answer can be scored against it;
* bad model output (None, empty, garbage, huge, NaN text, broken JSON, hostile input) is data:
  reward 0, passed False and a short `why` in the info. `Verifier.verify` is the one boundary
  that turns any other exception raised while scoring an answer into such a result.

Every result's info carries `canonical` (the answer as the verifier read it, the key majority
voting groups by; None when nothing could be read), `expected`, and `why` when the reward is 0.
"""

from __future__ import annotations

import logging
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..contracts import (
    AgentTrajectory,
    TaskSpec,
    TerminalReason,
    ToolCallRecord,
    VerifyResult,
)

log = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 100_000
"""Answers longer than this score 0 without being read (a runaway generation, or an attack)."""


class VerifierConfigError(ValueError):
    """The task's verifier configuration is wrong: an unknown name, bad args, an unreadable
    expected answer. The only exception a verifier raises."""


class VerifierArgs(BaseModel):
    """Options every verifier accepts; each verifier's `Args` extends this. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_answer_chars: int = Field(
        MAX_ANSWER_CHARS, ge=1, description="Longer answers score 0 unread (why: answer too long).")


def result(reward: float, *, passed: bool | None = None, components: Mapping[str, float] | None = None,
           canonical: str | None, expected: Any, why: str | None = None, **info: Any) -> VerifyResult:
    """A VerifyResult with the info keys every verifier fills in. `passed` defaults to reward >= 1."""
    body: dict[str, Any] = {"canonical": canonical, "expected": expected}
    if why is not None:
        body["why"] = why
    body.update(info)
    return VerifyResult(reward=float(reward), passed=bool(reward >= 1.0 if passed is None else passed),
                        components={k: float(v) for k, v in (components or {}).items()}, info=body)


class Verifier(ABC):
    """One way of scoring an answer. Subclasses set `name` and `Args` and implement `expected`
    and `score`; `verify` is the boundary that callers use."""

    name: ClassVar[str]
    Args: ClassVar[type[VerifierArgs]] = VerifierArgs
    needs_final_answer: ClassVar[bool] = True
    """False when a run that did not end in a final answer can still earn reward (tool use)."""
    judges_answer: ClassVar[bool] = True
    """False when the reward is about something other than the answer text (tool calls)."""

    def parse_args(self, args: Mapping[str, Any] | None) -> VerifierArgs:
        """`args` as this verifier's Args model; VerifierConfigError when they do not fit."""
        if args is not None and not isinstance(args, Mapping):
            raise VerifierConfigError(f"verifier {self.name!r}: args must be an object, not {type(args).__name__}")
        try:
            return self.Args.model_validate(dict(args or {}))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(str(p) for p in e['loc']) or 'args'}: {e['msg']}"
                                 for e in exc.errors()[:5])
            raise VerifierConfigError(f"verifier {self.name!r}: bad args: {problems}") from None

    def check(self, task: TaskSpec, args: Mapping[str, Any] | None = None) -> None:
        """Raise VerifierConfigError if `task` cannot be scored by this verifier; otherwise nothing."""
        self.expected(task, self.parse_args(task.verifier_args if args is None else args))

    @abstractmethod
    def expected(self, task: TaskSpec, args: VerifierArgs) -> Any:
        """The expected answer in the form `score` compares with; VerifierConfigError when unreadable."""

    @abstractmethod
    def score(self, task: TaskSpec, answer: str | None, tool_calls: Sequence[ToolCallRecord],
              args: VerifierArgs, expected: Any) -> VerifyResult:
        """Score one answer. May raise on hostile input: `verify` turns that into reward 0."""

    def verify(self, task: TaskSpec, answer: str | None, *, tool_calls: Sequence[ToolCallRecord] = (),
               args: Mapping[str, Any] | None = None) -> VerifyResult:
        """Score `answer` (and `tool_calls`) for `task`. `args` default to `task.verifier_args`.

        Raises VerifierConfigError for a bad task configuration only; anything wrong with the
        answer is a result with reward 0 and a `why`.
        """
        parsed = self.parse_args(task.verifier_args if args is None else args)
        expected = self.expected(task, parsed)
        shown = _jsonable(task.answer)
        if answer is not None and not isinstance(answer, str):
            return result(0.0, canonical=None, expected=shown, why=f"the answer is a {type(answer).__name__}, not text")
        if answer is not None and len(answer) > parsed.max_answer_chars:
            return result(0.0, canonical=None, expected=shown,
                          why=f"answer too long ({len(answer)} > {parsed.max_answer_chars} characters)")
        try:
            return self.score(task, answer, tuple(tool_calls), parsed, expected)
        except VerifierConfigError:
            raise
        except Exception as exc:  # a hostile answer is data, never a crash
            log.warning("verifier %s failed on an answer to %s: %s: %s", self.name, task.task_id,
                        type(exc).__name__, exc)
            return result(0.0, canonical=None, expected=shown,
                          why=f"the answer could not be scored ({type(exc).__name__})")


VERIFIERS: dict[str, Verifier] = {}
"""Every registered verifier by name; `builtin/` fills it when `rollmarket.verifiers` is imported."""


def register_verifier(cls: type[Verifier]) -> type[Verifier]:
    """Class decorator: make `cls` available under `cls.name`."""
    if cls.name in VERIFIERS and type(VERIFIERS[cls.name]) is not cls:
        raise ValueError(f"a verifier named {cls.name!r} is already registered")
    VERIFIERS[cls.name] = cls()
    return cls


def get_verifier(name: str) -> Verifier:
    """The verifier called `name`; VerifierConfigError if there is none."""
    try:
        return VERIFIERS[name]
    except (KeyError, TypeError):
        raise VerifierConfigError(f"unknown verifier {name!r}; known: {', '.join(sorted(VERIFIERS))}") from None


def verify(task: TaskSpec, answer: str | None, tool_calls: Sequence[ToolCallRecord] = ()) -> VerifyResult:
    """Score `answer` with the task's own verifier and args."""
    return get_verifier(task.verifier).verify(task, answer, tool_calls=tool_calls)


def verify_trajectory(task: TaskSpec, trajectory: AgentTrajectory) -> VerifyResult:
    """Score an agent run: its final answer and every tool call it made.

    A run that did not end in a final answer (max_steps, length, model_error, aborted) gets
    reward 0, unless the verifier can score it without one (`needs_final_answer = False`, e.g.
    tool_use or a compound with a tool_use part), which then sees answer None.
    """
    verifier = get_verifier(task.verifier)
    finished = trajectory.terminal_reason is TerminalReason.final_answer
    if not finished and verifier.needs_final_answer:
        verifier.check(task)
        reason = trajectory.terminal_reason.value
        return result(0.0, canonical=None, expected=_jsonable(task.answer),
                      why=f"the run ended with {reason}, not a final answer", terminal_reason=reason)
    answer = trajectory.final_answer if finished else None
    return verifier.verify(task, answer, tool_calls=trajectory.tool_calls)


def _jsonable(value: Any) -> Any:
    """`value` if it is plain JSON data, else its repr (info must serialize)."""
    if value is None or isinstance(value, (str, int, bool)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)
