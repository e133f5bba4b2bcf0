"""MoE routing mismatch: did the two engines send the same token to the same experts?

Inputs are int arrays [T, L, K] (token, MoE layer, the k chosen experts ordered by routing
weight, so [..., 0] is the top-1 expert):

    router_flip_rate                share of (token, layer) whose top-1 expert differs
    token_expert_disagreement_rate  share of tokens whose top-k expert set differs at any layer
    per_layer_flip_rate             the flip rate of each layer; worst_layer is its argmax
    topk_overlap                    mean |A∩B| / k over (token, layer)

This is the one implementation: the gate's router flip rate (`gate/budget.py`) uses `top1_differs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..contracts import RouterMismatchReport


@dataclass(frozen=True, slots=True)
class RouterSummary:
    """Routing agreement over the valid tokens of one trajectory (rates None when there are none)."""

    n_tokens: int
    num_layers: int
    top_k: int
    router_flip_rate: float | None
    token_expert_disagreement_rate: float | None
    per_layer_flip_rate: tuple[float, ...]
    """One rate per layer; empty when there are no tokens."""
    worst_layer: int | None
    """The layer with the highest flip rate (the first of equals)."""
    worst_layer_flip_rate: float | None
    topk_overlap: float | None


def top1_differs(rollout_experts_TLK, trainer_experts_TLK) -> np.ndarray:
    """bool [T, L]: where the top-1 experts differ. T and L must match; K may differ."""
    rollout_TLK, trainer_TLK = np.asarray(rollout_experts_TLK), np.asarray(trainer_experts_TLK)
    if rollout_TLK.ndim != 3 or trainer_TLK.ndim != 3 or rollout_TLK.shape[:2] != trainer_TLK.shape[:2]:
        raise ValueError(f"routed expert shapes differ: {rollout_TLK.shape} vs {trainer_TLK.shape}")
    return rollout_TLK[:, :, 0] != trainer_TLK[:, :, 0]


def router_summary(rollout_experts_TLK, trainer_experts_TLK, mask=None) -> RouterSummary:
    """Routing agreement of two engines over the tokens where `mask` (bool [T]) is True.

    Raises ValueError unless both arrays are integer [T, L, K] of one shape.
    """
    rollout_TLK, trainer_TLK = np.asarray(rollout_experts_TLK), np.asarray(trainer_experts_TLK)
    if rollout_TLK.ndim != 3 or rollout_TLK.shape != trainer_TLK.shape:
        raise ValueError(f"routed experts must be [T, L, K] of one shape: {rollout_TLK.shape} vs "
                         f"{trainer_TLK.shape}")
    if rollout_TLK.dtype.kind not in "iu" or trainer_TLK.dtype.kind not in "iu":
        raise ValueError(f"routed experts must be integers: {rollout_TLK.dtype}, {trainer_TLK.dtype}")
    if mask is not None:
        mask_T = np.asarray(mask, dtype=bool)
        if mask_T.shape != rollout_TLK.shape[:1]:
            raise ValueError(f"mask shape {mask_T.shape} does not match {rollout_TLK.shape[0]} tokens")
        rollout_TLK, trainer_TLK = rollout_TLK[mask_T], trainer_TLK[mask_T]
    n, num_layers, k = rollout_TLK.shape
    if n == 0 or num_layers == 0 or k == 0:
        return RouterSummary(n, num_layers, k, None, None, (), None, None, None)

    flips_TL = top1_differs(rollout_TLK, trainer_TLK)
    per_layer_L = flips_TL.mean(axis=0)
    worst = int(np.argmax(per_layer_L))
    set_differs_TL = (np.sort(rollout_TLK, axis=-1) != np.sort(trainer_TLK, axis=-1)).any(axis=-1)
    # |A∩B|: the rollout's experts that appear among the trainer's, one rollout choice at a time so
    # the temporaries stay [T, L, K] rather than [T, L, K, K].
    shared_TL = np.zeros(flips_TL.shape, dtype=np.int64)
    for choice in range(k):
        shared_TL += (rollout_TLK[:, :, choice, None] == trainer_TLK).any(axis=-1)
    return RouterSummary(
        n_tokens=n,
        num_layers=num_layers,
        top_k=k,
        router_flip_rate=float(flips_TL.mean()),
        token_expert_disagreement_rate=float(set_differs_TL.any(axis=1).mean()),
        per_layer_flip_rate=tuple(float(x) for x in per_layer_L),
        worst_layer=worst,
        worst_layer_flip_rate=float(per_layer_L[worst]),
        topk_overlap=float(shared_TL.mean() / k),
    )


def to_report(summary: RouterSummary, *, trajectory_id: str, rollout_engine: str,
              trainer_engine: str) -> RouterMismatchReport:
    """The RouterMismatchReport of one trajectory from its summary."""
    s = summary
    return RouterMismatchReport(
        trajectory_id=trajectory_id, rollout_engine=rollout_engine, trainer_engine=trainer_engine,
        n_tokens=s.n_tokens, num_layers=s.num_layers, top_k=s.top_k,
        router_flip_rate=s.router_flip_rate,
        token_expert_disagreement_rate=s.token_expert_disagreement_rate,
        per_layer_flip_rate=list(s.per_layer_flip_rate), worst_layer=s.worst_layer,
        worst_layer_flip_rate=s.worst_layer_flip_rate, topk_overlap=s.topk_overlap,
    )
