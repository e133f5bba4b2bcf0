"""What a trainer tells the exchange about a group it received, so dispatch can learn."""

from __future__ import annotations

from pydantic import Field

from .base import Identifier, Record, UtcDatetime, utc_now
from .decision import DecisionStatus
from .limits import Name

FEEDBACK_SCORE = {
    DecisionStatus.train: 1.0,
    DecisionStatus.train_with_correction: 0.7,
    DecisionStatus.replay: 0.4,
    DecisionStatus.quarantine: 0.0,
    DecisionStatus.reject: 0.0,
}
"""The default score a decision earns the worker that produced the group."""


class TrainerFeedback(Record):
    """One trainer's verdict on one group; the exchange folds `score` into the worker's quality."""

    group_id: Identifier
    trainer_id: Identifier = "default"
    status: DecisionStatus
    score: float = Field(ge=0, le=1, description="1 = ideal data, 0 = useless or harmful.")
    used_for_training: bool
    token_ess: float | None = None
    mean_abs_delta: float | None = None
    reward_mean: float | None = None
    note: str = Field(default="", max_length=2000)
    sent_at: UtcDatetime = Field(default_factory=utc_now)

    @classmethod
    def from_decision(cls, decision, trainer_id: str = "default", **extra) -> "TrainerFeedback":
        report = decision.report
        return cls(
            group_id=decision.group_id,
            trainer_id=trainer_id,
            status=decision.status,
            score=FEEDBACK_SCORE[decision.status],
            used_for_training=decision.status
            in (DecisionStatus.train, DecisionStatus.train_with_correction),
            token_ess=None if report is None else report.token_ess,
            mean_abs_delta=None if report is None else report.mean_abs_delta,
            **extra,
        )


class ReportReceipt(Record):
    """Where a group stands after a trainer's decision and feedback."""

    group_id: Identifier
    tier: Name
    status: Name
    worker_id: Identifier
    worker_quality: float = Field(description="The worker's feedback quality after this report.")
