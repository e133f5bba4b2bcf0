"""The off-policy budget controller (gate/opbc.py) against DESIGN.md, 'The gate'.

Defaults: clamp 20, min_ess 0.30, replay_ess 0.60, max_clipped_fraction 0.10, max_policy_lag 8,
replay_lag 4, veto |Δ| 30, max_router_flip 0.15. Order: veto → quarantine; lag > 8, ESS < 0.30 or
router flip > 0.15 → quarantine; clipped_fraction > 0.10 → train_with_correction; lag > 4 or
ESS < 0.60 → replay; else train. Every decision carries all reasons that fired.

Trainers, dashboards and the exchange's tiers depend on these exact edges: do not 'fix' a test
here without a decision.
"""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollmarket.contracts import (
    RECOMMENDED_ACTION,
    BudgetReport,
    DecisionReason as R,
    DecisionStatus as S,
    RejectionReason,
    Tier,
)
from rollmarket.gate import GateConfig, decide, reasons_for, reject, status_for, triage_on_arrival


def report(**overrides) -> BudgetReport:
    """A report well within budget; tests change only what they are about."""
    fields = dict(
        group_id="grp-1", n_tokens=100, n_sequences=4, clamp=20.0, token_ess=0.99, sequence_ess=0.99,
        mean_delta=0.0, mean_abs_delta=0.01, max_abs_delta=0.5, clipped_fraction=0.0,
        veto_fraction=0.0, second_moment=1.01, top1pct_mass=0.02, kl_k1=0.0, kl_k3=0.0, chi2=0.01,
        mean_prob_diff=0.001, router_flip_rate=None, policy_lag_steps=0,
    )
    fields.update(overrides)
    return BudgetReport(**fields)


def test_defaults_are_the_published_ones():
    config = GateConfig()
    assert config.clamp == 20.0
    assert config.min_ess == 0.30
    assert config.replay_ess == 0.60
    assert config.max_clipped_fraction == 0.10
    assert config.max_policy_lag == 8
    assert config.replay_lag == 4
    assert config.veto_abs_delta == 30.0
    assert config.max_router_flip == 0.15
    assert config.ess_kind == "token"


# --------------------------------------------------------------------------------------------
# One branch at a time
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,status,reasons", [
    ({}, S.train, [R.within_budget]),
    # veto: any token with |Δ| above 30
    ({"max_abs_delta": 30.5}, S.quarantine, [R.veto_token]),
    ({"max_abs_delta": 30.0}, S.train, [R.within_budget]),
    # lag
    ({"policy_lag_steps": 9}, S.quarantine, [R.policy_lag_quarantine]),
    ({"policy_lag_steps": 8}, S.replay, [R.policy_lag_replay]),
    ({"policy_lag_steps": 5}, S.replay, [R.policy_lag_replay]),
    ({"policy_lag_steps": 4}, S.train, [R.within_budget]),
    # token ESS
    ({"token_ess": 0.29}, S.quarantine, [R.low_ess_quarantine]),
    ({"token_ess": 0.30}, S.replay, [R.low_ess_replay]),
    ({"token_ess": 0.59}, S.replay, [R.low_ess_replay]),
    ({"token_ess": 0.60}, S.train, [R.within_budget]),
    # router flips
    ({"router_flip_rate": 0.16}, S.quarantine, [R.router_flip]),
    ({"router_flip_rate": 0.15}, S.train, [R.within_budget]),
    ({"router_flip_rate": 1.0}, S.quarantine, [R.router_flip]),
    # clipped fraction
    ({"clipped_fraction": 0.11}, S.train_with_correction, [R.clipped_fraction]),
    ({"clipped_fraction": 0.10}, S.train, [R.within_budget]),
], ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_each_branch_alone(overrides, status, reasons):
    decision = decide(report(**overrides))
    assert decision.status is status
    assert decision.reasons == reasons
    assert decision.recommended_action == RECOMMENDED_ACTION[status]
    assert decision.rejection_reasons == []


def test_veto_looks_at_the_largest_delta_not_the_veto_fraction():
    """One absurd token is enough; veto_fraction is reported but does not decide."""
    assert decide(report(max_abs_delta=31.0, veto_fraction=0.01)).status is S.quarantine
    assert decide(report(max_abs_delta=1.0, veto_fraction=0.5)).status is S.train


def test_sequence_ess_does_not_decide_by_default():
    assert decide(report(token_ess=0.99, sequence_ess=0.01)).status is S.train


# --------------------------------------------------------------------------------------------
# Combinations: the strongest status wins, every reason is kept, in the gate's order
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,status,reasons", [
    ({"clipped_fraction": 0.2, "policy_lag_steps": 5},
     S.train_with_correction, [R.clipped_fraction, R.policy_lag_replay]),
    ({"clipped_fraction": 0.2, "token_ess": 0.5},
     S.train_with_correction, [R.clipped_fraction, R.low_ess_replay]),
    ({"policy_lag_steps": 5, "token_ess": 0.5}, S.replay, [R.policy_lag_replay, R.low_ess_replay]),
    # lag 9 quarantines; the same quantity does not also report its replay reason
    ({"policy_lag_steps": 9}, S.quarantine, [R.policy_lag_quarantine]),
    ({"token_ess": 0.1}, S.quarantine, [R.low_ess_quarantine]),
    # ...but a different quantity's replay reason is still reported
    ({"policy_lag_steps": 9, "token_ess": 0.5}, S.quarantine, [R.policy_lag_quarantine, R.low_ess_replay]),
    ({"token_ess": 0.1, "policy_lag_steps": 6}, S.quarantine, [R.low_ess_quarantine, R.policy_lag_replay]),
    ({"max_abs_delta": 40.0, "clipped_fraction": 0.5},
     S.quarantine, [R.veto_token, R.clipped_fraction]),
    ({"router_flip_rate": 0.2, "policy_lag_steps": 5}, S.quarantine, [R.router_flip, R.policy_lag_replay]),
    ({"max_abs_delta": 40.0, "policy_lag_steps": 20, "token_ess": 0.01, "router_flip_rate": 0.9,
      "clipped_fraction": 0.9},
     S.quarantine, [R.veto_token, R.policy_lag_quarantine, R.low_ess_quarantine, R.router_flip,
                    R.clipped_fraction]),
], ids=lambda v: str(v) if isinstance(v, dict) else None)
def test_combinations_keep_every_reason_in_order(overrides, status, reasons):
    decision = decide(report(**overrides))
    assert decision.status is status
    assert decision.reasons == reasons
    assert reasons_for(report(**overrides)) == reasons


def test_decision_carries_its_report_and_author():
    r = report(policy_lag_steps=5, group_id="grp-42")
    decision = decide(r, decided_by="trainer-a")
    assert decision.group_id == "grp-42"
    assert decision.report == r
    assert decision.decided_by == "trainer-a"
    assert decide(r).decided_by == "gate"


def test_reasons_for_is_empty_within_budget_and_decide_says_so():
    assert reasons_for(report()) == []
    assert decide(report()).reasons == [R.within_budget]


@pytest.mark.parametrize("reasons,status", [
    ([], S.train),
    ([R.policy_lag_replay], S.replay),
    ([R.low_ess_replay, R.clipped_fraction], S.train_with_correction),
    ([R.policy_lag_replay, R.clipped_fraction, R.router_flip], S.quarantine),
    ([R.veto_token], S.quarantine),
    ([R.policy_lag_quarantine], S.quarantine),
    ([R.low_ess_quarantine], S.quarantine),
])
def test_status_for_takes_the_strongest_reason(reasons, status):
    assert status_for(reasons) is status


# --------------------------------------------------------------------------------------------
# GateConfig overrides
# --------------------------------------------------------------------------------------------


def test_config_overrides_move_every_threshold():
    config = GateConfig(min_ess=0.5, replay_ess=0.9, max_clipped_fraction=0.0, max_policy_lag=2,
                        replay_lag=0, veto_abs_delta=5.0, max_router_flip=0.01)
    assert decide(report(), config).status is S.train
    assert decide(report(token_ess=0.49), config).reasons == [R.low_ess_quarantine]
    assert decide(report(token_ess=0.5), config).reasons == [R.low_ess_replay]
    assert decide(report(token_ess=0.89), config).reasons == [R.low_ess_replay]
    assert decide(report(token_ess=0.9), config).reasons == [R.within_budget]
    assert decide(report(policy_lag_steps=1), config).reasons == [R.policy_lag_replay]
    assert decide(report(policy_lag_steps=3), config).reasons == [R.policy_lag_quarantine]
    assert decide(report(max_abs_delta=5.5), config).reasons == [R.veto_token]
    assert decide(report(router_flip_rate=0.02), config).reasons == [R.router_flip]
    assert decide(report(clipped_fraction=0.001), config).status is S.train_with_correction
    # The defaults would have let every one of these through.
    for overrides in ({"token_ess": 0.89}, {"policy_lag_steps": 3}, {"max_abs_delta": 5.5},
                      {"router_flip_rate": 0.02}, {"clipped_fraction": 0.001}):
        assert decide(report(**overrides)).status is S.train


def test_ess_kind_sequence_decides_on_sequence_ess():
    config = GateConfig(ess_kind="sequence")
    assert decide(report(token_ess=0.99, sequence_ess=0.2), config).reasons == [R.low_ess_quarantine]
    assert decide(report(token_ess=0.99, sequence_ess=0.45), config).reasons == [R.low_ess_replay]
    assert decide(report(token_ess=0.01, sequence_ess=0.99), config).status is S.train


def test_gate_config_refuses_bad_settings():
    for bad in ({"ess_kind": "batch"}, {"min_ess": 1.5}, {"clamp": 0}, {"max_policy_lag": -1},
                {"surprise": 1}):
        with pytest.raises(ValidationError):
            GateConfig(**bad)


# --------------------------------------------------------------------------------------------
# Triage on arrival and reject
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lag,tier,reasons", [
    (0, Tier.fresh, []),
    (4, Tier.fresh, []),
    (5, Tier.replay, [R.policy_lag_replay]),
    (8, Tier.replay, [R.policy_lag_replay]),
    (9, Tier.quarantine, [R.policy_lag_quarantine]),
    (100, Tier.quarantine, [R.policy_lag_quarantine]),
])
def test_triage_on_arrival_uses_only_the_lag(lag, tier, reasons):
    assert triage_on_arrival(lag) == (tier, reasons)


def test_triage_on_arrival_follows_the_config():
    config = GateConfig(replay_lag=1, max_policy_lag=2)
    assert triage_on_arrival(1, config) == (Tier.fresh, [])
    assert triage_on_arrival(2, config) == (Tier.replay, [R.policy_lag_replay])
    assert triage_on_arrival(3, config) == (Tier.quarantine, [R.policy_lag_quarantine])


def test_triage_agrees_with_decide_on_lag():
    """A group parked by lag on arrival must not be judged differently by lag alone later."""
    expected_status = {Tier.fresh: S.train, Tier.replay: S.replay, Tier.quarantine: S.quarantine}
    for lag in range(12):
        tier, reasons = triage_on_arrival(lag)
        decision = decide(report(policy_lag_steps=lag))
        assert decision.status is expected_status[tier]
        assert decision.reasons == (reasons or [R.within_budget])


def test_reject_carries_typed_reasons_and_no_report():
    decision = reject("grp-9", [RejectionReason.hash_mismatch, RejectionReason.bad_signature])
    assert decision.status is S.reject
    assert decision.group_id == "grp-9"
    assert decision.rejection_reasons == [RejectionReason.hash_mismatch, RejectionReason.bad_signature]
    assert decision.reasons == []
    assert decision.report is None
    assert decision.recommended_action == RECOMMENDED_ACTION[S.reject] == "drop"
    assert decision.decided_by == "exchange"
    assert reject("grp-9", [RejectionReason.expired_lease], decided_by="trainer-a").decided_by == "trainer-a"
