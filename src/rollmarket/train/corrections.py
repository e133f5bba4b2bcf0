"""Off-policy corrections between the rollout engine and the trainer.

The rollout engine sampled each token under its own numerics (the *behaviour* policy) and captured
its log-probabilities; the trainer recomputes them at the start of the step (*old*, before any
update). Per valid token

    Δ_t = old_logprob_t − behaviour_logprob_t        (``log_ratio_BT``)

and the functions here turn Δ into per-token weights that multiply the policy loss (losses.py,
``is_weights_BT``) or into a mask that drops tokens and sequences too far off-policy. All outputs
are detached: a correction is a constant of the step, never a path for gradients.

Sources: token- and sequence-level truncated IS (TIS) follow Yao et al., "Your efficient RL
framework secretly brings you off-policy RL training" (2025) and verl's rollout correction;
masked IS (MIS) follows Liu et al., "When speed kills stability" (2025) and verl's rejection
sampling (``rollout_rs``). Metric names are verl-style under ``rollout_corr/``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..observatory.offpolicy import rs_seq_masked_fraction

# Δ is clamped before exp so one wild token cannot overflow; DESIGN.md's observatory clamp.
LOG_CLAMP = 20.0


@dataclass(frozen=True)
class Correction:
    """The result of an off-policy correction for a batch of B sequences of T token slots."""

    weights_BT: torch.Tensor
    """Per-token IS weight (float, detached). 0 where ``mask_BT`` is 0."""
    mask_BT: torch.Tensor
    """The mask to train with: the input mask, less what the correction dropped (bool)."""
    metrics: dict[str, float | None]
    """``rollout_corr/...`` scalars over the valid tokens (or sequences) of the input mask."""


def _prepare(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if log_ratio_BT.ndim != 2 or log_ratio_BT.shape != mask_BT.shape:
        raise ValueError(
            f"log_ratio_BT and mask_BT must both be [B, T]; got {tuple(log_ratio_BT.shape)} "
            f"and {tuple(mask_BT.shape)}"
        )
    mask_BT = mask_BT.bool()
    delta_BT = torch.where(mask_BT, log_ratio_BT.detach().float(), torch.zeros((), dtype=torch.float32))
    return delta_BT, mask_BT


def _check_cap(cap: float) -> None:
    if not cap > 0:
        raise ValueError(f"cap must be positive, got {cap}")


def _token_mean(x_BT: torch.Tensor, mask_BT: torch.Tensor) -> float:
    n = int(mask_BT.sum())
    return float((x_BT * mask_BT).sum() / n) if n else 0.0


def token_tis(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor, cap: float) -> Correction:
    """Token-level truncated IS: w_t = min(exp(Δ_t), C).

    Metrics: ``rollout_corr/rollout_is_mean`` (mean w over valid tokens),
    ``rollout_corr/rollout_is_capped_fraction`` (share of valid tokens with exp(Δ_t) > C).
    """
    _check_cap(cap)
    delta_BT, mask_BT = _prepare(log_ratio_BT, mask_BT)
    ratio_BT = delta_BT.clamp(-LOG_CLAMP, LOG_CLAMP).exp()
    weights_BT = ratio_BT.clamp(max=cap) * mask_BT
    capped_BT = (ratio_BT > cap) & mask_BT
    metrics = {
        "rollout_corr/rollout_is_mean": _token_mean(weights_BT, mask_BT),
        "rollout_corr/rollout_is_capped_fraction": _token_mean(capped_BT.float(), mask_BT),
    }
    return Correction(weights_BT, mask_BT, metrics)


def sequence_tis(log_ratio_BT: torch.Tensor, mask_BT: torch.Tensor, cap: float) -> Correction:
    """Sequence-level truncated IS: W_i = min(exp(Σ_t Δ_{i,t}), C), broadcast to the sequence's tokens.

    Metrics are per sequence (sequences with at least one valid token):
    ``rollout_corr/rollout_is_seq_mean`` and ``rollout_corr/rollout_is_seq_capped_fraction``.
    """
    _check_cap(cap)
    delta_BT, mask_BT = _prepare(log_ratio_BT, mask_BT)
    ratio_B = delta_BT.sum(dim=1).clamp(-LOG_CLAMP, LOG_CLAMP).exp()
    weights_B = ratio_B.clamp(max=cap)
    weights_BT = weights_B[:, None] * mask_BT
    has_tokens_B = mask_BT.any(dim=1)
    n_seq = int(has_tokens_B.sum())
    metrics = {
        "rollout_corr/rollout_is_seq_mean": float(weights_B[has_tokens_B].sum() / n_seq) if n_seq else 0.0,
        "rollout_corr/rollout_is_seq_capped_fraction": (
            float(((ratio_B > cap) & has_tokens_B).sum() / n_seq) if n_seq else 0.0
        ),
    }
    return Correction(weights_BT, mask_BT, metrics)


def _outside(log_value: torch.Tensor, bounds: tuple[float, float]) -> torch.Tensor:
    lo, hi = bounds
    if not 0 < lo <= hi:
        raise ValueError(f"bounds must satisfy 0 < lo <= hi, got {bounds}")
    # Compare in log space: exp of a long sequence's ΣΔ would overflow.
    return (log_value < math.log(lo)) | (log_value > math.log(hi))


def masked_is(
    log_ratio_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    token_bounds: tuple[float, float] | None = None,
    sequence_bounds: tuple[float, float] | None = None,
    geo_mean_bounds: tuple[float, float] | None = None,
) -> Correction:
    """Masked IS: drop what lies outside the bounds, keep the rest at weight 1.

    Bounds are inclusive, on ratios (not logs):
    - token: a token with exp(Δ_t) outside [lo, hi] is dropped (only that token);
    - sequence: a sequence with exp(Σ_t Δ_t) outside [lo, hi] is dropped whole;
    - geometric mean: a sequence with exp(mean_t Δ_t) outside [lo, hi] is dropped whole
      (length-independent, unlike the sequence ratio).

    Decision: kept tokens get weight 1, not their raw ratio, so this is pure rejection and
    composes with the TIS functions: for Liu et al.'s ratio-weighted MIS, multiply
    ``token_tis(...).weights_BT`` (cap = hi) by this mask.

    Metrics: ``rollout_corr/rollout_rs_masked_fraction`` (share of the input's valid tokens
    dropped, for any reason), ``rollout_corr/rollout_rs_token_masked_fraction`` (tokens dropped by
    the token bound), ``rollout_corr/rollout_rs_seq_masked_fraction`` (verl's: sequences that lost at
    least one valid token, to any bound) and ``rollout_corr/rollout_rs_seq_dropped_fraction`` (ours:
    sequences dropped whole by the sequence or geometric-mean bound), both over sequences with
    valid tokens.
    """
    delta_BT, mask_BT = _prepare(log_ratio_BT, mask_BT)
    n_tokens_B = mask_BT.sum(dim=1)
    has_tokens_B = n_tokens_B > 0

    token_out_BT = torch.zeros_like(mask_BT)
    if token_bounds is not None:
        token_out_BT = _outside(delta_BT, token_bounds) & mask_BT
    seq_out_B = torch.zeros_like(has_tokens_B)
    sum_B = delta_BT.sum(dim=1)
    if sequence_bounds is not None:
        seq_out_B |= _outside(sum_B, sequence_bounds) & has_tokens_B
    if geo_mean_bounds is not None:
        mean_B = sum_B / n_tokens_B.clamp(min=1)
        seq_out_B |= _outside(mean_B, geo_mean_bounds) & has_tokens_B

    kept_BT = mask_BT & ~token_out_BT & ~seq_out_B[:, None]
    n_valid = int(mask_BT.sum())
    n_seq = int(has_tokens_B.sum())
    metrics = {
        "rollout_corr/rollout_rs_masked_fraction": (
            float((mask_BT & ~kept_BT).sum() / n_valid) if n_valid else 0.0
        ),
        "rollout_corr/rollout_rs_token_masked_fraction": (
            float(token_out_BT.sum() / n_valid) if n_valid else 0.0
        ),
        "rollout_corr/rollout_rs_seq_masked_fraction": rs_seq_masked_fraction(mask_BT.cpu().numpy(), kept_BT.cpu().numpy()),
        "rollout_corr/rollout_rs_seq_dropped_fraction": float(seq_out_B.sum() / n_seq) if n_seq else None,
    }
    return Correction(kept_BT.float(), kept_BT, metrics)
