"""The off-policy budget of one group: how far its behaviour logprobs sit from the trainer's."""

from __future__ import annotations

from pydantic import Field

from .base import Record
from .limits import Count, Key, Version


class BudgetReport(Record):
    """Mismatch statistics of one group (formulas in DESIGN.md, 'Formulas').

    Δ_t = logπ_trainer − logπ_rollout over valid tokens (action and not tool output).
    """

    group_id: Key
    n_tokens: Count = Field(description="Valid tokens the statistics cover.")
    n_sequences: Count
    clamp: float = Field(description="c in w_t = exp(clip(Δ_t, −c, c)).")
    token_ess: float = Field(description="(Σw)² / (n Σw²) over tokens, in (0, 1].")
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
