"""Curricula: which training tasks to sample, and how often, picked from a reward profile.

A task every sample solves, or none does, gives GRPO no signal: all its group's advantages are 0.
`build_curriculum` drops the solved (pass@1 >= `max_pass`) and the hopeless (pass@1 <= `min_pass`),
and the tasks with too few samples to tell, and keeps the learnable. With `mode = "weight"` each kept
task is sampled in proportion to p(1 − p), p its pass@1: the variance of its reward, which is
largest where a group's runs most often disagree; with `mode = "keep"` the kept tasks are sampled
uniformly. `rollmarket train` reads the written file as `rollout.curriculum` (train/loop.py).

A run keeps its curriculum by content: when it begins, the file's bytes are copied into the run
directory (SAVED_CURRICULUM) and their digest goes into the config (`rollout.curriculum_digest`);
a resumed run uses that copy, so rebuilding the file for the next run cannot change the tasks of
this one. A file whose content differs from the run's is a `CurriculumChanged` warning on resume.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, model_validator

from ..contracts import Record, TaskSpec
from ..verifiers.profile import ProfileReport


class CurriculumError(ValueError):
    """A curriculum that cannot be built or used; `fix` says what to do instead."""

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.fix = fix


class CurriculumSettings(Record):
    """The thresholds of a curriculum (all on a task's pass@1 in the profile)."""

    max_pass: float = Field(0.9, ge=0, le=1, description="Tasks with pass@1 >= this are solved: dropped.")
    min_pass: float = Field(0.0, ge=0, le=1, description="Tasks with pass@1 <= this are hopeless: dropped.")
    min_samples: int = Field(4, ge=1, description="Tasks with fewer samples in the profile are dropped (unmeasured).")
    mode: Literal["keep", "weight"] = Field(
        "weight", description="keep: sample the kept tasks uniformly; weight: in proportion to p(1 − p).")

    @model_validator(mode="after")
    def _ordered(self) -> "CurriculumSettings":
        if self.min_pass >= self.max_pass:
            raise ValueError(f"min_pass ({self.min_pass}) must be below max_pass ({self.max_pass})")
        return self


class CurriculumTask(Record):
    """A kept task: its pass@1, samples and sampling weight (the weights sum to 1)."""

    task_id: str
    pass_at_1: float = Field(ge=0, le=1)
    n: int = Field(ge=1)
    weight: float = Field(gt=0, le=1)


class Curriculum(Record):
    """What `rollmarket curriculum` writes and `rollout.curriculum` reads."""

    source: str | None = Field(default=None, description="The profile (or rollouts) it was picked from.")
    settings: CurriculumSettings
    tasks: list[CurriculumTask] = Field(min_length=1, description="The kept tasks, by task id.")
    solved: list[str] = Field(description="Dropped: pass@1 >= max_pass.")
    hopeless: list[str] = Field(description="Dropped: pass@1 <= min_pass.")
    unmeasured: list[str] = Field(description="Dropped: fewer than min_samples samples.")

    def pick(self, tasks: Sequence[TaskSpec], index: int, seed: int) -> TaskSpec:
        """The `index`-th training task (a pure function of index and seed, so a resumed run picks the
        same ones): `tasks` (the kept tasks, in the run's order) cycled for keep; a seeded weighted
        draw for weight."""
        if self.settings.mode == "keep":
            return tasks[index % len(tasks)]
        weights = {t.task_id: t.weight for t in self.tasks}
        return random.Random(f"{seed}:{index}").choices(tasks, weights=[weights[t.task_id] for t in tasks])[0]

    def select(self, tasks: Sequence[TaskSpec]) -> list[TaskSpec]:
        """The kept tasks among `tasks`, in their order; CurriculumError when a kept task is not there."""
        kept = {t.task_id for t in self.tasks}
        missing = sorted(kept - {t.task_id for t in tasks})
        if missing:
            raise CurriculumError(f"{len(missing)} curriculum task(s) are not training tasks: {missing[:5]}",
                                  fix="build the curriculum from a profile of this suite's train split")
        return [t for t in tasks if t.task_id in kept]


def build_curriculum(profile: ProfileReport, settings: CurriculumSettings = CurriculumSettings()) -> Curriculum:
    """Keep the learnable tasks of `profile`; CurriculumError when none is left."""
    kept: list[tuple[str, float, int]] = []
    solved, hopeless, unmeasured = [], [], []
    for row in profile.tasks:
        p = row.correct / row.n if row.n else 0.0
        if row.n < settings.min_samples:
            unmeasured.append(row.task_id)
        elif p >= settings.max_pass:
            solved.append(row.task_id)
        elif p <= settings.min_pass:
            hopeless.append(row.task_id)
        else:
            kept.append((row.task_id, p, row.n))
    if not kept:
        raise CurriculumError(f"no learnable task: {len(solved)} solved, {len(hopeless)} hopeless, "
                              f"{len(unmeasured)} with fewer than {settings.min_samples} samples",
                              fix="loosen --max-pass / --min-pass, or profile more samples per task")
    raw = [p * (1 - p) if settings.mode == "weight" else 1.0 for _, p, _ in kept]
    total = sum(raw)
    return Curriculum(source=profile.source, settings=settings,
                      tasks=[CurriculumTask(task_id=t, pass_at_1=p, n=n, weight=w / total)
                             for (t, p, n), w in zip(kept, raw)],
                      solved=solved, hopeless=hopeless, unmeasured=unmeasured)


SAVED_CURRICULUM = "curriculum.json"
"""The copy of a run's curriculum in its run directory."""


def curriculum_digest(data: bytes) -> str:
    """The digest a run records of its curriculum file's content."""
    return "sha256:" + hashlib.sha256(data).hexdigest()


def file_digest(path: str | Path) -> str | None:
    """`curriculum_digest` of the file at `path`; None when it cannot be read."""
    try:
        return curriculum_digest(Path(path).read_bytes())
    except OSError:
        return None


@dataclass(frozen=True)
class CurriculumChanged:
    """A warning on resume: the curriculum file the config names is not the content the run began
    with (or is gone); the run goes on with its saved copy."""

    path: str | None
    """The file the resumed config names (None: rollout.curriculum unset)."""
    saved: str
    """The run's copy, which it goes on with."""
    digest: str | None
    """What the run began with."""
    found: str | None
    """The file's digest now; None when it is gone or unset."""

    def message(self) -> str:
        """One line for the user."""
        what = ("rollout.curriculum is unset" if self.path is None else f"{self.path} is gone" if self.found is None
                else f"{self.path} changed since the run began ({self.digest} → {self.found})")
        return (f"{what}; the run goes on with the curriculum it began with, saved in {self.saved}. Start a new "
                f"run to train on another curriculum.")


def read_curriculum(path: str | Path, digest: str | None = None) -> tuple[Curriculum, bytes]:
    """A curriculum file and its content; CurriculumError when it is missing or not one, or when
    `digest` is given and the content is not that one."""
    path = Path(path)
    try:
        data = path.read_bytes()
        curriculum = Curriculum.model_validate_json(data)
    except OSError as exc:
        raise CurriculumError(f"{path}: cannot read it ({exc.strerror})",
                              fix="write one with `rollmarket curriculum PROFILE --out PATH`") from None
    except (ValidationError, ValueError) as exc:
        raise CurriculumError(f"{path}: not a curriculum ({str(exc).splitlines()[0]})",
                              fix="write one with `rollmarket curriculum PROFILE --out PATH`") from None
    found = curriculum_digest(data)
    if digest is not None and found != digest:
        raise CurriculumError(f"{path}: its content ({found}) is not the curriculum the config names ({digest})",
                              fix="pass the file the run began with (a run's copy is curriculum.json in its "
                                  "directory), or unset rollout.curriculum_digest for a new run")
    return curriculum, data


def load_curriculum(path: str | Path, digest: str | None = None) -> Curriculum:
    """Read a curriculum file (`read_curriculum` without the content)."""
    return read_curriculum(path, digest)[0]
