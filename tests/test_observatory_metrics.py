"""The observatory's metrics (`rollmarket.observatory`), locked with numbers worked by hand.

Δ_t = logπ_trainer − logπ_rollout over valid tokens, c = 20, w_t = exp(clip(Δ_t, −c, c))
(DESIGN.md, 'Formulas'; docs/observatory.md, 'Metrics'). Every expected value below is computed
in a comment, not by the code under test. These lock the formulas that the dashboards, the
matrix and the gate's thresholds refer to: do not change the expected numbers without a decision.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest

from rollmarket.contracts import (
    AgentStep,
    AgentTrajectory,
    DeltaToken,
    DenseMismatchReport,
    DivergenceKind,
    TerminalReason,
    ToolCallRecord,
    ToolResult,
    WorstToken,
)
from rollmarket.gate import router_flip_rate
from rollmarket.observatory import (
    DenseSummary,
    DivergenceSummary,
    RouterSummary,
    bootstrap_interval,
    dense_report,
    dense_summary,
    dense_summary_many,
    divergence_report,
    first_token_split,
    router_report,
    router_summary,
    sequence_ess,
    trajectory_divergence,
    worst_token_index,
)
from rollmarket.observatory import dense as dense_module

LN2, LN3 = math.log(2.0), math.log(3.0)
E20 = math.exp(20.0)


# --------------------------------------------------------------------------------------------
# dense_summary
# --------------------------------------------------------------------------------------------


def test_worked_example_delta_zero_and_ln2():
    """rollout p = [1/2, 1/4], trainer p = [1/2, 1/2]  →  Δ = [0, ln 2], w = [1, 2].

    token ESS      = (1+2)² / (2·(1+4))               = 9/10
    mean Δ = mean |Δ| = ln2/2,  max |Δ| = ln 2,  ΣΔ = ln 2
    second moment  = (1+4)/2 = 2.5,  χ² = 2.5 − 1 = 1.5
    k1             = mean(lp_r − lp_t) = −ln2/2
    k3             = ((1 − 0 − 1) + (2 − ln2 − 1)) / 2 = (1 − ln2)/2
    top-1% mass    = k = ⌈2/100⌉ = 1 weight: 2/3
    log ppl        rollout −(ln½ + ln¼)/2 = 1.5 ln2, trainer −ln½ = ln2, diff = −ln2/2
    mean |Δp|      = (|½ − ½| + |¼ − ½|)/2 = 0.125
    """
    s = dense_summary([math.log(0.5), math.log(0.25)], [math.log(0.5), math.log(0.5)])
    assert (s.n_tokens, s.n_sequences, s.clamp, s.veto) == (2, 1, 20.0, 30.0)
    expected = dict(
        token_ess=0.9, sequence_ess=1.0, sequence_log_ratio=LN2, mean_delta=LN2 / 2,
        mean_abs_delta=LN2 / 2, max_abs_delta=LN2, clipped_fraction=0.0, veto_fraction=0.0,
        second_moment=2.5, chi2=1.5, kl_k1=-LN2 / 2, kl_k3=(1 - LN2) / 2, top1pct_gradient_mass=2 / 3,
        log_ppl_rollout=1.5 * LN2, log_ppl_trainer=LN2, log_ppl_diff=-LN2 / 2, mean_prob_diff=0.125,
    )
    for name, value in expected.items():
        assert getattr(s, name) == pytest.approx(value, abs=1e-12), name
    # float32 input (what engines return) gives the same numbers to float32 precision.
    s32 = dense_summary(np.float32([math.log(0.5), math.log(0.25)]), np.float32([math.log(0.5)] * 2))
    for name, value in expected.items():
        assert getattr(s32, name) == pytest.approx(value, abs=1e-6), name


def test_negative_and_positive_delta_by_hand():
    """Δ = [−ln 2, ln 2]: w = [½, 2].

    mean Δ = 0, mean |Δ| = ln 2
    ESS = (2.5)² / (2·(¼ + 4)) = 6.25/8.5 = 25/34
    k3  = ((½ + ln2 − 1) + (2 − ln2 − 1)) / 2 = ½·½ = ¼
    χ²  = (¼ + 4)/2 − 1 = 1.125
    """
    s = dense_summary([0.0, -LN2], [-LN2, 0.0])
    assert s.mean_delta == pytest.approx(0.0, abs=1e-12)
    assert s.mean_abs_delta == pytest.approx(LN2, abs=1e-12)
    assert s.token_ess == pytest.approx(25 / 34, abs=1e-12)
    assert s.kl_k3 == pytest.approx(0.25, abs=1e-12)
    assert s.chi2 == pytest.approx(1.125, abs=1e-12)


def test_identical_engines_are_exactly_ideal():
    """Δ = 0: w = 1, ESS = n²/(n·n) = 1 exactly; k1 = k3 = χ² = |Δp| = 0; n = 4 → top-1% = 1/4."""
    for dtype in (np.float32, np.float64):
        lp = np.array([-0.1, -2.0, -3.5, -0.7], dtype=dtype)
        s = dense_summary(lp, lp.copy())
        assert s.token_ess == 1.0 and s.second_moment == 1.0
        assert s.kl_k1 == 0.0 and s.kl_k3 == 0.0 and s.chi2 == 0.0 and s.mean_prob_diff == 0.0
        assert s.max_abs_delta == 0.0 and s.top1pct_gradient_mass == 0.25


def test_k3_and_prob_diff_keep_their_precision_when_engines_nearly_agree():
    """Δ = 1e-4 everywhere: k3 = e^x − x − 1 = x²/2 + x³/6 + … = 5.0001667e-9.

    Computed as mean(exp(Δ)) − mean(Δ) − 1 in float32 this would be rounding noise (~1e-7); it
    is Σexpm1(Δ) − ΣΔ in float64. With p_r = ½: |Δp| = ½·(e^x − 1) = 5.00025e-5.
    χ² = e^2x − 1 = 2.0002e-4, from Σ(2u + u²) with u = expm1(Δ), not mean(w²) − 1.
    """
    x = 1e-4
    for dtype, rel in ((np.float64, 1e-9), (np.float32, 1e-2)):
        rollout = np.full(1000, math.log(0.5), dtype=dtype)
        trainer = (rollout.astype(np.float64) + x).astype(dtype)
        dx = float(trainer[0]) - float(rollout[0])  # x as the dtype holds it (= x in float64)
        s = dense_summary(rollout, trainer)
        assert s.kl_k3 == pytest.approx(dx**2 / 2 + dx**3 / 6, rel=rel)
        assert s.mean_prob_diff == pytest.approx(0.5 * math.expm1(dx), rel=1e-5)
        assert s.chi2 == pytest.approx(math.expm1(2 * dx), rel=1e-5)  # e^2x − 1 = 2.0002e-4
        assert s.token_ess == pytest.approx(1.0, abs=1e-12)


def test_top_one_percent_for_200_tokens_with_one_large_weight():
    """n = 200: k = ⌈200/100⌉ = 2. Δ = ln 9 once, 0 elsewhere: w = 9 once, 1 × 199.

    top-2 weights = 9 + 1 = 10, Σw = 199 + 9 = 208  →  10/208 = 5/104
    n = 201 (one more Δ = 0): k = ⌈2.01⌉ = 3 → (9 + 1 + 1)/(200 + 9) = 11/209
    n = 100 (two equal large weights, Δ = ln 9): k = 1 → 9/(98 + 18) = 9/116
    """
    trainer = np.zeros(200)
    trainer[17] = math.log(9)
    assert dense_summary(np.zeros(200), trainer).top1pct_gradient_mass == pytest.approx(5 / 104, abs=1e-12)
    assert dense_summary(np.zeros(201), np.append(trainer, 0.0)).top1pct_gradient_mass == pytest.approx(
        11 / 209, abs=1e-12)
    trainer = np.zeros(100)
    trainer[[3, 60]] = math.log(9)
    assert dense_summary(np.zeros(100), trainer).top1pct_gradient_mass == pytest.approx(9 / 116, abs=1e-12)


def test_delta_50_is_clipped_and_vetoed():
    """Δ = [50, 0] (rollout lp −50, trainer 0; then both −1): clamp c = 20, veto 30.

    clipped = vetoed = 1/2; max |Δ| = 50 (unclipped); mean Δ = 25; k1 = −25
    w = [e^20, 1]:  ESS = (e^20 + 1)² / (2 (e^40 + 1)) ≈ 0.5;  second moment = (e^40 + 1)/2
    k3 = ((e^20 − 20 − 1) + 0)/2 = (e^20 − 21)/2   (r and log r both clamped)
    top-1% (k = 1) = e^20 / (e^20 + 1);  mean |Δp| = (|e^−50 − 1| + 0)/2 ≈ 0.5
    """
    for dtype, rel in ((np.float64, 1e-12), (np.float32, 1e-6)):
        s = dense_summary(np.array([-50.0, -1.0], dtype), np.array([0.0, -1.0], dtype))
        assert s.clipped_fraction == 0.5 and s.veto_fraction == 0.5
        assert s.max_abs_delta == 50.0 and s.mean_delta == 25.0 and s.kl_k1 == -25.0
        assert s.token_ess == pytest.approx((E20 + 1) ** 2 / (2 * (E20**2 + 1)), rel=rel)
        assert s.second_moment == pytest.approx((E20**2 + 1) / 2, rel=rel)
        assert s.chi2 == pytest.approx((E20**2 + 1) / 2 - 1, rel=rel)
        assert s.kl_k3 == pytest.approx((E20 - 21) / 2, rel=rel)
        assert s.top1pct_gradient_mass == pytest.approx(E20 / (E20 + 1), rel=rel)
        assert s.mean_prob_diff == pytest.approx(0.5, abs=1e-9)


def test_thresholds_are_strict_and_configurable():
    """Δ = [20, 25, 30, −30.5]: |Δ| > 20 → 25, 30, 30.5 → 3/4 clipped; |Δ| > 30 → 30.5 → 1/4.

    With clamp 1 and veto 26: Δ = [3, −3, 0] → w = [e, 1/e, 1], 2/3 clipped, none vetoed,
    ESS = (e + 1/e + 1)² / (3 (e² + e⁻² + 1)).
    """
    s = dense_summary(np.zeros(4), [20.0, 25.0, 30.0, -30.5])
    assert (s.clipped_fraction, s.veto_fraction) == (0.75, 0.25)
    s = dense_summary(np.zeros(3), [3.0, -3.0, 0.0], clamp=1.0, veto=26.0)
    e = math.e
    assert (s.clamp, s.veto, s.clipped_fraction, s.veto_fraction) == (1.0, 26.0, pytest.approx(2 / 3), 0.0)
    assert s.token_ess == pytest.approx((e + 1 / e + 1) ** 2 / (3 * (e**2 + e**-2 + 1)), rel=1e-12)


def test_clamp_keeps_millions_of_tokens_finite():
    """2M float32 tokens, Δ = +30 on even positions and −30 on odd ones: w = e^20, e^−20.

    ESS = ((e^20 + e^−20)·n/2)² / (n · (e^40 + e^−40)·n/2) = (e^20 + e^−20)² / (2 (e^40 + e^−40)) ≈ ½
    second moment = (e^40 + e^−40)/2; every token clipped and none vetoed (30 is not > 30).
    """
    n = 2_000_000
    trainer = np.where(np.arange(n) % 2 == 0, 30.0, -30.0).astype(np.float32)
    s = dense_summary(np.zeros(n, np.float32), trainer)
    emin = math.exp(-20.0)
    assert s.token_ess == pytest.approx((E20 + emin) ** 2 / (2 * (E20**2 + emin**2)), rel=1e-5)
    assert s.second_moment == pytest.approx((E20**2 + emin**2) / 2, rel=1e-5)
    assert (s.clipped_fraction, s.veto_fraction) == (1.0, 0.0)
    assert all(math.isfinite(v) for v in (s.kl_k3, s.chi2, s.top1pct_gradient_mass, s.mean_prob_diff))
    # A clamp of 100 would overflow float32's exp(2c): still finite (the arithmetic is float64).
    s = dense_summary(np.zeros(4, np.float32), np.float32([80.0, 0.0, 0.0, 0.0]), clamp=100.0, veto=1000.0)
    assert s.token_ess == pytest.approx((math.exp(80) + 3) ** 2 / (4 * (math.exp(160) + 3)), rel=1e-12)


def test_weights_are_shifted_across_chunks(monkeypatch):
    """Chunks of 4 tokens, n = 12: Δ = ln 2 in chunk 0, ln 4 in chunk 2, 0 elsewhere.

    The running maximum (the shift) grows from ln 2 to ln 4, so the sums so far are rescaled.
    Σw = 10 + 2 + 4 = 16, Σw² = 10 + 4 + 16 = 30 → ESS = 256 / (12·30) = 32/45
    second moment = 30/12 = 2.5; top-1% (k = 1) = 4/16 = 1/4
    """
    monkeypatch.setattr(dense_module, "CHUNK", 4)
    trainer = np.zeros(12)
    trainer[1], trainer[10] = LN2, math.log(4)
    s = dense_summary(np.zeros(12), trainer)
    assert s.token_ess == pytest.approx(32 / 45, abs=1e-12)
    assert s.second_moment == pytest.approx(2.5, abs=1e-12)
    assert s.top1pct_gradient_mass == pytest.approx(0.25, abs=1e-12)
    # The same tokens in one chunk give the same numbers.
    monkeypatch.setattr(dense_module, "CHUNK", 1 << 15)
    assert dense_summary(np.zeros(12), trainer).token_ess == pytest.approx(32 / 45, abs=1e-12)


def test_mask_drops_tokens_whatever_they_hold():
    """Tokens 1 and 2 are masked out (tool output): NaN and Δ = 50 there change nothing.

    The valid tokens are the worked example Δ = [0, ln 2]: ESS 0.9, max |Δ| ln 2, no veto.
    """
    rollout = [-1.0, math.nan, -60.0, -1.0 - LN2]
    trainer = [-1.0, -0.5, -10.0, -1.0]
    s = dense_summary(rollout, trainer, mask=[True, False, False, True])
    assert s.n_tokens == 2
    assert s.token_ess == pytest.approx(0.9, abs=1e-12)
    assert s.max_abs_delta == pytest.approx(LN2, abs=1e-12)
    assert s.veto_fraction == 0.0
    assert worst_token_index(rollout, trainer, mask=[True, False, False, True]) == 3
    assert worst_token_index([0.0, -1.0], [0.0, 0.0]) == 1
    assert worst_token_index([0.0], [0.0], mask=[False]) is None


def test_sequence_ess_over_two_sequences():
    """ΣΔ = 0 and ln 3 → W = [1, 3] → (1+3)² / (2·(1+9)) = 16/20 = 0.8.

    Sequence 0: Δ = [ln 3, −ln 3]; sequence 1: Δ = [ln 3, 0]. Token ESS over w = [3, ⅓, 3, 1]:
    (22/3)² / (4·(9 + 1/9 + 9 + 1)) = (484/9) / (4·172/9) = 484/688 = 121/172.
    """
    rollout = [[-LN3, 0.0], [-LN3, -1.0]]
    trainer = [[0.0, -LN3], [0.0, -1.0]]
    s = dense_summary_many(rollout, trainer)
    assert (s.n_tokens, s.n_sequences) == (4, 2)
    assert s.sequence_ess == pytest.approx(0.8, abs=1e-12)
    assert s.token_ess == pytest.approx(121 / 172, abs=1e-12)
    assert s.sequence_log_ratio == pytest.approx(LN3, abs=1e-12)
    flat = dense_summary(np.concatenate(rollout), np.concatenate(trainer), lengths=[2, 2])
    assert flat.sequence_ess == pytest.approx(0.8, abs=1e-12)
    assert sequence_ess([0.0, LN3]) == pytest.approx(0.8, abs=1e-12)
    # A single sequence always has sequence ESS 1; no sequences, None.
    assert dense_summary(rollout[1], trainer[1]).sequence_ess == 1.0
    assert sequence_ess([]) is None


def test_sequence_ess_with_masks_and_an_empty_sequence():
    """Sequence 1's only token is masked: its ΣΔ = 0, W = 1. Sequences: ΣΔ = [ln 3, 0, 0].

    W = [3, 1, 1] → 25 / (3·11) = 25/33.  Sequence sums are clamped: ΣΔ = [30, 0] → W = [e^20, 1].
    """
    s = dense_summary([0.0, 0.0, 0.0], [LN3, 5.0, 0.0], mask=[True, False, True], lengths=[1, 1, 1])
    assert (s.n_tokens, s.n_sequences) == (2, 3)
    assert s.sequence_ess == pytest.approx(25 / 33, abs=1e-12)
    s = dense_summary_many([[0.0] * 3, [0.0]], [[10.0] * 3, [0.0]])
    assert s.sequence_ess == pytest.approx((E20 + 1) ** 2 / (2 * (E20**2 + 1)), rel=1e-12)
    assert s.clipped_fraction == 0.0  # no token is above 20, only the sum


def test_empty_input_gives_none_and_never_raises():
    for s in (dense_summary([], []), dense_summary([1.0], [2.0], mask=[False]), dense_summary_many([], [])):
        assert s.n_tokens == 0
        assert s.token_ess is None and s.sequence_ess is None and s.kl_k3 is None
        assert s.mean_prob_diff is None and s.top1pct_gradient_mass is None
        assert s.sequence_log_ratio == 0.0


@pytest.mark.parametrize("call", [
    lambda: dense_summary(np.zeros(2), np.zeros(3)),
    lambda: dense_summary(np.zeros((2, 2)), np.zeros((2, 2))),
    lambda: dense_summary(np.zeros(()), np.zeros(())),
    lambda: dense_summary(np.zeros(2), np.zeros(2), mask=[True]),
    lambda: dense_summary([0.0, math.nan], [0.0, 0.0]),
    lambda: dense_summary([0.0, 0.0], [0.0, -math.inf]),
    lambda: dense_summary(np.zeros(3), np.zeros(3), lengths=[1, 1]),
    lambda: dense_summary(np.zeros(2), np.zeros(2), lengths=[3, -1]),
    lambda: dense_summary(np.zeros(2), np.zeros(2), clamp=0.0),
    lambda: dense_summary(["a"], ["b"]),
    lambda: dense_summary_many([np.zeros(2)], [np.zeros(3)]),
    lambda: dense_summary_many([np.zeros(2)], []),
    lambda: dense_summary_many([np.zeros(2), np.zeros(1)], [np.zeros(2), np.zeros(1)],
                               masks=[[True], [True, True]]),
], ids=["length", "rank-2", "rank-0", "mask", "nan", "inf", "lengths-sum", "negative-length", "clamp",
        "strings", "many-length", "many-count", "many-masks"])
def test_bad_input_is_a_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_dense_report_carries_every_statistic():
    s = dense_summary([math.log(0.5), math.log(0.25)], [math.log(0.5), math.log(0.5)])
    worst = WorstToken(position=1, token_id=5, token_text="x", delta=LN2, rollout_logprob=math.log(0.25),
                       trainer_logprob=math.log(0.5))
    report = dense_report(s, trajectory_id="t#0", rollout_engine="fp8", trainer_engine="fp32",
                          response_length=3, worst_token=worst)
    assert isinstance(report, DenseMismatchReport)
    assert (report.n_tokens, report.response_length, report.worst_token) == (2, 3, worst)
    for name in DenseMismatchReport.model_fields:
        if hasattr(s, name):
            assert getattr(report, name) == getattr(s, name), name
    empty = dense_report(dense_summary([], []), trajectory_id="t#1", rollout_engine="a", trainer_engine="b",
                         response_length=0)
    assert empty.token_ess is None and empty.sequence_log_ratio == 0.0


# --------------------------------------------------------------------------------------------
# router_summary
# --------------------------------------------------------------------------------------------

# [T=2, L=2, K=2]; column 0 is the top-1 expert.
ROLLOUT_TLK = np.array([[[1, 2], [3, 4]],
                        [[5, 6], [7, 8]]], dtype=np.int16)
TRAINER_TLK = np.array([[[1, 2], [4, 3]],    # layer 1: top-1 3 → 4 (a flip), set {3, 4} unchanged
                        [[5, 9], [7, 8]]],   # layer 0: top-1 5 kept, set {5, 6} → {5, 9}
                       dtype=np.int16)


def test_router_summary_by_hand():
    """Flip: only (t0, l1) → 1/4. Per layer: l0 0/2 = 0, l1 1/2 = 0.5 → worst layer 1 at 0.5.

    Sets differ only at (t1, l0): token 0 agrees at every layer, token 1 does not → 1/2.
    |A∩B| per (t, l) = 2, 2, 1, 2 → overlap = 7 / (4·2) = 7/8.
    """
    s = router_summary(ROLLOUT_TLK, TRAINER_TLK)
    assert (s.n_tokens, s.num_layers, s.top_k) == (2, 2, 2)
    assert s.router_flip_rate == 0.25
    assert s.token_expert_disagreement_rate == 0.5
    assert s.per_layer_flip_rate == (0.0, 0.5)
    assert (s.worst_layer, s.worst_layer_flip_rate) == (1, 0.5)
    assert s.topk_overlap == 7 / 8
    # One implementation: the gate's flip rate agrees.
    assert router_flip_rate([ROLLOUT_TLK], [TRAINER_TLK], [np.ones(2, bool)]) == s.router_flip_rate


def test_router_summary_with_a_mask():
    """Token 1 masked: flip 1/2, no set differs, overlap 4/4 = 1.

    Token 0 masked: no flip (worst layer 0, the first of equals, at 0), disagreement 1, overlap
    (1 + 2)/(2·2) = 3/4.
    """
    s = router_summary(ROLLOUT_TLK, TRAINER_TLK, mask=[True, False])
    assert (s.n_tokens, s.router_flip_rate, s.token_expert_disagreement_rate, s.topk_overlap) == (1, 0.5, 0.0, 1.0)
    s = router_summary(ROLLOUT_TLK, TRAINER_TLK, mask=[False, True])
    assert (s.router_flip_rate, s.worst_layer, s.worst_layer_flip_rate) == (0.0, 0, 0.0)
    assert (s.token_expert_disagreement_rate, s.topk_overlap) == (1.0, 0.75)


def test_router_summary_of_no_tokens_and_bad_shapes():
    s = router_summary(ROLLOUT_TLK, TRAINER_TLK, mask=[False, False])
    assert s.n_tokens == 0 and s.router_flip_rate is None and s.topk_overlap is None
    assert s.per_layer_flip_rate == () and s.worst_layer is None
    for bad in (TRAINER_TLK[:1], TRAINER_TLK[:, :1], TRAINER_TLK[:, :, :1], TRAINER_TLK[0]):
        with pytest.raises(ValueError):
            router_summary(ROLLOUT_TLK, bad)
    with pytest.raises(ValueError):
        router_summary(ROLLOUT_TLK, TRAINER_TLK.astype(np.float32))
    with pytest.raises(ValueError):
        router_summary(ROLLOUT_TLK, TRAINER_TLK, mask=[True])


def test_router_report():
    report = router_report(router_summary(ROLLOUT_TLK, TRAINER_TLK), trajectory_id="t#0",
                           rollout_engine="fp8", trainer_engine="fp32")
    assert report.per_layer_flip_rate == [0.0, 0.5] and report.worst_layer == 1
    assert (report.n_tokens, report.num_layers, report.top_k, report.topk_overlap) == (2, 2, 2, 0.875)


# --------------------------------------------------------------------------------------------
# trajectory_divergence
# --------------------------------------------------------------------------------------------


def call(name: str, arguments: dict | None = None, raw: str | None = None) -> ToolCallRecord:
    return ToolCallRecord(id="c", name=name, raw_arguments=raw if raw is not None else json.dumps(arguments),
                          arguments=arguments, result=ToolResult(name=name, content="ok"))


def step(index: int, content: str = "", calls: list[ToolCallRecord] | None = None) -> AgentStep:
    return AgentStep(index=index, content=content, tool_calls=calls or [],
                     finish_reason="tool_calls" if calls else "stop")


def run(*steps: AgentStep, answer: str | None = None,
        reason: TerminalReason = TerminalReason.final_answer) -> AgentTrajectory:
    return AgentTrajectory(task_id="t", messages=[{"role": "user", "content": "q"}], steps=list(steps),
                           final_answer=answer, terminal_reason=reason)


CALC_2_2 = call("calculator", {"expression": "2+2", "precision": 2})


def test_identical_runs_never_diverge():
    """Same turns: kind none, step None, rate 0/2 = 0, Jaccard 1/1 = 1, answers match."""
    a = run(step(0, calls=[CALC_2_2]), step(1, "4"), answer="4")
    s = trajectory_divergence(a, a)
    assert (s.first_divergent_step, s.kind) == (None, DivergenceKind.none)
    assert (s.tool_choice_disagreement_rate, s.tool_call_jaccard) == (0.0, 1.0)
    assert s.final_answer_match_strict and s.final_answer_match_soft
    assert (s.steps_a, s.steps_b) == (2, 2)


def test_tool_choice_divergence():
    """Turn 0 agrees; turn 1 calls calculator vs web_search; turn 2 both answer.

    first step 1, kind tool_choice; tool names differ at 1 of 3 aligned turns → 1/3.
    Call sets: A = {calc(2+2), calc(3*3)}, B = {calc(2+2), search(x)} → |A∩B|/|A∪B| = 1/3.
    """
    a = run(step(0, calls=[CALC_2_2]), step(1, calls=[call("calculator", {"expression": "3*3"})]), step(2, "9"))
    b = run(step(0, calls=[CALC_2_2]), step(1, calls=[call("web_search", {"query": "x"})]), step(2, "9"))
    s = trajectory_divergence(a, b)
    assert (s.first_divergent_step, s.kind) == (1, DivergenceKind.tool_choice)
    assert s.tool_choice_disagreement_rate == pytest.approx(1 / 3)
    assert s.tool_call_jaccard == pytest.approx(1 / 3)


def test_tool_args_divergence_compares_canonical_json():
    """Key order and spacing do not matter; values do. Unparsable arguments compare raw."""
    reordered = call("calculator", {"precision": 2, "expression": "2+2"},
                     raw='{ "precision": 2, "expression": "2+2" }')
    same = trajectory_divergence(run(step(0, calls=[CALC_2_2])), run(step(0, calls=[reordered])))
    assert same.kind is DivergenceKind.none and same.tool_call_jaccard == 1.0
    other = call("calculator", {"expression": "2+3", "precision": 2})
    s = trajectory_divergence(run(step(0, calls=[CALC_2_2])), run(step(0, calls=[other])))
    assert (s.first_divergent_step, s.kind, s.tool_choice_disagreement_rate) == (0, DivergenceKind.tool_args, 0.0)
    assert s.tool_call_jaccard == 0.0  # {calc(2+2)} vs {calc(2+3)}: 0 shared of 2
    broken_a, broken_b = run(step(0, calls=[call("calculator", raw="{2+2")])), run(step(0, calls=[call(
        "calculator", raw="{2+3")]))
    assert trajectory_divergence(broken_a, broken_a).kind is DivergenceKind.none
    assert trajectory_divergence(broken_a, broken_b).kind is DivergenceKind.tool_args


def test_content_divergence_after_normalization():
    """'The answer is 4.' and 'the answer is 4' normalize equal; 'The answer is 5' does not."""
    a = run(step(0, "The answer is 4."))
    assert trajectory_divergence(a, run(step(0, "the answer is 4"))).kind is DivergenceKind.none
    s = trajectory_divergence(a, run(step(0, "The answer is 5")))
    assert (s.first_divergent_step, s.kind) == (0, DivergenceKind.content)
    assert s.tool_choice_disagreement_rate == 0.0 and s.tool_call_jaccard == 1.0  # no calls on either side


def test_termination_divergence():
    """B runs one turn longer with turns 0–1 equal → termination at turn 2 (rate over 2 turns).

    Same turns, different terminal reasons → termination at the last turn (1).
    """
    a = run(step(0, calls=[CALC_2_2]), step(1, calls=[CALC_2_2]), reason=TerminalReason.max_steps)
    b = run(step(0, calls=[CALC_2_2]), step(1, calls=[CALC_2_2]), step(2, "4"), answer="4")
    s = trajectory_divergence(a, b)
    assert (s.first_divergent_step, s.kind, s.steps_a, s.steps_b) == (2, DivergenceKind.termination, 2, 3)
    assert s.tool_choice_disagreement_rate == 0.0
    assert not s.final_answer_match_strict and not s.final_answer_match_soft  # None vs "4"
    c = run(step(0, calls=[CALC_2_2]), step(1, calls=[CALC_2_2]), reason=TerminalReason.length)
    assert (trajectory_divergence(a, c).first_divergent_step, trajectory_divergence(a, c).kind) == (
        1, DivergenceKind.termination)


@pytest.mark.parametrize("x,y,strict,soft", [
    ("391", "391", True, True),
    ("The answer is 391.", "the answer is 391", True, True),
    ("391", "The answer is 391.0", False, True),
    ("1,234", "1234", False, True),
    ("1000000", "1000000.5", False, True),   # |Δ| / 1e6 = 5e-7 ≤ 1e-6
    ("1000000", "1000002", False, False),    # 2e-6 > 1e-6
    ("Paris", "paris.", True, True),
    ("Paris", "Lyon", False, False),
    (None, None, True, True),
    (None, "4", False, False),
])
def test_final_answer_match(x, y, strict, soft):
    s = trajectory_divergence(run(step(0, "a"), answer=x), run(step(0, "a"), answer=y))
    assert (s.final_answer_match_strict, s.final_answer_match_soft) == (strict, soft)


def test_first_token_split():
    assert first_token_split([1, 2, 3], [1, 2, 4]) == 2
    assert first_token_split([1, 2], [1, 2, 3]) == 2
    assert first_token_split(np.array([5, 6], np.int32), [9]) == 0
    assert first_token_split([1, 2], [1, 2]) is None
    assert first_token_split([], []) is None
    assert first_token_split([], [1]) == 0


def test_divergence_report():
    a = run(step(0, calls=[CALC_2_2]), answer="4")
    b = run(step(0, calls=[call("web_search", {"query": "4"})]), answer="4")
    top = [DeltaToken(position=0, token_text="web", delta=-3.0, rollout_logprob=-0.1, trainer_logprob=-3.1)]
    report = divergence_report(trajectory_divergence(a, b), task_id="t", engine_a="fp32", engine_b="fp8",
                               sample_index=2, top_delta_tokens=top)
    assert (report.kind, report.first_divergent_step, report.sample_index) == (DivergenceKind.tool_choice, 0, 2)
    assert report.top_delta_tokens == top and report.split_turn is None
    assert report.final_answer_match_strict and report.tool_call_jaccard == 0.0


# --------------------------------------------------------------------------------------------
# bootstrap_interval
# --------------------------------------------------------------------------------------------


def test_bootstrap_is_deterministic_contains_the_mean_and_narrows_with_n():
    rng = np.random.default_rng(7)
    small, large = rng.normal(1.0, 1.0, 20), rng.normal(1.0, 1.0, 2000)
    first, again = bootstrap_interval(small, seed=3), bootstrap_interval(list(small), seed=3)
    assert first == again
    assert first.n == 20 and first.mean == pytest.approx(small.mean())
    assert first.lo < first.mean < first.hi
    wide = bootstrap_interval(small)
    narrow = bootstrap_interval(large)
    assert narrow.lo < narrow.mean < narrow.hi
    # The width of a mean's interval shrinks like 1/√n: 100× the data, about a tenth the width.
    assert (narrow.hi - narrow.lo) < 0.2 * (wide.hi - wide.lo)


def test_bootstrap_edge_cases():
    """No values: all None, n 0. None entries are skipped. One value, or equal values: lo = hi."""
    assert bootstrap_interval([]).model_dump() == {"mean": None, "lo": None, "hi": None, "n": 0}
    one = bootstrap_interval([None, 0.25, None])
    assert (one.mean, one.lo, one.hi, one.n) == (0.25, 0.25, 0.25, 1)
    same = bootstrap_interval([0.5] * 10)
    assert (same.mean, same.lo, same.hi, same.n) == (0.5, 0.5, 0.5, 10)
    median = bootstrap_interval([1.0, 2.0, 3.0, 4.0, 100.0], stat=np.median)
    assert median.mean == 3.0 and 1.0 <= median.lo <= median.hi <= 100.0
    with pytest.raises(ValueError):
        bootstrap_interval([1.0, math.nan])
    with pytest.raises(ValueError):
        bootstrap_interval([1.0, 2.0], confidence=1.0)


def test_bootstrap_of_many_values_draws_in_blocks():
    """n = 100,000 with 50 resamples: the index matrix is drawn a block of rows at a time."""
    values = np.random.default_rng(0).uniform(0.0, 1.0, 100_000)
    interval = bootstrap_interval(values, n_resamples=50)
    assert interval.lo < interval.mean < interval.hi
    assert interval.hi - interval.lo < 0.01


# --------------------------------------------------------------------------------------------
# Docs
# --------------------------------------------------------------------------------------------


def test_every_metric_and_divergence_kind_is_documented():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "observatory.md").read_text()
    names = [f.name for cls in (DenseSummary, RouterSummary, DivergenceSummary) for f in dataclasses.fields(cls)]
    names += [kind.value for kind in DivergenceKind]
    missing = [name for name in names if f"`{name}`" not in doc]
    assert not missing, f"missing from docs/observatory.md: {missing}"
