"""Policy-gradient losses over a batch of B sequences of T token slots.

Per valid token t (``mask_BT`` = 1), with ratio_t = exp(lp_t − old_t), advantage A_t and the
off-policy weight w_t (corrections.py; 1 when none is given), the per-token loss is

    ppo_clip   L_t = −w_t · min(ratio_t · A_t, clip(ratio_t, 1 − ε_low, 1 + ε_high) · A_t)   (DAPO)
    cispo      L_t = −w_t · sg(min(ratio_t, cap)) · A_t · lp_t                      (MiniMax-M1)
    reinforce  L_t = −sg(w_t) · A_t · lp_t

plus kl_coef · KL_t to a reference policy when one is given (``kl_to_ref``), and the batch loss
aggregates L_t as ``LossConfig.aggregation`` says (verl's ``loss_agg_mode`` names). ``sg`` is
stop-gradient. Sources and metric names: docs/training.md, "Algorithms".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

LOSS_KINDS = ("ppo_clip", "cispo", "reinforce")
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
"""verl's ``loss_agg_mode`` names (verl/trainer/ppo/core_algos.py, ``agg_loss``)."""
RENAMED_AGGREGATIONS = {"token_mean": "token-mean", "seq_mean_token_sum": "seq-mean-token-sum-norm",
                        "seq_mean_token_mean": "seq-mean-token-mean"}
"""Our old names → verl's. The old ``seq_mean_token_sum`` divided by a constant: that is verl's
``seq-mean-token-sum-norm``; verl's ``seq-mean-token-sum`` (no length normaliser) is new."""
KL_KINDS = ("k1", "k2", "k3", "low_var_kl")
LOW_VAR_KL_LOG_RATIO_CLAMP = 20.0
"""low_var_kl clamps log(π_ref/π) to ±20 before exp (verl's ``kl_penalty_forward``)."""
LOW_VAR_KL_VALUE_CLAMP = 10.0
"""low_var_kl clamps the estimate to ±10 (verl's ``kl_penalty_forward``)."""


def aggregation_error(name: str) -> str | None:
    """Why ``name`` is not an aggregation (naming the new name of an old one), or None when it is one."""
    if name in AGGREGATIONS:
        return None
    if name in RENAMED_AGGREGATIONS:
        return (f"aggregation {name!r} was renamed {RENAMED_AGGREGATIONS[name]!r} (verl's loss_agg_mode names); "
                f"write {RENAMED_AGGREGATIONS[name]!r}")
    return f"unknown aggregation {name!r}; expected one of {AGGREGATIONS}"


LossKind = Literal["ppo_clip", "cispo", "reinforce"]
Aggregation = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


@dataclass(frozen=True)
class LossConfig:
    """How the policy loss is formed and reduced. Defaults are DAPO's clip range."""

    kind: LossKind = "ppo_clip"
    """The policy-gradient estimator."""
    clip_low: float = 0.2
    """ε_low: ppo_clip clips the ratio below at 1 − clip_low."""
    clip_high: float = 0.28
    """ε_high: ppo_clip clips the ratio above at 1 + clip_high (DAPO's clip-higher)."""
    cispo_cap: float = 1.28
    """cispo: the IS weight min(ratio, cispo_cap); our default is 1 + clip_high."""
    aggregation: Aggregation = "token-mean"
    """verl's names. token-mean: Σ L / Σ mask (DAPO). seq-mean-token-sum: each sequence's token sum,
    averaged over the sequences with a valid token. seq-mean-token-mean: each sequence's token mean,
    averaged over the sequences with a valid token (the original GRPO). seq-mean-token-sum-norm:
    Σ L / (B · norm_len), Dr. GRPO's constant normaliser."""
    norm_len: int | None = None
    """seq-mean-token-sum-norm's constant length (the generation budget); required by that mode and
    never the padded width of a batch, which moves with every batch and holds the prompt."""
    kl_coef: float = 0.0
    """Weight of the KL-to-reference term; 0 turns it off."""
    kl_kind: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    """The per-token KL estimator (``kl_to_ref``); docs/training.md gives each one's gradient."""

    def __post_init__(self) -> None:
        if self.kind not in LOSS_KINDS:
            raise ValueError(f"unknown loss kind {self.kind!r}; expected one of {LOSS_KINDS}")
        problem = aggregation_error(self.aggregation)
        if problem:
            raise ValueError(problem)
        if self.kl_kind not in KL_KINDS:
            raise ValueError(f"unknown kl_kind {self.kl_kind!r}; expected one of {KL_KINDS}")
        if not (0 <= self.clip_low < 1 and self.clip_high >= 0):
            raise ValueError("need 0 <= clip_low < 1 and clip_high >= 0")
        if not self.cispo_cap > 0:
            raise ValueError("cispo_cap must be positive")
        if self.norm_len is not None and self.norm_len < 1:
            raise ValueError("norm_len must be at least 1")
        if self.aggregation == "seq-mean-token-sum-norm" and self.norm_len is None:
            raise ValueError("aggregation seq-mean-token-sum-norm needs norm_len (the generation budget: "
                             "the most response tokens a sequence can have)")
        if self.kl_coef < 0:
            raise ValueError("kl_coef must be non-negative")


def token_logprobs(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    """log π(target_t) under `logits_BTV` (already divided by the temperature): the log-softmax
    at each position, read at the token that came next."""
    return torch.log_softmax(logits_BTV, dim=-1).gather(-1, targets_BT.to(logits_BTV.device)[..., None]).squeeze(-1)


def aggregate(
    loss_BT: torch.Tensor, mask_BT: torch.Tensor, aggregation: str, norm_len: int | None = None
) -> torch.Tensor:
    """Reduce per-token losses to a scalar over the valid tokens, as verl's ``agg_loss`` (see
    LossConfig.aggregation). seq-mean-token-sum-norm divides by B · ``norm_len`` (Dr. GRPO), where
    verl divides each micro-batch by its loss_scale_factor alone: verl's value is ours times the
    micro-batch size, a constant the learning rate absorbs."""
    m_BT = mask_BT.to(loss_BT.dtype)
    masked_BT = loss_BT * m_BT
    problem = aggregation_error(aggregation)
    if problem:
        raise ValueError(problem)
    if aggregation == "token-mean":
        return masked_BT.sum() / m_BT.sum().clamp(min=1)
    if aggregation == "seq-mean-token-sum-norm":
        if norm_len is None or norm_len < 1:
            raise ValueError("seq-mean-token-sum-norm needs norm_len >= 1 (the generation budget)")
        return masked_BT.sum() / (loss_BT.shape[0] * norm_len)
    n_B = m_BT.sum(dim=1)
    has_tokens_B = n_B > 0
    # Sequences with no valid token (all padding, or all rejected) are left out of the mean, as in verl.
    per_seq_B = masked_BT.sum(dim=1)
    if aggregation == "seq-mean-token-mean":
        per_seq_B = per_seq_B / n_B.clamp(min=1)
    return per_seq_B[has_tokens_B].sum() / has_tokens_B.sum().clamp(min=1)


def kl_to_ref(logprobs_BT: torch.Tensor, ref_logprobs_BT: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(π‖π_ref) estimate from the sampled tokens' log-probs (Schulman's k1/k2/k3).

    With u = lp − ref = log(π/π_ref):
    k1 = u (unbiased value; as a loss its expected gradient is 0, since E_π[∇ log π] = 0);
    k2 = u²/2 (gradient u·∇lp, whose expectation is ∇KL(π‖π_ref));
    k3 = e^{−u} + u − 1 (unbiased, non-negative value; gradient (1 − π_ref/π)·∇lp, whose
    expectation is ∇KL(π_ref‖π), the reverse KL);
    low_var_kl = verl's k3: −u clamped to ±20 before exp, the estimate clamped to ±10 (zero
    gradient where a clamp binds).
    """
    if kind == "k1":
        return logprobs_BT - ref_logprobs_BT
    if kind == "k2":
        return 0.5 * (logprobs_BT - ref_logprobs_BT).square()
    if kind == "k3":
        d_BT = ref_logprobs_BT - logprobs_BT
        return d_BT.exp() - d_BT - 1
    if kind == "low_var_kl":
        c = LOW_VAR_KL_LOG_RATIO_CLAMP
        d_BT = (ref_logprobs_BT - logprobs_BT).clamp(-c, c)
        return (d_BT.exp() - d_BT - 1).clamp(-LOW_VAR_KL_VALUE_CLAMP, LOW_VAR_KL_VALUE_CLAMP)
    raise ValueError(f"unknown kl_kind {kind!r}; expected one of {KL_KINDS}")


def policy_loss(
    logprobs_BT: torch.Tensor,
    old_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    config: LossConfig = LossConfig(),
    *,
    is_weights_BT: torch.Tensor | None = None,
    ref_logprobs_BT: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float | None]]:
    """The scalar loss to minimise and its metrics.

    ``logprobs_BT`` carries the gradient; ``old_logprobs_BT`` (the trainer at step start),
    ``advantages_BT``, ``is_weights_BT`` and ``ref_logprobs_BT`` are treated as constants.

    Metrics (verl names): ``actor/pg_loss`` (the aggregated policy-gradient term, without KL),
    ``actor/pg_clipfrac`` (share of valid tokens where the clip binds: ppo_clip's clipped term is
    the active one, cispo's ratio exceeds the cap; 0 for reinforce), ``actor/ppo_kl`` (token mean
    of old − lp), and ``actor/kl_ref`` (token mean of the chosen KL estimate; None without
    ``ref_logprobs_BT``).
    """
    shape = logprobs_BT.shape
    for name, t in (("old_logprobs_BT", old_logprobs_BT), ("advantages_BT", advantages_BT),
                    ("mask_BT", mask_BT), ("is_weights_BT", is_weights_BT),
                    ("ref_logprobs_BT", ref_logprobs_BT)):
        if t is not None and t.shape != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if logprobs_BT.ndim != 2:
        raise ValueError(f"logprobs_BT must be [B, T], got shape {tuple(shape)}")

    mask_BT = mask_BT.bool()
    old_BT = old_logprobs_BT.detach()
    adv_BT = advantages_BT.detach()
    w_BT = torch.ones_like(old_BT) if is_weights_BT is None else is_weights_BT.detach()
    # Padding may hold anything (even inf); zero it before exp so no NaN reaches the gradient.
    zero = torch.zeros((), dtype=logprobs_BT.dtype)
    lp_BT = torch.where(mask_BT, logprobs_BT, zero)
    old_BT = torch.where(mask_BT, old_BT, zero)
    log_ratio_BT = lp_BT - old_BT
    ratio_BT = log_ratio_BT.exp()

    if config.kind == "ppo_clip":
        unclipped_BT = -adv_BT * ratio_BT
        clipped_BT = -adv_BT * ratio_BT.clamp(1 - config.clip_low, 1 + config.clip_high)
        pg_BT = w_BT * torch.maximum(unclipped_BT, clipped_BT)
        clip_active_BT = clipped_BT > unclipped_BT
    elif config.kind == "cispo":
        cispo_w_BT = ratio_BT.detach().clamp(max=config.cispo_cap)
        pg_BT = -w_BT * cispo_w_BT * adv_BT * lp_BT
        clip_active_BT = ratio_BT.detach() > config.cispo_cap
    else:
        pg_BT = -w_BT * adv_BT * lp_BT
        clip_active_BT = torch.zeros_like(mask_BT)

    pg_loss = aggregate(pg_BT, mask_BT, config.aggregation, config.norm_len)
    loss = pg_loss
    n_valid = mask_BT.sum().clamp(min=1)
    metrics: dict[str, float | None] = {
        "actor/pg_loss": float(pg_loss.detach()),
        "actor/pg_clipfrac": float((clip_active_BT & mask_BT).sum() / n_valid),
        "actor/ppo_kl": float((-log_ratio_BT.detach() * mask_BT).sum() / n_valid),
        "actor/kl_ref": None,
    }
    if ref_logprobs_BT is not None:
        ref_BT = torch.where(mask_BT, ref_logprobs_BT.detach(), zero)
        kl_BT = kl_to_ref(lp_BT, ref_BT, config.kl_kind)
        metrics["actor/kl_ref"] = float((kl_BT.detach() * mask_BT).sum() / n_valid)
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * aggregate(kl_BT, mask_BT, config.aggregation, config.norm_len)
    return loss, metrics
