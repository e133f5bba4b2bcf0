"""Group-relative advantages: one scalar per completion of a prompt group.

Every mode takes the rewards of one group, `rewards_G`, and returns `advantages_G` of the same
shape and dtype. A group whose rewards are all equal carries no learning signal: every mode returns
zeros for it.
"""

from __future__ import annotations

import torch

ADVANTAGE_MODES = ("grpo", "dr_grpo", "rloo", "maxrl")


def compute_advantages(rewards_G: torch.Tensor, mode: str, *, eps: float = 1e-6) -> torch.Tensor:
    """Advantages for one group of G completions of the same prompt.

    - ``grpo`` (DeepSeekMath / GRPO): A_i = (r_i − mean(r)) / (std(r) + eps), with the
      *population* standard deviation (divide by G, not G − 1). verl uses the Bessel-corrected
      std; ours is population so that [1, 0, 0, 1] gives exactly ±1 (up to eps).
    - ``dr_grpo`` (Dr. GRPO, Liu et al. 2025): A_i = r_i − mean(r). No std normalisation; the
      other half of Dr. GRPO, dropping the per-sequence length normaliser, lives in the loss
      aggregation ``seq-mean-token-sum-norm`` (losses.py).
    - ``rloo`` (REINFORCE leave-one-out, Ahmadian et al. 2024): A_i = r_i − mean_{j≠i}(r_j)
      = G/(G−1) · (r_i − mean(r)). Needs G ≥ 2.
    - ``maxrl`` (Maximum Likelihood RL, Tajwar et al. 2026, arXiv:2602.02710): A_i =
      (r_i − mean(r)) / mean(r) when mean(r) > 0, else 0. The baseline is subtracted as in GRPO
      but the scale is the group's success rate p̂ = mean(r) instead of its std, which recovers the
      1/p weighting of the maximum-likelihood gradient; for binary rewards with K successes out of
      N a success gets (N−K)/K and a failure −1. Source: the research guide names MaxRL as the
      advantage of its ablation but gives no formula; this definition is the paper's
      "normalise by K instead of N" as described in the retrain project's MaxRL notes, and it
      assumes rewards in [0, 1] (binary verifiable rewards).

    Raises ValueError for an unknown mode, a group that is not 1-D and non-empty, or ``rloo``
    with G < 2.
    """
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"unknown advantage mode {mode!r}; expected one of {ADVANTAGE_MODES}")
    if rewards_G.ndim != 1 or rewards_G.numel() == 0:
        raise ValueError(f"rewards_G must be a non-empty 1-D tensor, got shape {tuple(rewards_G.shape)}")
    rewards_G = rewards_G.to(torch.promote_types(rewards_G.dtype, torch.float32))
    G = rewards_G.numel()
    if mode == "rloo" and G < 2:
        raise ValueError("rloo needs at least two completions per group")
    if bool((rewards_G == rewards_G[0]).all()):
        return torch.zeros_like(rewards_G)

    mean = rewards_G.mean()
    centred_G = rewards_G - mean
    if mode == "grpo":
        return centred_G / (rewards_G.std(unbiased=False) + eps)
    if mode == "dr_grpo":
        return centred_G
    if mode == "rloo":
        return centred_G * (G / (G - 1))
    # maxrl
    if mean <= 0:
        return torch.zeros_like(rewards_G)
    return centred_G / mean
