"""The off-policy budget of one group: how far its behaviour logprobs sit from the trainer's."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Record
from .limits import Count, Key, Version


class RolloutCorrFigures(Record):
    """verl's `rollout_corr/*` figures of one group, under verl's names and as verl computes them
    (`rollmarket.observatory.offpolicy`; formulas in docs/metrics.md). None: not finite."""

    is_threshold: float = Field(description="C, verl's rollout_is_threshold: IS weights clipped to [1/C, C].")
    is_level: Literal["token", "sequence"] = Field(description="verl's rollout_is: which weights the ESS is of.")
    rollout_is_eff_sample_size: float | None = Field(
        default=None, description="mean(w)² / mean(w²) of the weights clipped to [1/C, C].")
    rollout_is_ratio_fraction_high: float | None = Field(default=None, description="Share of weights above C.")
    rollout_is_ratio_fraction_low: float | None = Field(default=None, description="Share of weights below 1/C.")
    kl: float | None = Field(default=None, description="mean(logπ_rollout − logπ_trainer).")
    k3_kl: float | None = Field(default=None, description="mean(exp(Δ) − Δ − 1), unclamped.")
    chi2_token: float | None = Field(default=None, description="mean(exp(clip(Δ, ±20))²) − 1.")
    chi2_seq: float | None = Field(default=None, description="mean over sequences of exp(2·clip(ΣΔ, ±20)) − 1.")
    training_ppl: float | None = None
    training_log_ppl: float | None = None
    rollout_ppl: float | None = None
    rollout_log_ppl: float | None = None
    log_ppl_diff: float | None = Field(
        default=None, description="mean over sequences of mean logπ_rollout − mean logπ_trainer.")
    log_ppl_abs_diff: float | None = None
    log_ppl_diff_max: float | None = None
    log_ppl_diff_min: float | None = None
    ppl_ratio: float | None = None


class BudgetReport(Record):
    """Mismatch statistics of one group (formulas in DESIGN.md, 'Formulas').

    Δ_t = logπ_trainer − logπ_rollout over valid tokens (action and not tool output).
    """

    group_id: Key
    n_tokens: Count = Field(description="Valid tokens the statistics cover.")
    n_sequences: Count
    clamp: float = Field(description="c in w_t = exp(clip(Δ_t, −c, c)).")
    token_ess: float = Field(description="(Σw)² / (n Σw²) over tokens, in (0, 1]; ours, not verl's "
                                         "rollout_is_eff_sample_size (that is rollout_corr's).")
    sequence_ess: float = Field(description="The same over per-sequence weights exp(clip(ΣΔ)).")
    mean_delta: float
    mean_abs_delta: float
    max_abs_delta: float = Field(description="Unclipped.")
    clipped_fraction: float = Field(description="Share of tokens with |Δ| > clamp.")
    veto_fraction: float = Field(description="Share of tokens with |Δ| > the veto threshold.")
    second_moment: float = Field(description="mean(w²).")
    top1pct_mass: float = Field(description="Share of Σw held by the largest 1% of weights.")
    kl_k1: float = Field(description="mean(logπ_rollout − logπ_trainer).")
    kl_k3: float = Field(description="mean(r − log r − 1), r = exp(Δ).")
    chi2: float = Field(description="mean(r²) − 1.")
    mean_prob_diff: float = Field(description="mean |p_rollout − p_trainer|.")
    router_flip_rate: float | None = Field(
        default=None, description="Share of (token, MoE layer) positions whose top-1 expert differs."
    )
    policy_lag_steps: Version = 0
    rollout_corr: RolloutCorrFigures | None = Field(
        default=None, description="verl's rollout_corr figures of the group (None from older reporters).")
