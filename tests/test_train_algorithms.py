"""The reference trainer's algorithm core (rollmarket.train) against hand-computed numbers.

These lock the formulas of docs/training.md, "Algorithms": advantages, off-policy corrections,
policy losses, aggregation normalisers, KL and the token transforms (GTPO, HICRA, SEPA). The
arithmetic is written beside each expected number. Do not change the expected numbers without a decision.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from rollmarket.train import (
    LossConfig,
    SepaSchedule,
    TransformConfig,
    compute_advantages,
    masked_is,
    policy_loss,
    sequence_tis,
    token_advantages,
    token_entropy,
    token_tis,
)

T = torch.tensor
DOC = Path(__file__).resolve().parents[1] / "docs" / "training.md"


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float32),
                               torch.as_tensor(expected, dtype=torch.float32), atol=atol, rtol=0)


# --- advantages -----------------------------------------------------------------------------

def test_grpo_uses_population_std():
    # r = [1,0,0,1]: mean 0.5; population std sqrt(mean((±0.5)²)) = 0.5; A = ±0.5/0.5 = ±1.
    close(compute_advantages(T([1.0, 0, 0, 1]), "grpo"), [1.0, -1, -1, 1], atol=1e-5)
    # r = [1,0,0,0]: mean 0.25; var = (0.75² + 3·0.25²)/4 = 0.1875; std = 0.4330127;
    # A = 0.75/0.4330127 = 1.7320508, −0.25/0.4330127 = −0.5773503.
    close(compute_advantages(T([1.0, 0, 0, 0]), "grpo"), [1.7320508, -0.5773503, -0.5773503, -0.5773503],
          atol=1e-5)


def test_dr_grpo_only_centres():
    # r − mean: [1,0,0,1] − 0.5 = [0.5, −0.5, −0.5, 0.5].
    close(compute_advantages(T([1.0, 0, 0, 1]), "dr_grpo"), [0.5, -0.5, -0.5, 0.5])
    # [2,0,1] − 1 = [1, −1, 0]: no division by std (which would be 0.8165).
    close(compute_advantages(T([2.0, 0, 1]), "dr_grpo"), [1.0, -1, 0])


def test_rloo_is_leave_one_out():
    # [1,0,0]: 1 − mean(0,0) = 1; 0 − mean(1,0) = −0.5; 0 − mean(1,0) = −0.5.
    close(compute_advantages(T([1.0, 0, 0]), "rloo"), [1.0, -0.5, -0.5])
    # [3,1]: 3 − 1 = 2; 1 − 3 = −2.
    close(compute_advantages(T([3.0, 1]), "rloo"), [2.0, -2])


def test_maxrl_divides_by_success_rate():
    # [1,0,0,0]: p̂ = 0.25; success (1 − 0.25)/0.25 = 3 = (N−K)/K = 3/1; failure −0.25/0.25 = −1.
    close(compute_advantages(T([1.0, 0, 0, 0]), "maxrl"), [3.0, -1, -1, -1])
    # [1,1,1,0]: p̂ = 0.75; success 0.25/0.75 = 1/3 = (N−K)/K = 1/3; failure −1.
    close(compute_advantages(T([1.0, 1, 1, 0]), "maxrl"), [1 / 3, 1 / 3, 1 / 3, -1.0])


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo", "maxrl"])
@pytest.mark.parametrize("value", [0.0, 1.0, 0.3])
def test_tied_groups_carry_no_signal(mode, value):
    assert torch.equal(compute_advantages(torch.full((4,), value), mode), torch.zeros(4))


def test_maxrl_with_non_positive_mean_is_zero():
    # mean(−1, 1, −1, 0) = −0.25 ≤ 0: no success rate to divide by.
    assert torch.equal(compute_advantages(T([-1.0, 1, -1, 0]), "maxrl"), torch.zeros(4))


def test_advantage_errors():
    with pytest.raises(ValueError, match="unknown advantage mode"):
        compute_advantages(T([1.0, 0]), "ppo")
    with pytest.raises(ValueError, match="rloo"):
        compute_advantages(T([1.0]), "rloo")
    with pytest.raises(ValueError, match="1-D"):
        compute_advantages(T([[1.0, 0]]), "grpo")


# --- off-policy corrections -----------------------------------------------------------------

def test_token_tis_caps_each_token():
    # Δ = [log 3, log 0.5, 0 | pad]; C = 2 → w = [min(3,2), 0.5, 1, 0] = [2, 0.5, 1, 0].
    delta = T([[math.log(3), math.log(0.5), 0.0, 9.0]])
    mask = T([[1, 1, 1, 0]])
    c = token_tis(delta, mask, cap=2.0)
    close(c.weights_BT, [[2.0, 0.5, 1.0, 0.0]])
    assert c.mask_BT.tolist() == [[True, True, True, False]]
    # mean over 3 valid tokens: (2 + 0.5 + 1)/3 = 1.1666667; one of three capped.
    close(c.metrics["rollout_corr/rollout_is_mean"], 3.5 / 3)
    close(c.metrics["rollout_corr/rollout_is_capped_fraction"], 1 / 3)


def test_sequence_tis_broadcasts_the_capped_product():
    # seq 0: Δ = [log 2, log 3] → exp(Σ) = 6 → min(6, 5) = 5 on both tokens.
    # seq 1: Δ = [log 0.5, pad] → 0.5 on its one token, 0 on padding (the pad's 7.0 is ignored).
    delta = T([[math.log(2), math.log(3)], [math.log(0.5), 7.0]])
    mask = T([[1, 1], [1, 0]])
    c = sequence_tis(delta, mask, cap=5.0)
    close(c.weights_BT, [[5.0, 5.0], [0.5, 0.0]], atol=1e-5)
    # per-sequence mean (5 + 0.5)/2 = 2.75; one of two sequences capped.
    close(c.metrics["rollout_corr/rollout_is_seq_mean"], 2.75, atol=1e-5)
    close(c.metrics["rollout_corr/rollout_is_seq_capped_fraction"], 0.5)


def test_masked_is_token_bounds_drop_single_tokens():
    # ratios [3, 0.5, 1], bounds [0.5, 2] inclusive: 3 is out, 0.5 is on the edge and stays.
    delta = T([[math.log(3), math.log(0.5), 0.0]])
    c = masked_is(delta, T([[1, 1, 1]]), token_bounds=(0.5, 2.0))
    assert c.mask_BT.tolist() == [[False, True, True]]
    close(c.weights_BT, [[0.0, 1.0, 1.0]])
    close(c.metrics["rollout_corr/rollout_rs_masked_fraction"], 1 / 3)
    close(c.metrics["rollout_corr/rollout_rs_token_masked_fraction"], 1 / 3)
    # verl's seq masked fraction counts a sequence that lost any token (1 of 1); ours "dropped
    # whole" counts only the sequence and geometric-mean bounds (0 of 1).
    close(c.metrics["rollout_corr/rollout_rs_seq_masked_fraction"], 1.0)
    close(c.metrics["rollout_corr/rollout_rs_seq_dropped_fraction"], 0.0)


def test_masked_is_sequence_and_geometric_mean_bounds_drop_whole_sequences():
    # seq 0: ratios [4, 1] → product 4, geometric mean exp((log 4 + 0)/2) = 2.
    # seq 1: ratios [1.2, 1.2] → product 1.44, geometric mean 1.2.
    delta = T([[math.log(4), 0.0], [math.log(1.2), math.log(1.2)]])
    mask = T([[1, 1], [1, 1]])
    # sequence bounds [0.5, 3]: 4 > 3 drops seq 0; 1.44 stays.
    c = masked_is(delta, mask, sequence_bounds=(0.5, 3.0))
    assert c.mask_BT.tolist() == [[False, False], [True, True]]
    close(c.metrics["rollout_corr/rollout_rs_seq_masked_fraction"], 0.5)
    close(c.metrics["rollout_corr/rollout_rs_seq_dropped_fraction"], 0.5)
    close(c.metrics["rollout_corr/rollout_rs_masked_fraction"], 0.5)
    # sequence bounds [0.5, 1.4]: 1.44 > 1.4 drops seq 1 too.
    assert not masked_is(delta, mask, sequence_bounds=(0.5, 1.4)).mask_BT.any()
    # geometric-mean bounds [0.5, 1.5]: 2 > 1.5 drops seq 0; 1.2 stays (product 1.44 is irrelevant).
    g = masked_is(delta, mask, geo_mean_bounds=(0.5, 1.5))
    assert g.mask_BT.tolist() == [[False, False], [True, True]]
    close(g.weights_BT, [[0.0, 0.0], [1.0, 1.0]])


def test_masked_is_geometric_mean_counts_only_valid_tokens():
    # ratios [4 | pad, pad]: mean over the one valid token is log 4 → geo mean 4 > 3 → dropped.
    c = masked_is(T([[math.log(4), 0.0, 0.0]]), T([[1, 0, 0]]), geo_mean_bounds=(0.5, 3.0))
    assert not c.mask_BT.any()


def test_correction_errors():
    with pytest.raises(ValueError, match="cap"):
        token_tis(torch.zeros(1, 2), torch.ones(1, 2), cap=0.0)
    with pytest.raises(ValueError, match="bounds"):
        masked_is(torch.zeros(1, 2), torch.ones(1, 2), token_bounds=(2.0, 1.0))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        token_tis(torch.zeros(2), torch.ones(2), cap=2.0)


# --- policy losses --------------------------------------------------------------------------

def test_ppo_clip_is_asymmetric_with_the_advantage_sign():
    # Both tokens have ratio exp(log 1.5) = 1.5, clip range [0.8, 1.28].
    # A = +1: −min(1.5·1, 1.28·1) = −1.28 (clipped, no gradient).
    # A = −1: −min(−1.5, −1.28) = +1.5 (not clipped; gradient d(1.5·e^{lp−old})/dlp = 1.5).
    lp = torch.full((1, 2), math.log(1.5), requires_grad=True)
    loss, m = policy_loss(lp, torch.zeros(1, 2), T([[1.0, -1.0]]), torch.ones(1, 2), LossConfig())
    close(loss, (-1.28 + 1.5) / 2, atol=1e-6)  # token mean = 0.11
    close(m["actor/pg_loss"], 0.11, atol=1e-6)
    close(m["actor/pg_clipfrac"], 0.5)
    close(m["actor/ppo_kl"], -math.log(1.5))  # mean(old − lp) = −0.4054651
    loss.backward()
    close(lp.grad, [[0.0, 1.5 / 2]])  # divided by the 2 tokens of token_mean


def test_ppo_clip_low_side():
    # ratio 0.5 with A = −1: −min(−0.5, −0.8) = 0.8 (clipped at 1 − 0.2);
    # ratio 0.5 with A = +1: −min(0.5, 0.8) = −0.5 (not clipped).
    lp = torch.full((1, 2), math.log(0.5))
    loss, m = policy_loss(lp, torch.zeros(1, 2), T([[-1.0, 1.0]]), torch.ones(1, 2))
    close(loss, (0.8 - 0.5) / 2)
    close(m["actor/pg_clipfrac"], 0.5)


def test_cispo_gradient_is_capped_detached_weight_times_advantage():
    # ratios [3, 0.5] (old = 0), cap 2 → sg weights [2, 0.5]; A = [0.5, −1].
    # ∂L/∂lp_t = −min(r_t, cap)·A_t / n = [−2·0.5/2, −0.5·(−1)/2] = [−0.5, 0.25].
    lp = T([[math.log(3), math.log(0.5)]]).requires_grad_()
    loss, m = policy_loss(lp, torch.zeros(1, 2), T([[0.5, -1.0]]), torch.ones(1, 2),
                          LossConfig(kind="cispo", cispo_cap=2.0))
    loss.backward()
    close(lp.grad, [[-0.5, 0.25]])
    # value: −(2·0.5·log 3 + 0.5·(−1)·log 0.5)/2 = −(1.0986123 + 0.3465736)/2 = −0.7225929.
    close(loss, -(math.log(3) + 0.5 * math.log(2)) / 2)
    close(m["actor/pg_clipfrac"], 0.5)


def test_reinforce_uses_is_weights_as_constants():
    # w = [2, 0.5], A = [0.5, −1]: ∂L/∂lp = −w·A/2 = [−0.5, 0.25], whatever lp and old are.
    lp = T([[-1.0, -2.0]]).requires_grad_()
    w = T([[2.0, 0.5]]).requires_grad_()
    loss, m = policy_loss(lp, T([[-5.0, 3.0]]), T([[0.5, -1.0]]), torch.ones(1, 2),
                          LossConfig(kind="reinforce"), is_weights_BT=w)
    loss.backward()
    close(lp.grad, [[-0.5, 0.25]])
    assert w.grad is None
    # value: −(2·0.5·(−1) + 0.5·(−1)·(−2))/2 = −(−1 + 1)/2 = 0.
    close(loss, 0.0)
    assert m["actor/pg_clipfrac"] == 0.0


def test_is_weights_multiply_the_ppo_term():
    # ratio 1 (inside the clip), A = 1, w = 0.5: L = −0.5·1·1 = −0.5; gradient −0.5·ratio = −0.5.
    lp = torch.zeros(1, 1, requires_grad=True)
    loss, _ = policy_loss(lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1),
                          is_weights_BT=T([[0.5]]))
    loss.backward()
    close(loss, -0.5)
    close(lp.grad, [[-0.5]])


# Per-token loss = −A·lp with lp = −1 everywhere, so L_t = A_t.
# seq 0: 3 valid tokens, L = [1, 2, 3]; seq 1: 1 valid token, L = [4, pad, pad]; B = 2, T = 3.
AGG_A = T([[1.0, 2.0, 3.0], [4.0, 100.0, 100.0]])
AGG_MASK = T([[1, 1, 1], [1, 0, 0]])


@pytest.mark.parametrize("aggregation,norm_len,expected", [
    ("token-mean", None, (1 + 2 + 3 + 4) / 4),                   # Σ L / Σ mask = 10/4 = 2.5
    ("seq-mean-token-sum", None, (6 + 4) / 2),                   # mean of token sums (6, 4) = 5
    ("seq-mean-token-sum-norm", 5, (1 + 2 + 3 + 4) / (2 * 5)),   # Σ L / (B·norm_len) = 10/10 = 1
    ("seq-mean-token-mean", None, (6 / 3 + 4 / 1) / 2),          # mean(2, 4) = 3
])
def test_aggregation_normalisers(aggregation, norm_len, expected):
    loss, _ = policy_loss(torch.full((2, 3), -1.0), torch.zeros(2, 3), AGG_A, AGG_MASK,
                          LossConfig(kind="reinforce", aggregation=aggregation, norm_len=norm_len))
    close(loss, expected)


def test_seq_mean_token_mean_skips_empty_sequences():
    # seq 1 is all padding: the mean is over seq 0 alone, (1+2+3)/3 = 2, not (2 + 0)/2 = 1.
    loss, _ = policy_loss(torch.full((2, 3), -1.0), torch.zeros(2, 3), AGG_A, T([[1, 1, 1], [0, 0, 0]]),
                          LossConfig(kind="reinforce", aggregation="seq-mean-token-mean"))
    close(loss, 2.0)


def test_kl_to_reference_k3_and_k1():
    # lp = 0, ref = log 2: k3 = e^{log 2} − log 2 − 1 = 2 − 0.6931472 − 1 = 0.3068528.
    lp = torch.zeros(1, 1, requires_grad=True)
    ref = T([[math.log(2)]])
    cfg = LossConfig(kind="reinforce", kl_coef=0.1, kl_kind="k3")
    # A = 0 so the policy term is 0 and the loss is kl_coef·k3 = 0.03068528.
    loss, m = policy_loss(lp, torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), cfg,
                          ref_logprobs_BT=ref)
    close(m["actor/kl_ref"], 2 - math.log(2) - 1)
    close(loss, 0.1 * (2 - math.log(2) - 1))
    loss.backward()
    # ∂k3/∂lp = −e^{ref−lp} + 1 = −1 → times 0.1 = −0.1.
    close(lp.grad, [[-0.1]])
    # k1 = lp − ref = −log 2 = −0.6931472.
    _, m1 = policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1),
                        LossConfig(kl_kind="k1"), ref_logprobs_BT=ref)
    close(m1["actor/kl_ref"], -math.log(2))


def test_padding_never_reaches_loss_or_gradient():
    # Padding slots hold −inf log-probs and huge advantages; they must not produce NaN or count.
    lp = T([[0.0, float("-inf")]]).requires_grad_()
    loss, _ = policy_loss(lp, T([[0.0, 5.0]]), T([[1.0, 1e9]]), T([[1, 0]]),
                          ref_logprobs_BT=T([[0.0, 1.0]]))
    close(loss, -1.0)  # ratio 1, A = 1, one valid token
    loss.backward()
    assert torch.isfinite(lp.grad).all()
    assert lp.grad[0, 1] == 0


def test_loss_config_rejects_unknown_names():
    for bad in ({"kind": "grpo"}, {"aggregation": "mean"}, {"kl_kind": "k4"}, {"clip_low": 1.0}):
        with pytest.raises(ValueError):
            LossConfig(**bad)


# --- token transforms -----------------------------------------------------------------------

def test_transform_none_broadcasts_the_completion_advantage():
    # A = [2, −1]; seq 0 has 2 valid tokens, seq 1 has 1; padding gets 0.
    adv, _ = token_advantages(T([2.0, -1.0]), torch.ones(2, 3), T([[1, 1, 0], [1, 0, 0]]))
    close(adv, [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])


def test_gtpo_weights_by_entropy_relative_to_the_completion_mean():
    # h = [1, 3], h̄ = 2, β = 0.5: w = 1 + 0.5·(h/h̄ − 1) = [1 − 0.25, 1 + 0.25] = [0.75, 1.25];
    # A = 2 → [1.5, 2.5]. The padding's entropy (99) does not enter h̄.
    adv, _ = token_advantages(T([2.0]), T([[1.0, 3.0, 99.0]]), T([[1, 1, 0]]),
                              TransformConfig("gtpo", gtpo_beta=0.5))
    close(adv, [[1.5, 2.5, 0.0]], atol=1e-6)
    # β = 2, h = [0, 2], h̄ = 1: w = [max(0, 1 + 2·(0 − 1)), 1 + 2·(2 − 1)] = [0, 3].
    adv, _ = token_advantages(T([1.0]), T([[0.0, 2.0]]), torch.ones(1, 2),
                              TransformConfig("gtpo", gtpo_beta=2.0))
    close(adv, [[0.0, 3.0]], atol=1e-6)
    # All-zero entropy: no signal to weight by → uniform.
    adv, _ = token_advantages(T([1.0]), torch.zeros(1, 2), torch.ones(1, 2), TransformConfig("gtpo"))
    close(adv, [[1.0, 1.0]])


def test_gtpo_hicra_amplifies_credit_and_damps_blame_on_planning_tokens():
    # uniform entropy → GTPO leaves A; α = 0.2 on the planning token (index 0):
    # A = 2: 2 + 0.2·2 = 2.4; A = −2: −2 + 0.2·2 = −1.6; execution tokens unchanged.
    adv, _ = token_advantages(T([2.0, -2.0]), torch.ones(2, 2), torch.ones(2, 2),
                              TransformConfig("gtpo_hicra"), planning_mask_BT=T([[1, 0], [1, 0]]))
    close(adv, [[2.4, 2.0], [-1.6, -2.0]])


def test_gtpo_sepa_pools_execution_entropy_before_gtpo():
    # h = [1, 3, 5 | plan 2]; execution mean (1+3+5)/3 = 3. λ = 0.5: exec h ← 0.5·3 + 0.5·h = [2, 3, 4];
    # planning keeps 2 → h = [2, 3, 4, 2], h̄ = 2.75.
    # β = 1: w = h/h̄ = [0.7272727, 1.0909091, 1.4545455, 0.7272727].
    h, plan, cfg = T([[1.0, 3, 5, 2]]), T([[0, 0, 0, 1]]), TransformConfig("gtpo_sepa", gtpo_beta=1.0)
    adv, m = token_advantages(T([1.0]), h, torch.ones(1, 4), cfg, planning_mask_BT=plan, sepa_lambda=0.5)
    close(adv, [[2 / 2.75, 3 / 2.75, 4 / 2.75, 2 / 2.75]], atol=1e-6)
    # λ = 1: exec h = [3, 3, 3], h = [3, 3, 3, 2], h̄ = 2.75 → w = [3, 3, 3, 2]/2.75.
    adv1, _ = token_advantages(T([1.0]), h, torch.ones(1, 4), cfg, planning_mask_BT=plan, sepa_lambda=1.0)
    close(adv1, [[3 / 2.75, 3 / 2.75, 3 / 2.75, 2 / 2.75]], atol=1e-6)
    # λ = 0 is plain GTPO: h̄ = 11/4 = 2.75, w = [1, 3, 5, 2]/2.75.
    adv0, _ = token_advantages(T([1.0]), h, torch.ones(1, 4), cfg, planning_mask_BT=plan, sepa_lambda=0.0)
    close(adv0, [[1 / 2.75, 3 / 2.75, 5 / 2.75, 2 / 2.75]], atol=1e-6)
    # metrics are on the raw entropies: exec [1, 3, 5] mean 3, var (4 + 0 + 4)/3 = 8/3; plan [2].
    close(m["exec_entropy_mean"], 3.0)
    close(m["exec_entropy_var"], 8 / 3)
    close(m["plan_entropy_mean"], 2.0)
    close(m["plan_entropy_var"], 0.0)


def test_transform_errors():
    with pytest.raises(ValueError, match="unknown transform mode"):
        TransformConfig("sepa")
    with pytest.raises(ValueError, match="planning_mask_BT"):
        token_advantages(T([1.0]), torch.ones(1, 2), torch.ones(1, 2), TransformConfig("gtpo_hicra"))


def test_sepa_schedule_ramps_linearly_behind_a_sticky_gate():
    # steps = 10, delay = 5: λ(5) = 0, λ(10) = (10 − 5)/10 = 0.5, λ(20) = min(15/10, 1) = 1.
    s = SepaSchedule(steps=10, delay_steps=5, correct_rate_gate=0.3)
    assert s.metrics(10) == {"sepa_lambda": 0.0, "sepa_gate_open": 0.0}  # gate still closed
    s.observe_correct_rate(0.29)
    assert s.lambda_at(10) == 0.0
    s.observe_correct_rate(0.3)
    s.observe_correct_rate(0.1)  # sticky: a later dip does not close it
    assert [s.lambda_at(k) for k in (5, 10, 20)] == [0.0, 0.5, 1.0]
    assert s.metrics(10) == {"sepa_lambda": 0.5, "sepa_gate_open": 1.0}
    assert SepaSchedule(steps=4).lambda_at(2) == 0.5  # gate 0 starts open
    assert SepaSchedule().lambda_at(100) == 0.0  # steps 0: SEPA off


def test_token_entropy_is_the_trainers_shannon_entropy():
    # uniform over 4 → log 4 = 1.3862944; one-hot (logits 0 vs −1e4) → 0.
    logits = T([[[0.0, 0.0, 0.0, 0.0], [0.0, -1e4, -1e4, -1e4]]])
    close(token_entropy(logits), [[math.log(4), 0.0]], atol=1e-5)

# --- docs -----------------------------------------------------------------------------------

def test_every_metric_is_documented():
    """A metric a trainer emits and docs/training.md does not name fails here."""
    doc = DOC.read_text()
    names = set()
    delta, mask = torch.zeros(1, 2), torch.ones(1, 2)
    for c in (token_tis(delta, mask, 2.0), sequence_tis(delta, mask, 2.0), masked_is(delta, mask)):
        names |= set(c.metrics)
    _, m = policy_loss(delta, delta, delta, mask, ref_logprobs_BT=delta)
    names |= set(m)
    _, m = token_advantages(torch.zeros(1), delta, mask, TransformConfig("gtpo_sepa"), planning_mask_BT=mask)
    names |= set(m) | set(SepaSchedule().metrics(0))
    missing = sorted(n for n in names if f"`{n}`" not in doc)
    assert not missing, f"metrics missing from docs/training.md: {missing}"
    assert re.search(r"^## Algorithms$", doc, re.MULTILINE)
