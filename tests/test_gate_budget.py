"""The budget formulas of gate/budget.py (DESIGN.md, 'Formulas'), locked with numbers worked by hand.

Δ_t = logπ_trainer − logπ_rollout over valid tokens, c = 20, w_t = exp(clip(Δ_t, −c, c)).
Every expected value below is computed in a comment, not by the code under test. These numbers
are what dashboards, papers and the gate's thresholds refer to: do not 'fix' a test here without
a decision.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from helpers import TOKENIZER, sha

from rollmarket.contracts import SampleGroup, SamplingConfig, Trajectory
from rollmarket.gate import GateConfig, budget_from_arrays, budget_report, router_flip_rate, valid_token_mask

LN2 = math.log(2.0)


def report_of(rollout, trainer, sequence_ids=None, n_sequences=1, **kwargs):
    rollout = np.asarray(rollout, dtype=np.float64)
    if sequence_ids is None:
        sequence_ids = np.zeros(rollout.shape[0], dtype=np.int64)
    return budget_from_arrays(rollout, np.asarray(trainer, dtype=np.float64),
                              np.asarray(sequence_ids, dtype=np.int64), n_sequences, **kwargs)


def make_group(trajectories: list[Trajectory], lag: int = 0) -> SampleGroup:
    return SampleGroup(
        group_id="grp-b", job_id="job-1", lease_id="lease-1", worker_id="w1", task_id="task-1",
        policy_version=0, checkpoint_digest=sha("ckpt-0"), tokenizer_hash=TOKENIZER,
        sampling_config_hash=SamplingConfig().digest(), engine_name="hf", engine_version="1",
        engine_fingerprint="fp", device_type="cpu", precision_class="bf16", quantization_class="none",
        trajectories=trajectories, policy_lag_steps=lag,
    )


def traj(logprobs, index=0, **kwargs) -> Trajectory:
    n = len(logprobs)
    return Trajectory(sample_index=index, prompt_token_ids=[1], response_token_ids=list(range(2, 2 + n)),
                      logprobs=logprobs, **kwargs)


# --------------------------------------------------------------------------------------------
# Token statistics
# --------------------------------------------------------------------------------------------


def test_two_tokens_with_delta_zero_and_ln2():
    """The worked example of the design: Δ = [0, ln 2].

    rollout p = [1/2, 1/4], trainer p = [1/2, 1/2]  →  Δ = [0, ln 2], w = [1, 2]
    token ESS      = (1+2)² / (2·(1+4))          = 9/10 = 0.9
    mean Δ         = ln2 / 2                      ≈ 0.34657
    max |Δ|        = ln 2
    second moment  = (1+4)/2                      = 2.5
    χ²             = 2.5 − 1                      = 1.5
    k1             = mean(logπ_rollout − logπ_trainer) = −ln2/2
    k3             = ((1−0−1) + (2−ln2−1)) / 2    = (1 − ln2)/2 ≈ 0.15343
    top-1% mass    = k = max(1, ⌈0.02⌉) = 1 weight: 2/3
    mean |Δp|      = (|1/2−1/2| + |1/4−1/2|) / 2  = 0.125
    """
    r = report_of([math.log(0.5), math.log(0.25)], [math.log(0.5), math.log(0.5)], group_id="g")
    assert r.group_id == "g"
    assert r.n_tokens == 2 and r.n_sequences == 1 and r.clamp == 20.0
    assert r.token_ess == pytest.approx(0.9, abs=1e-12)
    assert r.mean_delta == pytest.approx(LN2 / 2, abs=1e-12)
    assert r.mean_abs_delta == pytest.approx(LN2 / 2, abs=1e-12)
    assert r.max_abs_delta == pytest.approx(LN2, abs=1e-12)
    assert r.clipped_fraction == 0.0 and r.veto_fraction == 0.0
    assert r.second_moment == pytest.approx(2.5, abs=1e-12)
    assert r.chi2 == pytest.approx(1.5, abs=1e-12)
    assert r.kl_k1 == pytest.approx(-LN2 / 2, abs=1e-12)
    assert r.kl_k3 == pytest.approx((1 - LN2) / 2, abs=1e-12)
    assert r.top1pct_mass == pytest.approx(2 / 3, abs=1e-12)
    assert r.mean_prob_diff == pytest.approx(0.125, abs=1e-12)
    # One sequence of ΣΔ = ln 2: W = [2], ESS over one sequence = 4/(1·4) = 1.
    assert r.sequence_ess == pytest.approx(1.0, abs=1e-12)


def test_identical_engines_give_the_ideal_report():
    """Δ = 0 everywhere: w = 1, ESS = n²/(n·n) = 1, k1 = k3 = χ² = 0, second moment 1."""
    lp = [-0.1, -2.0, -3.5, -0.7]
    r = report_of(lp, lp, sequence_ids=[0, 0, 1, 1], n_sequences=2)
    assert r.token_ess == 1.0 and r.sequence_ess == 1.0
    assert r.mean_delta == 0.0 and r.max_abs_delta == 0.0
    assert r.kl_k1 == 0.0 and r.kl_k3 == 0.0 and r.chi2 == 0.0 and r.mean_prob_diff == 0.0
    assert r.second_moment == 1.0
    # n = 4 → k = max(1, ⌈0.04⌉) = 1: one weight of 1 out of Σw = 4.
    assert r.top1pct_mass == pytest.approx(0.25)


def test_negative_delta_is_signed_in_mean_and_k1_but_not_in_abs():
    """Δ = [−ln 2, ln 2]: w = [1/2, 2].

    mean Δ = 0, mean |Δ| = ln 2, k1 = 0
    ESS = (2.5)² / (2 · (1/4 + 4)) = 6.25 / 8.5 = 25/34 ≈ 0.73529
    k3 = ((1/2 + ln2 − 1) + (2 − ln2 − 1)) / 2 = 1/4
    χ² = (1/4 + 4)/2 − 1 = 1.125
    """
    r = report_of([0.0, -LN2], [-LN2, 0.0])
    assert r.mean_delta == pytest.approx(0.0, abs=1e-12)
    assert r.mean_abs_delta == pytest.approx(LN2, abs=1e-12)
    assert r.kl_k1 == pytest.approx(0.0, abs=1e-12)
    assert r.token_ess == pytest.approx(25 / 34, abs=1e-12)
    assert r.kl_k3 == pytest.approx(0.25, abs=1e-12)
    assert r.chi2 == pytest.approx(1.125, abs=1e-12)


def test_sequence_ess_uses_the_sum_of_delta_per_sequence():
    """Sequence 0 has Δ = [ln 2, ln 2], sequence 1 has Δ = [0].

    Sequence: W = [exp(2 ln 2), exp(0)] = [4, 1] → (5)² / (2 · 17) = 25/34 ≈ 0.73529
    Token:    w = [2, 2, 1]                      → (5)² / (3 · 9)  = 25/27 ≈ 0.92593
    """
    r = report_of([0.0, 0.0, 0.0], [LN2, LN2, 0.0], sequence_ids=[0, 0, 1], n_sequences=2)
    assert r.sequence_ess == pytest.approx(25 / 34, abs=1e-12)
    assert r.token_ess == pytest.approx(25 / 27, abs=1e-12)
    assert r.n_sequences == 2


def test_a_sequence_without_valid_tokens_counts_as_weight_one():
    """n_sequences = 3 but sequence 2 has no tokens: W = [2, 1, 1] → 16 / (3 · 6) = 8/9."""
    r = report_of([0.0, 0.0], [LN2, 0.0], sequence_ids=[0, 1], n_sequences=3)
    assert r.sequence_ess == pytest.approx(8 / 9, abs=1e-12)


def test_sequence_ess_is_clamped_on_the_sum():
    """Sequence 0 has Δ = [10, 10, 10] (ΣΔ = 30), sequence 1 has Δ = [10, 10, 5] (ΣΔ = 25).

    No single token exceeds c = 20, but both sums do: W = [e^20, e^20] → ESS = 1.
    (Unclamped, W = [e^30, e^25] would give (1 + e^−5)² / (2 (1 + e^−10)) ≈ 0.507.)
    With ΣΔ = [30, 0]: W = [e^20, 1] → (e^20 + 1)² / (2 (e^40 + 1)) ≈ 0.5, finite.
    """
    r = report_of([0.0] * 6, [10.0] * 5 + [5.0], sequence_ids=[0, 0, 0, 1, 1, 1], n_sequences=2)
    assert r.sequence_ess == pytest.approx(1.0, abs=1e-12)
    assert r.clipped_fraction == 0.0
    r = report_of([0.0] * 6, [10.0] * 3 + [0.0] * 3, sequence_ids=[0, 0, 0, 1, 1, 1], n_sequences=2)
    e20 = math.exp(20)
    assert r.sequence_ess == pytest.approx((e20 + 1) ** 2 / (2 * (e20**2 + 1)), rel=1e-12)


def test_clipped_and_veto_fractions_are_strictly_above_their_thresholds():
    """Δ = [20, 30, 30.5, −25] with c = 20 and veto 30.

    clipped = |Δ| > 20 → 30, 30.5, 25       → 3/4  (exactly 20 is not clipped)
    veto    = |Δ| > 30 → 30.5               → 1/4  (exactly 30 is not vetoed)
    max |Δ| = 30.5 (unclipped), mean Δ = (20 + 30 + 30.5 − 25)/4 = 13.875
    """
    r = report_of([-20.0, -30.0, -30.5, 0.0], [0.0, 0.0, 0.0, -25.0])
    assert r.clipped_fraction == 0.75
    assert r.veto_fraction == 0.25
    assert r.max_abs_delta == 30.5
    assert r.mean_delta == pytest.approx(13.875)
    assert r.mean_abs_delta == pytest.approx((20 + 30 + 30.5 + 25) / 4)


def test_clamp_keeps_huge_deltas_finite():
    """Δ = [1000, 0]: w = [e^20, 1] because of the clamp; everything stays finite.

    ESS = (e^20 + 1)² / (2 (e^40 + 1))     ≈ 0.5
    second moment = (e^40 + 1)/2,  χ² = that − 1
    k3 = ((e^20 − 20 − 1) + (1 − 0 − 1)) / 2 = (e^20 − 21)/2   (r and log r both clamped)
    max |Δ| = 1000 (unclipped), mean Δ = 500, k1 = −500
    mean |Δp| = (|e^-1000 − 1| + 0)/2 = 0.5   (rollout logprob −1000, trainer 0)
    """
    e20 = math.exp(20)
    r = report_of([-1000.0, -1.0], [0.0, -1.0])
    values = r.model_dump()
    assert all(math.isfinite(v) for v in values.values() if isinstance(v, float))
    assert r.token_ess == pytest.approx((e20 + 1) ** 2 / (2 * (e20**2 + 1)), rel=1e-12)
    assert r.second_moment == pytest.approx((e20**2 + 1) / 2, rel=1e-12)
    assert r.chi2 == pytest.approx((e20**2 + 1) / 2 - 1, rel=1e-12)
    assert r.kl_k3 == pytest.approx((e20 - 21) / 2, rel=1e-12)
    assert r.max_abs_delta == 1000.0 and r.mean_delta == 500.0 and r.kl_k1 == -500.0
    assert r.clipped_fraction == 0.5 and r.veto_fraction == 0.5
    assert r.mean_prob_diff == pytest.approx(0.5, abs=1e-12)


def test_clamp_is_symmetric_and_configurable():
    """Δ = [−1e6]: w = e^−c. With c = 1: Δ = [3, −3, 0] → w = [e, 1/e, 1], 2 of 3 clipped.

    ESS = (e + 1/e + 1)² / (3 (e² + e^−2 + 1))
    """
    r = report_of([0.0], [-1e6])
    assert math.isfinite(r.token_ess) and r.token_ess == pytest.approx(1.0)
    assert r.second_moment == pytest.approx(math.exp(-40), rel=1e-12)
    e = math.e
    r = report_of([0.0, 0.0, 0.0], [3.0, -3.0, 0.0], config=GateConfig(clamp=1.0))
    assert r.clamp == 1.0
    assert r.clipped_fraction == pytest.approx(2 / 3)
    assert r.token_ess == pytest.approx((e + 1 / e + 1) ** 2 / (3 * (e**2 + e**-2 + 1)), rel=1e-12)
    r = report_of([0.0], [40.0], config=GateConfig(veto_abs_delta=50.0))
    assert r.veto_fraction == 0.0 and r.clipped_fraction == 1.0


def test_top_one_percent_rounds_the_count_up():
    """k = max(1, ⌈0.01 n⌉).

    n = 100 (98 × Δ=0, ln 4, ln 2): k = 1 → 4 / (98 + 4 + 2) = 4/104 = 1/26
    n = 101 (99 × Δ=0, ln 4, ln 2): k = 2 → (4 + 2) / (99 + 6) = 6/105 = 2/35
    """
    r = report_of([0.0] * 100, [0.0] * 98 + [math.log(4), LN2])
    assert r.top1pct_mass == pytest.approx(1 / 26, abs=1e-12)
    r = report_of([0.0] * 101, [0.0] * 99 + [math.log(4), LN2])
    assert r.top1pct_mass == pytest.approx(2 / 35, abs=1e-12)


def test_empty_input_gives_a_neutral_report():
    """No valid tokens: nothing is off-policy. ESS 1, second moment 1, every divergence 0."""
    r = report_of([], [], n_sequences=2, group_id="g", router_flip_rate=0.25, policy_lag_steps=3)
    assert (r.n_tokens, r.n_sequences) == (0, 2)
    assert r.token_ess == 1.0 and r.sequence_ess == 1.0 and r.second_moment == 1.0
    assert (r.mean_delta, r.mean_abs_delta, r.max_abs_delta, r.clipped_fraction, r.veto_fraction,
            r.top1pct_mass, r.kl_k1, r.kl_k3, r.chi2, r.mean_prob_diff) == (0.0,) * 10
    assert r.router_flip_rate == 0.25 and r.policy_lag_steps == 3


def test_router_flip_rate_and_lag_are_carried_through():
    r = report_of([0.0], [0.0], router_flip_rate=0.125, policy_lag_steps=6)
    assert r.router_flip_rate == 0.125 and r.policy_lag_steps == 6
    assert report_of([0.0], [0.0]).router_flip_rate is None


@pytest.mark.parametrize("rollout,trainer", [
    (np.zeros(2), np.zeros(3)), (np.zeros((2, 2)), np.zeros((2, 2))), (np.zeros(()), np.zeros(())),
], ids=["length", "rank-2", "rank-0"])
def test_mismatched_or_non_flat_logprobs_are_an_error(rollout, trainer):
    with pytest.raises(ValueError):
        budget_from_arrays(rollout, trainer, np.zeros(2, dtype=np.int64), 1)


# --------------------------------------------------------------------------------------------
# Masking (budget_report over a group)
# --------------------------------------------------------------------------------------------


def test_valid_token_mask_is_action_and_not_tool_output():
    t = traj([-1.0] * 4, action_mask=[1, 0, 0, 1], tool_output_mask=[0, 1, 0, 0])
    assert valid_token_mask(t).tolist() == [True, False, False, True]
    t = traj([-1.0] * 3, tool_output_mask=[0, 1, 0])  # action_mask None means all produced
    assert valid_token_mask(t).tolist() == [True, False, True]
    t = traj([-1.0] * 3)
    assert valid_token_mask(t).tolist() == [True, True, True]


def test_masked_tokens_do_not_count():
    """Tokens 1 (tool output) and 2 (action 0) carry Δ = 50; counted, they would veto the group.

    Valid tokens 0 and 3 have Δ = [0, ln 2], which is the worked example: ESS 0.9, max |Δ| ln 2.
    """
    t = traj([-1.0, -60.0, -60.0, -1.0 - LN2], action_mask=[1, 0, 0, 1], tool_output_mask=[0, 1, 0, 0])
    r = budget_report(make_group([t]), [np.array([-1.0, -10.0, -10.0, -1.0])])
    assert r.n_tokens == 2
    assert r.token_ess == pytest.approx(0.9, abs=1e-6)
    assert r.max_abs_delta == pytest.approx(LN2, abs=1e-6)
    assert r.veto_fraction == 0.0 and r.clipped_fraction == 0.0


def test_budget_report_pools_tokens_and_keeps_sequences_apart():
    """Trajectory 0: Δ = [ln 2, ln 2]; trajectory 1: Δ = [0] plus a tool-output token.

    Token ESS over w = [2, 2, 1] = 25/27; sequence ESS over W = [4, 1] = 25/34 (see above).
    The group's policy_lag_steps is used unless the caller overrides it.
    """
    t0 = traj([-1.0, -2.0], index=0)
    t1 = traj([-0.5, 0.0], index=1, action_mask=[1, 0], tool_output_mask=[0, 1])
    group = make_group([t0, t1], lag=5)
    trainer = [np.array([-1.0 + LN2, -2.0 + LN2]), np.array([-0.5, -7.0])]
    r = budget_report(group, trainer)
    assert (r.group_id, r.n_tokens, r.n_sequences, r.policy_lag_steps) == ("grp-b", 3, 2, 5)
    assert r.token_ess == pytest.approx(25 / 27, abs=1e-6)
    assert r.sequence_ess == pytest.approx(25 / 34, abs=1e-6)
    assert budget_report(group, trainer, policy_lag_steps=0).policy_lag_steps == 0
    assert r.router_flip_rate is None


def test_budget_report_errors_on_mismatched_inputs():
    group = make_group([traj([-1.0, -2.0], index=0), traj([-1.0], index=1)])
    with pytest.raises(ValueError):
        budget_report(group, [np.zeros(2)])  # one array for two trajectories
    with pytest.raises(ValueError):
        budget_report(group, [np.zeros(2), np.zeros(2)])  # second has 1 token
    no_logprobs = make_group([Trajectory(sample_index=0, prompt_token_ids=[1], response_token_ids=[2])])
    with pytest.raises(ValueError):
        budget_report(no_logprobs, [np.zeros(1)])
    with pytest.raises(ValueError):  # trainer experts for a group that has none
        budget_report(group, [np.zeros(2), np.zeros(1)],
                      trainer_routed_experts=[np.zeros((2, 1, 1), np.int16), np.zeros((1, 1, 1), np.int16)])


# --------------------------------------------------------------------------------------------
# Router flip rate
# --------------------------------------------------------------------------------------------

# [T=3, L=2, K=2]; column 0 is the top-1 expert.
ROLLOUT_TLK = np.array([[[1, 7], [2, 8]],
                        [[3, 9], [4, 9]],
                        [[5, 9], [6, 9]]], dtype=np.int16)
TRAINER_TLK = np.array([[[1, 0], [9, 0]],    # layer 1 flips (2 → 9); top-2 differs everywhere
                        [[3, 0], [4, 0]],    # no flips
                        [[0, 5], [0, 6]]],   # both layers flip (top-1 ↔ top-2 swapped)
                       dtype=np.int16)


def test_router_flip_rate_counts_top1_differences_per_token_and_layer():
    """Flips at (t0, l1), (t2, l0), (t2, l1): 3 of 3·2 = 6 positions → 0.5.

    Only column 0 counts: the trainer's second choices all differ and change nothing, while a
    swap of first and second choice (token 2) is a flip.
    """
    assert router_flip_rate([ROLLOUT_TLK], [TRAINER_TLK], [np.ones(3, bool)]) == 0.5


def test_router_flip_rate_skips_invalid_tokens():
    """Token 2 masked out: 1 flip in 2·2 = 4 positions → 0.25."""
    assert router_flip_rate([ROLLOUT_TLK], [TRAINER_TLK], [np.array([True, True, False])]) == 0.25


def test_router_flip_rate_pools_positions_across_sequences():
    """Sequence A: T=1, L=2, both flip (2/2). Sequence B: T=3, L=2, no flips (0/6).

    Pooled: 2/8 = 0.25 (the mean of per-sequence rates would be 0.5).
    """
    a_rollout = np.array([[[1], [2]]], np.int16)
    a_trainer = np.array([[[3], [4]]], np.int16)
    b = ROLLOUT_TLK
    rate = router_flip_rate([a_rollout, b], [a_trainer, b.copy()], [np.ones(1, bool), np.ones(3, bool)])
    assert rate == 0.25


def test_router_flip_rate_compares_top1_even_when_k_differs():
    trainer_top1_TLK = TRAINER_TLK[:, :, :1]
    assert router_flip_rate([ROLLOUT_TLK], [trainer_top1_TLK], [np.ones(3, bool)]) == 0.5


def test_router_flip_rate_of_nothing_is_zero():
    assert router_flip_rate([], [], []) == 0.0
    empty = np.zeros((0, 2, 2), np.int16)
    assert router_flip_rate([empty], [empty], [np.zeros(0, bool)]) == 0.0
    assert router_flip_rate([ROLLOUT_TLK], [TRAINER_TLK], [np.zeros(3, bool)]) == 0.0


def test_router_flip_rate_errors_on_mismatched_shapes():
    with pytest.raises(ValueError):
        router_flip_rate([ROLLOUT_TLK], [TRAINER_TLK[:2]], [np.ones(3, bool)])  # T differs
    with pytest.raises(ValueError):
        router_flip_rate([ROLLOUT_TLK], [TRAINER_TLK[:, :1]], [np.ones(3, bool)])  # L differs


def test_router_flip_rate_errors_when_a_sequence_is_missing():
    """zip() would silently drop the second sequence and report a rate over half the data."""
    with pytest.raises(ValueError):
        router_flip_rate([ROLLOUT_TLK, ROLLOUT_TLK], [TRAINER_TLK], [np.ones(3, bool)] * 2)
    with pytest.raises(ValueError):
        router_flip_rate([ROLLOUT_TLK], [TRAINER_TLK], [np.ones(3, bool)] * 2)


def test_budget_report_measures_router_flips_over_valid_tokens():
    """Token 2 is tool output, so it drops out: 1 flip in 4 positions → 0.25."""
    t = traj([-1.0, -1.0, 0.0], action_mask=[1, 1, 0], tool_output_mask=[0, 0, 1],
             routed_experts=ROLLOUT_TLK)
    r = budget_report(make_group([t]), [np.array([-1.0, -1.0, 0.0])], trainer_routed_experts=[TRAINER_TLK])
    assert r.router_flip_rate == 0.25
    with pytest.raises(ValueError):  # no trainer experts for the one trajectory
        budget_report(make_group([t]), [np.array([-1.0, -1.0, 0.0])], trainer_routed_experts=[])
