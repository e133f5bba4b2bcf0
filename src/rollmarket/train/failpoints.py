"""Named kill points in the trainer, for crash tests: a testing aid, off unless the environment arms it.

    ROLLMARKET_FAILPOINTS="between_decisions@2"            kill -9 at that point of step 2
    ROLLMARKET_FAILPOINTS="in_checkpoint_write,before_fetch@3"   the first one armed that is reached

`POINT` alone fires the first time the point is reached, `POINT@N` only in step N (the trainer says
which step it is in with `enter_step`). The trainer reads the variable when a run starts
(`arm_from_environment`); a name that is not a point is a `FailpointError` then. Reaching an armed
point prints one line to stderr and sends SIGKILL to the process itself: no `finally`, no atexit,
no flush — what a crash or an OOM kill does. The idea is TiKV's and FreeBSD's fail points, cut down
to the one action crash tests need.

When the variable is unset (every real run) `reach` is one truth test of an empty dict.
"""

from __future__ import annotations

import os
import signal
import sys
from enum import StrEnum

ENV = "ROLLMARKET_FAILPOINTS"


class Failpoint(StrEnum):
    """Where a step can be killed, in the order a step reaches them."""

    before_fetch = "before_fetch"
    """The step's jobs are enqueued; no group fetched yet."""
    between_decisions = "between_decisions"
    """The gate decided the step's first group; the others are still to come."""
    in_optimizer_step = "in_optimizer_step"
    """Gradients computed (`backward`), the optimizer has not stepped."""
    in_checkpoint_write = "in_checkpoint_write"
    """The new weights are written into the partial checkpoint directory; its trainer state is not."""
    before_reports = "before_reports"
    """The checkpoint is complete; none of its decisions went to the exchange yet (they go in one
    all-or-nothing request)."""
    after_checkpoint_before_publish = "after_checkpoint_before_publish"
    """The checkpoint is complete and its decisions reported; the version is not published."""
    waiting_for_quorum = "waiting_for_quorum"
    """The version is published; the trainer waits for the workers' reload quorum (sync mode)."""


class FailpointError(ValueError):
    """ROLLMARKET_FAILPOINTS names a point that does not exist or a step that is not a number."""


def parse(text: str) -> dict[Failpoint, int | None]:
    """`"a@2,b"` → {a: 2, b: None}; a typed error for a name or step that does not parse."""
    armed: dict[Failpoint, int | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, step = item.partition("@")
        try:
            point = Failpoint(name.strip())
        except ValueError:
            raise FailpointError(f"{ENV}: unknown fail point {name.strip()!r}; known: "
                                 f"{', '.join(p.value for p in Failpoint)}") from None
        if step and not step.strip().isdigit():
            raise FailpointError(f"{ENV}: {item!r}: the step after @ must be a whole number")
        armed[point] = int(step) if step else None
    return armed


_armed: dict[Failpoint, int | None] = {}
_step = 0


def arm_from_environment() -> None:
    """Arm the points ROLLMARKET_FAILPOINTS names (the trainer calls this as a run starts)."""
    global _armed
    _armed = parse(os.environ.get(ENV, ""))


def enter_step(step: int) -> None:
    """The trainer is now in `step` (points armed as POINT@N compare against it)."""
    global _step
    _step = step


def reach(point: Failpoint) -> None:
    """Kill this process with SIGKILL if `point` is armed for the current step; else nothing."""
    if not _armed or point not in _armed:
        return
    step = _armed[point]
    if step is not None and step != _step:
        return
    sys.stderr.write(f"failpoint {point.value} reached at step {_step}: SIGKILL\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
