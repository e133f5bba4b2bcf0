"""verl's rollout_corr figures (`rollmarket.observatory.offpolicy`), worked by hand and checked
against a transliteration of verl's torch code (rollout_corr_helper.py) written here in the test.

Δ = logπ_trainer − logπ_rollout; C = rollout_is_threshold. Every expected number is derived in
the comments from the chosen probabilities (powers of 1/2), not from the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from rollmarket.gate import GateConfig, budget_from_arrays
from rollmarket.observatory import dense_summary
from rollmarket.observatory.offpolicy import (
    FIGURE_NAMES,
    offpolicy_figures,
    rs_seq_masked_fraction,
)

LN2 = math.log(2.0)
# One sequence of four tokens: rollout p = [1/2, 1/4, 1/8, 1/2], trainer p = [1/2, 1/2, 1/2, 1/8]
# → Δ = [0, ln 2, 2 ln 2, −2 ln 2], ratios w = [1, 2, 4, 1/4].
ROLLOUT = np.log([1 / 2, 1 / 4, 1 / 8, 1 / 2])
TRAINER = np.log([1 / 2, 1 / 2, 1 / 2, 1 / 8])


def close(actual, expected, tol=1e-12):
    assert actual is not None and math.isclose(actual, expected, rel_tol=tol, abs_tol=tol), (actual, expected)


def test_token_level_figures_by_hand():
    f = offpolicy_figures(ROLLOUT, TRAINER, is_threshold=2.0)
    # fractions on the unclipped ratios: 4 > 2 (one of four), 1/4 < 1/2 (one of four).
    close(f.rollout_is_ratio_fraction_high, 1 / 4)
    close(f.rollout_is_ratio_fraction_low, 1 / 4)
    # ESS on the ratios clipped to [1/2, 2]: [1, 2, 2, 1/2]; mean 11/8, mean of squares 37/16;
    # (121/64) / (37/16) = 121/148.
    close(f.rollout_is_eff_sample_size, 121 / 148)
    # kl = mean(−Δ) = −(0 + 1 + 2 − 2)·ln2 / 4.
    close(f.kl, -LN2 / 4)
    # k3 = mean(w − Δ − 1) = [0 + (1 − ln2) + (3 − 2 ln2) + (−3/4 + 2 ln2)] / 4 = (13/4 − ln2) / 4.
    close(f.k3_kl, (13 / 4 - LN2) / 4)
    # chi2_token = mean(w²) − 1 = (1 + 4 + 16 + 1/16)/4 − 1 = 337/64 − 1.
    close(f.chi2_token, 337 / 64 - 1)
    # one sequence, ΣΔ = ln 2: chi2_seq = exp(2 ln 2) − 1 = 3.
    close(f.chi2_seq, 3.0)
    # trainer mean logprob (−1 −1 −1 −3)·ln2/4 = −1.5 ln2; rollout (−1 −2 −3 −1)·ln2/4 = −1.75 ln2.
    close(f.training_log_ppl, 1.5 * LN2)
    close(f.training_ppl, 2 ** 1.5)
    close(f.rollout_log_ppl, 1.75 * LN2)
    close(f.rollout_ppl, 2 ** 1.75)
    # log_ppl_diff = mean lp_rollout − mean lp_trainer = −0.25 ln2 (= training − rollout log ppl).
    close(f.log_ppl_diff, -0.25 * LN2)
    close(f.log_ppl_abs_diff, 0.25 * LN2)
    close(f.log_ppl_diff_max, -0.25 * LN2)
    close(f.log_ppl_diff_min, -0.25 * LN2)
    close(f.ppl_ratio, 2 ** -0.25)
    assert (f.n_tokens, f.n_sequences) == (4, 1)
    # Our token ESS beside it: no [1/C, C] clip. Σw = 29/4, Σw² = 337/16 → (841/16) / (4·337/16).
    close(dense_summary(ROLLOUT, TRAINER).token_ess, 841 / 1348, tol=1e-7)
    assert not math.isclose(841 / 1348, 121 / 148, rel_tol=1e-3)  # the two ESS really differ


def test_sequence_level_figures_by_hand():
    # The same tokens as two sequences of two: ΣΔ = [ln 2, 0]; C = 1.5 (log C ≈ 0.405).
    f = offpolicy_figures(ROLLOUT, TRAINER, [2, 2], is_threshold=1.5, is_level="sequence")
    close(f.rollout_is_ratio_fraction_high, 1 / 2)  # ln 2 > log 1.5
    close(f.rollout_is_ratio_fraction_low, 0.0)
    # W = [2, 1] clipped to [2/3, 3/2] → [3/2, 1], each on 2 tokens: mean 5/4, mean sq 13/8 → 25/26.
    close(f.rollout_is_eff_sample_size, 25 / 26)
    close(f.chi2_seq, (4 + 1) / 2 - 1)
    # per-sequence trainer mean logprobs −ln2, −2 ln2 → ppl 2 and 4.
    close(f.training_ppl, 3.0)
    close(f.training_log_ppl, 1.5 * LN2)
    # rollout: −1.5 ln2, −2 ln2 → ppl 2^1.5 and 4.
    close(f.rollout_ppl, (2 ** 1.5 + 4) / 2)
    # d_i = [−1.5 + 1, −2 + 2]·ln2 = [−0.5 ln2, 0].
    close(f.log_ppl_diff, -0.25 * LN2)
    close(f.log_ppl_abs_diff, 0.25 * LN2)
    close(f.log_ppl_diff_max, 0.0)
    close(f.log_ppl_diff_min, -0.5 * LN2)
    close(f.ppl_ratio, (2 ** -0.5 + 1) / 2)
    # token-level figures do not depend on the split.
    close(f.kl, -LN2 / 4)
    close(f.chi2_token, 337 / 64 - 1)
    # An empty sequence (all tool output) is left out, not counted as weight 1.
    g = offpolicy_figures(ROLLOUT, TRAINER, [2, 0, 2], is_threshold=1.5, is_level="sequence")
    assert g == f


def test_nothing_to_measure_and_overflow_are_none_and_bad_input_raises():
    empty = offpolicy_figures([], [], [0, 0])
    assert all(getattr(empty, name) is None for name in FIGURE_NAMES)
    assert all(v is None for v in empty.metrics().values()) and len(empty.metrics()) == len(FIGURE_NAMES)
    # Δ = 800: exp(Δ) is past float64 (verl would log inf); chi2 uses the ±20 bound and stays finite.
    wild = offpolicy_figures([-800.0], [0.0])
    assert wild.k3_kl is None
    close(wild.chi2_token, math.exp(40) - 1, tol=1e-9)
    with pytest.raises(ValueError):
        offpolicy_figures([0.0], [0.0, 0.0])
    with pytest.raises(ValueError):
        offpolicy_figures([0.0, 0.0], [0.0, 0.0], [1])
    with pytest.raises(ValueError):
        offpolicy_figures([0.0], [0.0], is_threshold=0.0)
    with pytest.raises(ValueError):
        offpolicy_figures([0.0], [0.0], is_level="batch")
    with pytest.raises(ValueError):
        offpolicy_figures([float("nan")], [0.0])


def _verl(old_BT, rollout_BT, mask_BT, C, level):
    """verl's compute_is_metrics (ESS, fractions) and compute_offpolicy_metrics, transliterated."""
    import torch

    def masked_mean(v, m, axis=None):
        s = (v * m).sum() if axis is None else (v * m).sum(axis)
        return s / ((m.sum() if axis is None else m.sum(axis)) + 1e-8)

    old, roll, m = (torch.tensor(x, dtype=torch.float64) for x in (old_BT, rollout_BT, mask_BT))
    log_ratio = old - roll
    out = {}
    if level == "token":
        w = torch.exp(torch.clamp(log_ratio, -20, 20)) * m
        out["rollout_is_ratio_fraction_high"] = masked_mean((w > C).double(), m)
        out["rollout_is_ratio_fraction_low"] = masked_mean((w < 1 / C).double(), m)
    else:
        s = (log_ratio * m).sum(-1, keepdim=True)
        w = torch.exp(torch.clamp(s, -20, 20)).expand_as(log_ratio) * m
        out["rollout_is_ratio_fraction_high"] = (s > math.log(C)).double().mean()
        out["rollout_is_ratio_fraction_low"] = (s < math.log(1 / C)).double().mean()
    we = w.clamp(min=1 / C, max=C)
    out["rollout_is_eff_sample_size"] = 1.0 / masked_mean((we / (masked_mean(we, m) + 1e-8)) ** 2, m)
    out["kl"] = masked_mean(roll - old, m)
    out["k3_kl"] = masked_mean(torch.exp(log_ratio) - log_ratio - 1, m)
    mlt, mlr = masked_mean(old, m, -1), masked_mean(roll, m, -1)
    out["training_ppl"], out["training_log_ppl"] = torch.exp(-mlt).mean(), (-mlt).mean()
    out["rollout_ppl"], out["rollout_log_ppl"] = torch.exp(-mlr).mean(), (-mlr).mean()
    d = mlr - mlt
    out.update(log_ppl_diff=d.mean(), log_ppl_abs_diff=d.abs().mean(), log_ppl_diff_max=d.max(),
               log_ppl_diff_min=d.min(), ppl_ratio=torch.exp(d).mean())
    out["chi2_token"] = masked_mean(torch.exp(torch.clamp(log_ratio, -20, 20)) ** 2, m) - 1
    out["chi2_seq"] = torch.exp(2 * torch.clamp((log_ratio * m).sum(-1), -20, 20)).mean() - 1
    return {k: float(v) for k, v in out.items()}


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_matches_verls_torch_code_on_a_padded_batch(level):
    rng = np.random.default_rng(7)
    B, T = 6, 9
    rollout_BT = np.log(rng.uniform(0.05, 1.0, (B, T)))
    old_BT = rollout_BT + rng.normal(0.0, 0.6, (B, T))
    mask_BT = np.arange(T)[None, :] < rng.integers(1, T + 1, B)[:, None]  # every row has a token
    expected = _verl(old_BT, rollout_BT, mask_BT, 1.7, level)
    f = offpolicy_figures(rollout_BT[mask_BT], old_BT[mask_BT], mask_BT.sum(1), is_threshold=1.7, is_level=level)
    for name, value in expected.items():
        assert math.isclose(getattr(f, name), value, rel_tol=1e-6, abs_tol=1e-9), (name, getattr(f, name), value)


def test_rs_seq_masked_fraction_counts_any_lost_token():
    valid = [[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 0]]
    kept = [[1, 0, 0], [1, 1, 1], [0, 0, 0], [0, 0, 0]]
    # rows with tokens: 0, 1, 3; row 0 lost one token, row 3 lost its only one → 2/3.
    close(rs_seq_masked_fraction(valid, kept), 2 / 3)
    assert rs_seq_masked_fraction([[0, 0]], [[0, 0]]) is None


def test_the_gate_report_carries_verls_figures():
    # Sequence 0 holds the first two tokens, sequence 1 the last two (ids out of order on purpose).
    report = budget_from_arrays(ROLLOUT[[2, 0, 3, 1]], TRAINER[[2, 0, 3, 1]], np.array([1, 0, 1, 0]), 2,
                                config=GateConfig(ess_kind="sequence"))
    rc = report.rollout_corr
    assert (rc.is_threshold, rc.is_level) == (2.0, "sequence")
    close(rc.kl, -LN2 / 4)
    close(rc.chi2_seq, (4 + 1) / 2 - 1)
    # sequence weights [2, 1] clipped to [1/2, 2] stay → mean 3/2, mean sq 5/2 → 9/10.
    close(rc.rollout_is_eff_sample_size, 9 / 10)
    close(rc.rollout_is_ratio_fraction_high, 0.0)  # ln 2 is not above ln 2
    token = budget_from_arrays(ROLLOUT, TRAINER, np.zeros(4, np.int64), 1).rollout_corr
    close(token.rollout_is_eff_sample_size, 121 / 148)
    assert budget_from_arrays(np.zeros(0), np.zeros(0), np.zeros(0, np.int64), 1).rollout_corr.kl is None
