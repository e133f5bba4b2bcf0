"""The off-policy budget controller: one decision per group, with every reason that fired."""

from __future__ import annotations

from ..contracts import (
    RECOMMENDED_ACTION,
    BudgetReport,
    DecisionReason,
    DecisionStatus,
    GroupDecision,
    RejectionReason,
    Tier,
)
from .config import GateConfig

_QUARANTINE = {DecisionReason.veto_token, DecisionReason.policy_lag_quarantine,
               DecisionReason.low_ess_quarantine, DecisionReason.router_flip}
_REPLAY = {DecisionReason.policy_lag_replay, DecisionReason.low_ess_replay}


def reasons_for(report: BudgetReport, config: GateConfig = GateConfig()) -> list[DecisionReason]:
    """Every threshold the report crosses, in the gate's order. Empty means within budget."""
    ess = report.token_ess if config.ess_kind == "token" else report.sequence_ess
    lag = report.policy_lag_steps
    reasons: list[DecisionReason] = []
    if report.max_abs_delta > config.veto_abs_delta:
        reasons.append(DecisionReason.veto_token)
    if lag > config.max_policy_lag:
        reasons.append(DecisionReason.policy_lag_quarantine)
    if ess < config.min_ess:
        reasons.append(DecisionReason.low_ess_quarantine)
    if report.router_flip_rate is not None and report.router_flip_rate > config.max_router_flip:
        reasons.append(DecisionReason.router_flip)
    if report.clipped_fraction > config.max_clipped_fraction:
        reasons.append(DecisionReason.clipped_fraction)
    # A replay-level reason is reported only when the same quantity did not already quarantine.
    if config.replay_lag < lag <= config.max_policy_lag:
        reasons.append(DecisionReason.policy_lag_replay)
    if config.min_ess <= ess < config.replay_ess:
        reasons.append(DecisionReason.low_ess_replay)
    return reasons


def status_for(reasons: list[DecisionReason]) -> DecisionStatus:
    fired = set(reasons)
    if fired & _QUARANTINE:
        return DecisionStatus.quarantine
    if DecisionReason.clipped_fraction in fired:
        return DecisionStatus.train_with_correction
    if fired & _REPLAY:
        return DecisionStatus.replay
    return DecisionStatus.train


def decide(
    report: BudgetReport, config: GateConfig = GateConfig(), *, decided_by: str = "gate"
) -> GroupDecision:
    """Decide train / train_with_correction / replay / quarantine from a BudgetReport.

    Order (DESIGN.md): veto → quarantine; lag > max_policy_lag, ESS < min_ess or router flip >
    max_router_flip → quarantine; clipped_fraction > max → train_with_correction; lag > replay_lag
    or ESS < replay_ess → replay; else train.
    """
    reasons = reasons_for(report, config)
    status = status_for(reasons)
    return GroupDecision(
        group_id=report.group_id,
        status=status,
        recommended_action=RECOMMENDED_ACTION[status],
        reasons=reasons or [DecisionReason.within_budget],
        report=report,
        decided_by=decided_by,
    )


def reject(group_id: str, reasons: list[RejectionReason], *, decided_by: str = "exchange") -> GroupDecision:
    return GroupDecision(
        group_id=group_id,
        status=DecisionStatus.reject,
        recommended_action=RECOMMENDED_ACTION[DecisionStatus.reject],
        rejection_reasons=reasons,
        decided_by=decided_by,
    )


def triage_on_arrival(lag: int, config: GateConfig = GateConfig()) -> tuple[Tier, list[DecisionReason]]:
    """Where a valid group lands before any trainer has scored it: only its lag is known."""
    if lag > config.max_policy_lag:
        return Tier.quarantine, [DecisionReason.policy_lag_quarantine]
    if lag > config.replay_lag:
        return Tier.replay, [DecisionReason.policy_lag_replay]
    return Tier.fresh, []
