"""Token transforms: spread each completion's advantage over its tokens.

Modes (the ablation of the research guide: grpo+none, maxrl+none, maxrl+gtpo, maxrl+gtpo_hicra,
maxrl+gtpo_sepa):

- ``none``: every valid token gets its completion's advantage A_i.
- ``gtpo``: entropy-weighted credit (GTPO, Tan et al. 2025). Within a completion, with h_t the
  token's entropy (capped at ``max_entropy``) and h̄ its mean over the completion's valid tokens,
  w_t = max(0, 1 + β·(h_t / h̄ − 1)) and A_t = A_i · w_t. Uniform (w = 1) when β = 0 or h̄ < 1e-7.
- ``gtpo_hicra``: GTPO, then HICRA's planning-token amplification A_t ← A_t + α·|A_t| on planning
  tokens (positive credit grows by 1 + α, blame shrinks by 1 − α).
- ``gtpo_sepa``: SEPA's selective entropy pooling, then GTPO. Within a completion the execution
  (non-planning) tokens' entropies are pulled toward their mean, h_t ← λ·h̄_exec + (1 − λ)·h_t;
  planning tokens keep theirs. λ ∈ [0, 1] comes from ``SepaSchedule``.

Sources: the research guide names these modes and their metrics but gives no formulas; the
formulas follow the public retrain/textpolicy implementations the guide documents (its
``apply_gtpo_weighting``, ``apply_hicra``, ``apply_sepa_pooling`` and ``SEPAController``), with
their defaults β = 0.1, α = 0.2 and an entropy cap of 50. One deliberate difference: retrain
defaults to the sampled token's surprisal (−log p); we use the trainer's own per-token Shannon
entropy of its next-token distribution (``token_entropy``), computed in the trainer's forward pass,
never the rollout engine's. Planning tokens arrive as a mask; train/planning.py finds them (the
strategic grams retrain matches, such as "wait let me").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

TRANSFORM_MODES = ("none", "gtpo", "gtpo_hicra", "gtpo_sepa")
TransformMode = Literal["none", "gtpo", "gtpo_hicra", "gtpo_sepa"]


@dataclass(frozen=True)
class TransformConfig:
    """Which token transform to apply and its coefficients."""

    mode: TransformMode = "none"
    """The transform; see the module docstring."""
    gtpo_beta: float = 0.1
    """β: how strongly entropy reweights credit within a completion (0 = uniform)."""
    hicra_alpha: float = 0.2
    """α: HICRA's planning-token amplification (0 = off)."""
    max_entropy: float = 50.0
    """Entropies are capped here before any arithmetic, so one inf cannot poison a completion."""

    def __post_init__(self) -> None:
        if self.mode not in TRANSFORM_MODES:
            raise ValueError(f"unknown transform mode {self.mode!r}; expected one of {TRANSFORM_MODES}")
        if self.gtpo_beta < 0 or self.hicra_alpha < 0 or self.max_entropy <= 0:
            raise ValueError("need gtpo_beta >= 0, hicra_alpha >= 0 and max_entropy > 0")

    @property
    def needs_planning(self) -> bool:
        return self.mode in ("gtpo_hicra", "gtpo_sepa")


@dataclass
class SepaSchedule:
    """SEPA's pooling strength λ over training, behind a sticky correctness gate.

    λ ramps linearly from 0 to 1 over ``steps`` steps after ``delay_steps``:
    λ(step) = clip((step − delay_steps) / steps, 0, 1); ``steps`` = 0 keeps λ at 0. While the gate is
    closed λ is 0; the gate opens (for good) the first time an observed correct rate reaches
    ``correct_rate_gate`` (a gate of 0 starts open). retrain's adaptive "auto" schedule (λ from the
    decay of execution-entropy variance) is not implemented here.
    """

    steps: int = 0
    """Length of the linear ramp in optimiser steps."""
    delay_steps: int = 0
    """Steps before the ramp starts."""
    correct_rate_gate: float = 0.0
    """Correct rate that opens the gate; 0 = open from the start."""
    gate_open: bool = field(default=False, init=False)
    """Whether the gate has opened. Save it with the checkpoint."""

    def __post_init__(self) -> None:
        if self.steps < 0 or self.delay_steps < 0 or not 0 <= self.correct_rate_gate <= 1:
            raise ValueError("need steps >= 0, delay_steps >= 0 and 0 <= correct_rate_gate <= 1")
        self.gate_open = self.correct_rate_gate <= 0

    def observe_correct_rate(self, correct_rate: float) -> None:
        """Open the gate once ``correct_rate`` reaches the threshold; it never closes again."""
        if math.isfinite(correct_rate) and correct_rate >= self.correct_rate_gate:
            self.gate_open = True

    def lambda_at(self, step: int) -> float:
        if not self.gate_open or self.steps <= 0:
            return 0.0
        return min(max((step - self.delay_steps) / self.steps, 0.0), 1.0)

    def metrics(self, step: int) -> dict[str, float]:
        """``sepa_lambda`` and ``sepa_gate_open`` (1.0 / 0.0), the research guide's names."""
        return {"sepa_lambda": self.lambda_at(step), "sepa_gate_open": float(self.gate_open)}


def token_entropy(logits_BTV: torch.Tensor) -> torch.Tensor:
    """The trainer's per-token Shannon entropy −Σ_v p_v log p_v, detached, [B, T]."""
    logp_BTV = torch.log_softmax(logits_BTV.detach().float(), dim=-1)
    return -(logp_BTV.exp() * logp_BTV).sum(dim=-1)


def _masked_mean(x_BT: torch.Tensor, m_BT: torch.Tensor) -> torch.Tensor:
    return (x_BT * m_BT).sum(dim=1) / m_BT.sum(dim=1).clamp(min=1)


def _stats(h_BT: torch.Tensor, m_BT: torch.Tensor, prefix: str) -> dict[str, float | None]:
    n = m_BT.sum()
    if n == 0:  # no such token: the figure does not exist (null), it is not 0
        return {f"{prefix}_entropy_mean": None, f"{prefix}_entropy_var": None}
    mean = (h_BT * m_BT).sum() / n
    var = (((h_BT - mean) ** 2) * m_BT).sum() / n  # population variance, like retrain
    return {f"{prefix}_entropy_mean": float(mean), f"{prefix}_entropy_var": float(var)}


def entropy_metrics(
    entropies_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    planning_mask_BT: torch.Tensor | None,
    max_entropy: float = TransformConfig.max_entropy,
) -> dict[str, float | None]:
    """``exec_entropy_mean/var`` and ``plan_entropy_mean/var`` over valid tokens (entropies capped at
    ``max_entropy``, population variance) and ``plan_token_fraction`` (planning share of valid tokens).

    Without a planning mask (no detector) the plan figures are None and every valid token counts as
    execution; a step whose mask marks no token also has None plan figures."""
    m_BT = mask_BT.bool().float()
    plan_BT = torch.zeros_like(m_BT) if planning_mask_BT is None else planning_mask_BT.bool().float() * m_BT
    h_BT = torch.where(m_BT.bool(), entropies_BT.detach().float(), torch.zeros(())).clamp(0, max_entropy)
    metrics = {**_stats(h_BT, m_BT - plan_BT, "exec"), **_stats(h_BT, plan_BT, "plan")}
    n = m_BT.sum()
    metrics["plan_token_fraction"] = None if planning_mask_BT is None or n == 0 else float(plan_BT.sum() / n)
    return metrics


def token_advantages(
    advantages_B: torch.Tensor,
    entropies_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    config: TransformConfig = TransformConfig(),
    *,
    planning_mask_BT: torch.Tensor | None = None,
    sepa_lambda: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float | None]]:
    """Per-token advantages ``advantages_BT`` (0 on padding, detached) and entropy metrics.

    ``advantages_B`` holds one advantage per completion (train/advantages.py); ``entropies_BT``
    the trainer's own per-token entropies (``token_entropy``). Modes gtpo_hicra and gtpo_sepa need
    ``planning_mask_BT`` (1 = planning token). Metrics, over valid tokens and before SEPA pooling:
    ``entropy_metrics`` (with no planning mask every token counts as execution and the plan figures
    are None).
    """
    B, T = mask_BT.shape
    if advantages_B.shape != (B,) or entropies_BT.shape != (B, T):
        raise ValueError(
            f"expected advantages_B [{B}] and entropies_BT [{B}, {T}], got "
            f"{tuple(advantages_B.shape)} and {tuple(entropies_BT.shape)}"
        )
    if config.needs_planning and planning_mask_BT is None:
        raise ValueError(f"transform mode {config.mode!r} needs planning_mask_BT")
    if planning_mask_BT is not None and planning_mask_BT.shape != (B, T):
        raise ValueError(f"planning_mask_BT must be [{B}, {T}], got {tuple(planning_mask_BT.shape)}")

    m_BT = mask_BT.bool().float()
    plan_BT = torch.zeros_like(m_BT) if planning_mask_BT is None else planning_mask_BT.bool().float() * m_BT
    exec_BT = m_BT - plan_BT
    adv_B = advantages_B.detach().float()
    h_BT = torch.where(m_BT.bool(), entropies_BT.detach().float(), torch.zeros(()))
    h_BT = h_BT.clamp(0, config.max_entropy)
    metrics = entropy_metrics(entropies_BT, mask_BT, planning_mask_BT, config.max_entropy)

    if config.mode == "none":
        return adv_B[:, None] * m_BT, metrics

    if config.mode == "gtpo_sepa":
        lam = min(max(float(sepa_lambda), 0.0), 1.0)
        exec_mean_B = _masked_mean(h_BT, exec_BT)
        h_BT = torch.where(exec_BT.bool(), lam * exec_mean_B[:, None] + (1 - lam) * h_BT, h_BT)

    beta = config.gtpo_beta
    mean_h_B = _masked_mean(h_BT, m_BT)
    weights_BT = (1 + beta * (h_BT / (mean_h_B[:, None] + 1e-8) - 1)).clamp(min=0)
    uniform_B = (mean_h_B < 1e-7) | (beta == 0)
    weights_BT = torch.where(uniform_B[:, None], torch.ones_like(weights_BT), weights_BT)
    token_adv_BT = adv_B[:, None] * weights_BT * m_BT

    if config.mode == "gtpo_hicra":
        token_adv_BT = token_adv_BT + config.hicra_alpha * token_adv_BT.abs() * plan_BT
    return token_adv_BT, metrics
