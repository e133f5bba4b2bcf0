"""verl's rollout-correction figures (`rollout_corr/*`), computed as verl computes them, in numpy.

One implementation for the gate's BudgetReport (`gate/budget.py`), the observatory and the
trainer's step metrics (`train/learner.py`, `train/corrections.py`). The definitions follow verl's
`verl/trainer/ppo/rollout_corr_helper.py` (`compute_is_metrics`, `compute_offpolicy_metrics`,
`compute_rollout_rejection_mask`); docs/metrics.md lists each with its formula.

Δ_t = logπ_trainer(y_t) − logπ_rollout(y_t) over the valid tokens (verl: old_log_prob −
rollout_log_prob), n of them, from m sequences with n_i tokens each. C is verl's
`rollout_is_threshold` (its default 2.0); verl's safety bound is 20 on every log ratio it exponentiates:

    rollout_is_eff_sample_size      w = clip(exp(clip(Δ, ±20)), 1/C, C) per token ("token" level) or
                                    W_i = clip(exp(clip(ΣΔ_i, ±20)), 1/C, C) on each of sequence i's
                                    tokens ("sequence"); 1 / mean_t((w_t / mean_t w)²) = mean(w)² / mean(w²)
    rollout_is_ratio_fraction_high  token: share of tokens with exp(clip(Δ, ±20)) > C;
                                    sequence: share of sequences with ΣΔ_i > log C
    rollout_is_ratio_fraction_low   the same below 1/C (ΣΔ_i < −log C)
    kl                              mean_t(−Δ)                          (k1 of KL(π_rollout ‖ π_trainer))
    k3_kl                           mean_t(exp(Δ) − Δ − 1)              (unclamped, as verl)
    chi2_token                      mean_t(exp(clip(Δ, ±20))²) − 1
    chi2_seq                        mean_i(exp(2·clip(ΣΔ_i, ±20))) − 1
    training_log_ppl, rollout_log_ppl   mean_i(−mean_{t∈i} logπ), per side
    training_ppl, rollout_ppl       mean_i(exp(−mean_{t∈i} logπ))
    log_ppl_diff (_abs_, _max, _min)    d_i = mean_{t∈i} logπ_rollout − mean_{t∈i} logπ_trainer;
                                    mean_i d_i (mean_i |d_i|, max_i, min_i)
    ppl_ratio                       mean_i exp(d_i)
    rollout_rs_seq_masked_fraction  share of sequences that lost at least one valid token to rejection

Where ours differs from verl, on purpose: verl divides by mask sums plus 1e-8 (negligible); a
sequence with no valid token (all tool output) is left out of the sequence-level figures, where
verl's batch rows always hold a response token (an empty row would count as weight 1 / ppl 1
there). A figure that overflows (exp(Δ) past float64: verl would log inf) or does not apply
(no tokens) is None. The token ESS the gate thresholds use, (Σw)²/(n·Σw²) with w = exp(clip(Δ, ±c))
and no [1/C, C] clip, is ours (`token_ess`, `observatory/dense.py`), not verl's.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import numpy as np

SAFETY_BOUND = 20.0
"""verl's bound on every log ratio it exponentiates (`SAFETY_BOUND` in rollout_corr_helper.py)."""
IS_THRESHOLD = 2.0
"""verl's default `rollout_is_threshold` C."""
_MAX_EXP = math.log(np.finfo(np.float64).max)

IsLevel = Literal["token", "sequence"]


@dataclass(frozen=True, slots=True)
class OffPolicyFigures:
    """verl's `rollout_corr/*` figures of one batch. None: no valid tokens, or not finite."""

    is_threshold: float
    """C (verl `rollout_is_threshold`)."""
    is_level: str
    """verl `rollout_is`: "token" or "sequence" (which weights the ESS and fractions are of)."""
    n_tokens: int
    n_sequences: int
    """Sequences with at least one valid token."""
    rollout_is_eff_sample_size: float | None
    rollout_is_ratio_fraction_high: float | None
    rollout_is_ratio_fraction_low: float | None
    kl: float | None
    k3_kl: float | None
    chi2_token: float | None
    chi2_seq: float | None
    training_ppl: float | None
    training_log_ppl: float | None
    rollout_ppl: float | None
    rollout_log_ppl: float | None
    log_ppl_diff: float | None
    log_ppl_abs_diff: float | None
    log_ppl_diff_max: float | None
    log_ppl_diff_min: float | None
    ppl_ratio: float | None

    def metrics(self, prefix: str = "rollout_corr/") -> dict[str, float | None]:
        """The figures under verl's names (with `prefix`), without the settings and counts."""
        skip = {"is_threshold", "is_level", "n_tokens", "n_sequences"}
        return {f"{prefix}{k}": v for k, v in asdict(self).items() if k not in skip}


FIGURE_NAMES = tuple(k for k in OffPolicyFigures.__dataclass_fields__
                     if k not in {"is_threshold", "is_level", "n_tokens", "n_sequences"})
"""The verl names `OffPolicyFigures.metrics` emits (without the `rollout_corr/` prefix)."""


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def check_threshold(is_threshold: float) -> None:
    """Raise ValueError unless C is a positive finite number."""
    if not (math.isfinite(is_threshold) and is_threshold > 0):
        raise ValueError(f"is_threshold (C) must be a positive finite number, got {is_threshold}")


def offpolicy_figures(
    rollout_logprobs_N,
    trainer_logprobs_N,
    lengths_S=None,
    *,
    is_threshold: float = IS_THRESHOLD,
    is_level: IsLevel = "token",
) -> OffPolicyFigures:
    """verl's figures over N valid tokens from consecutive sequences of `lengths_S` tokens each.

    `rollout_logprobs_N` and `trainer_logprobs_N` hold only valid tokens, sequence after sequence;
    `lengths_S` (non-negative integers summing to N) splits them; without it they are one sequence.
    Raises ValueError on shapes that differ, bad lengths, a bad C or level, or non-finite logprobs.
    """
    check_threshold(is_threshold)
    if is_level not in ("token", "sequence"):
        raise ValueError(f"is_level must be 'token' or 'sequence', got {is_level!r}")
    rollout_N = np.asarray(rollout_logprobs_N, dtype=np.float64)
    trainer_N = np.asarray(trainer_logprobs_N, dtype=np.float64)
    if rollout_N.ndim != 1 or rollout_N.shape != trainer_N.shape:
        raise ValueError(f"logprobs must be 1-D of one length: {rollout_N.shape} vs {trainer_N.shape}")
    n = rollout_N.shape[0]
    if lengths_S is None:
        lengths_S = np.array([n], dtype=np.int64)
    lengths_S = np.asarray(lengths_S)
    if lengths_S.ndim != 1 or (lengths_S.size and lengths_S.dtype.kind not in "iu") or (lengths_S < 0).any():
        raise ValueError("lengths must be a 1-D array of non-negative integers")
    lengths_S = lengths_S.astype(np.int64)
    if int(lengths_S.sum()) != n:
        raise ValueError(f"lengths sum to {int(lengths_S.sum())} but there are {n} tokens")
    if not (np.isfinite(rollout_N).all() and np.isfinite(trainer_N).all()):
        raise ValueError("logprobs hold NaN or infinite values")
    lengths_S = lengths_S[lengths_S > 0]
    m = int(lengths_S.shape[0])
    if n == 0:
        return OffPolicyFigures(is_threshold, is_level, 0, 0, *([None] * len(FIGURE_NAMES)))

    delta_N = trainer_N - rollout_N
    starts_S = np.cumsum(lengths_S) - lengths_S
    sum_S = np.add.reduceat(delta_N, starts_S)
    upper, lower = float(is_threshold), 1.0 / float(is_threshold)

    # IS weights (before verl's truncation), their [1/C, C] clip for the ESS, and the fractions.
    if is_level == "token":
        w_N = np.exp(np.clip(delta_N, -SAFETY_BOUND, SAFETY_BOUND))
        high = float(np.mean(w_N > upper))
        low = float(np.mean(w_N < lower))
        clipped_N = np.minimum(np.maximum(w_N, lower), upper)  # torch.clamp(min, max) order
        mean_w = float(clipped_N.mean())
        mean_w2 = float(np.mean(clipped_N * clipped_N))
    else:
        w_S = np.exp(np.clip(sum_S, -SAFETY_BOUND, SAFETY_BOUND))
        high = float(np.mean(sum_S > math.log(upper)))
        low = float(np.mean(sum_S < math.log(lower)))
        clipped_S = np.minimum(np.maximum(w_S, lower), upper)
        # Each sequence's weight sits on each of its tokens: token-weighted means.
        mean_w = float(np.dot(lengths_S, clipped_S) / n)
        mean_w2 = float(np.dot(lengths_S, clipped_S * clipped_S) / n)
    ess = mean_w * mean_w / mean_w2

    # k3 = exp(Δ) − Δ − 1, unclamped as verl's; expm1 keeps it exact near Δ = 0.
    k3 = None if delta_N.max() > _MAX_EXP else float(np.mean(np.expm1(delta_N) - delta_N))
    rho2_N = np.exp(2.0 * np.clip(delta_N, -SAFETY_BOUND, SAFETY_BOUND))
    chi2_token = float(rho2_N.mean()) - 1.0
    chi2_seq = float(np.mean(np.exp(2.0 * np.clip(sum_S, -SAFETY_BOUND, SAFETY_BOUND)))) - 1.0

    mean_lp_train_S = np.add.reduceat(trainer_N, starts_S) / lengths_S
    mean_lp_roll_S = np.add.reduceat(rollout_N, starts_S) / lengths_S
    diff_S = mean_lp_roll_S - mean_lp_train_S
    with np.errstate(over="ignore"):
        training_ppl = _finite(float(np.mean(np.exp(-mean_lp_train_S))))
        rollout_ppl = _finite(float(np.mean(np.exp(-mean_lp_roll_S))))
        ppl_ratio = _finite(float(np.mean(np.exp(diff_S))))
    return OffPolicyFigures(
        is_threshold=float(is_threshold), is_level=is_level, n_tokens=n, n_sequences=m,
        rollout_is_eff_sample_size=ess,
        rollout_is_ratio_fraction_high=high,
        rollout_is_ratio_fraction_low=low,
        kl=float(np.mean(-delta_N)),
        k3_kl=k3,
        chi2_token=chi2_token,
        chi2_seq=chi2_seq,
        training_ppl=training_ppl,
        training_log_ppl=float(np.mean(-mean_lp_train_S)),
        rollout_ppl=rollout_ppl,
        rollout_log_ppl=float(np.mean(-mean_lp_roll_S)),
        log_ppl_diff=float(diff_S.mean()),
        log_ppl_abs_diff=float(np.abs(diff_S).mean()),
        log_ppl_diff_max=float(diff_S.max()),
        log_ppl_diff_min=float(diff_S.min()),
        ppl_ratio=ppl_ratio,
    )


def flatten_padded(values_BT, mask_BT) -> tuple[np.ndarray, np.ndarray]:
    """(values of the valid tokens row after row [N], valid tokens per row [B]) from padded [B, T]."""
    values_BT = np.asarray(values_BT)
    mask_BT = np.asarray(mask_BT, dtype=bool)
    if values_BT.ndim != 2 or values_BT.shape != mask_BT.shape:
        raise ValueError(f"values and mask must both be [B, T]; got {values_BT.shape} and {mask_BT.shape}")
    return values_BT[mask_BT], mask_BT.sum(axis=1).astype(np.int64)


def rs_seq_masked_fraction(valid_BT, kept_BT) -> float | None:
    """verl `rollout_rs_seq_masked_fraction`: share of sequences (with a valid token) that lost at
    least one valid token to rejection, whichever bound dropped it. None without such sequences."""
    valid_BT = np.asarray(valid_BT, dtype=bool)
    kept_BT = np.asarray(kept_BT, dtype=bool)
    if valid_BT.ndim != 2 or valid_BT.shape != kept_BT.shape:
        raise ValueError(f"valid and kept masks must both be [B, T]; got {valid_BT.shape} and {kept_BT.shape}")
    has_tokens_B = valid_BT.any(axis=1)
    if not has_tokens_B.any():
        return None
    lost_B = (valid_BT & ~kept_BT).any(axis=1)
    return float(lost_B[has_tokens_B].mean())
