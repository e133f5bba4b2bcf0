"""BudgetReport from behaviour and trainer logprobs (formulas in DESIGN.md, 'Formulas')."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..contracts import BudgetReport, RolloutCorrFigures, SampleGroup, Trajectory
from ..observatory.dense import dense_summary
from ..observatory.offpolicy import IS_THRESHOLD, offpolicy_figures
from ..observatory.router import top1_differs
from .config import GateConfig

IMPOSSIBLE_LOGPROB = 1e4
"""Magnitude that stands in for an infinite trainer logprob."""


def valid_token_mask(trajectory: Trajectory) -> np.ndarray:
    """bool [T]: tokens the policy produced that are not tool output."""
    n = trajectory.num_response_tokens
    valid_T = np.ones(n, dtype=bool) if trajectory.action_mask is None else trajectory.action_mask.astype(bool)
    if trajectory.tool_output_mask is not None:
        valid_T &= ~trajectory.tool_output_mask.astype(bool)
    return valid_T


def budget_from_arrays(
    rollout_logprobs_N: np.ndarray,
    trainer_logprobs_N: np.ndarray,
    sequence_ids_N: np.ndarray,
    n_sequences: int,
    *,
    group_id: str = "",
    config: GateConfig = GateConfig(),
    router_flip_rate: float | None = None,
    policy_lag_steps: int = 0,
) -> BudgetReport:
    """The statistics over N valid tokens drawn from `n_sequences` sequences.

    `sequence_ids_N` says which sequence each token belongs to (0 .. n_sequences-1). The
    statistics are the observatory's (`rollmarket.observatory.dense_summary`); `rollout_corr` holds
    verl's figures (`rollmarket.observatory.offpolicy`) with verl's default C = 2 at the level of
    `config.ess_kind`.
    """
    rollout_N = np.asarray(rollout_logprobs_N)
    # A trainer logprob of -inf (or NaN) marks a token the trainer deems impossible: give it a
    # huge finite Δ so the report stays finite and the veto quarantines the group.
    trainer_N = np.nan_to_num(np.asarray(trainer_logprobs_N, dtype=np.float64),
                              nan=-IMPOSSIBLE_LOGPROB, neginf=-IMPOSSIBLE_LOGPROB, posinf=0.0)
    sequence_ids_N = np.asarray(sequence_ids_N, dtype=np.int64)
    if rollout_N.ndim != 1 or rollout_N.shape != trainer_N.shape or sequence_ids_N.shape != rollout_N.shape:
        raise ValueError(f"logprob and sequence id shapes differ: {rollout_N.shape}, {trainer_N.shape}, "
                         f"{sequence_ids_N.shape}")
    if sequence_ids_N.size and not (0 <= sequence_ids_N.min() and sequence_ids_N.max() < n_sequences):
        raise ValueError(f"sequence ids must lie in 0 .. {n_sequences - 1}")
    if (np.diff(sequence_ids_N) < 0).any():  # dense_summary takes consecutive sequences
        order_N = np.argsort(sequence_ids_N, kind="stable")
        rollout_N, trainer_N, sequence_ids_N = rollout_N[order_N], trainer_N[order_N], sequence_ids_N[order_N]
    lengths_S = np.bincount(sequence_ids_N, minlength=n_sequences)
    s = dense_summary(rollout_N, trainer_N, clamp=config.clamp, veto=config.veto_abs_delta, lengths=lengths_S)
    figures = offpolicy_figures(rollout_N, trainer_N, lengths_S, is_threshold=IS_THRESHOLD, is_level=config.ess_kind)
    rollout_corr = RolloutCorrFigures(is_threshold=figures.is_threshold, is_level=config.ess_kind,
                                      **figures.metrics(prefix=""))
    common = dict(group_id=group_id, n_tokens=s.n_tokens, n_sequences=n_sequences, clamp=config.clamp,
                  router_flip_rate=router_flip_rate, policy_lag_steps=policy_lag_steps, rollout_corr=rollout_corr)
    if s.n_tokens == 0:  # nothing is off-policy
        return BudgetReport.model_validate(common | dict(
            token_ess=1.0, sequence_ess=1.0, mean_delta=0.0, mean_abs_delta=0.0, max_abs_delta=0.0,
            clipped_fraction=0.0, veto_fraction=0.0, second_moment=1.0, top1pct_mass=0.0, kl_k1=0.0, kl_k3=0.0,
            chi2=0.0, mean_prob_diff=0.0))
    # With tokens every statistic is a number (DenseSummary has None only for n_tokens = 0).
    return BudgetReport.model_validate(common | dict(
        token_ess=s.token_ess, sequence_ess=s.sequence_ess, mean_delta=s.mean_delta,
        mean_abs_delta=s.mean_abs_delta, max_abs_delta=s.max_abs_delta, clipped_fraction=s.clipped_fraction,
        veto_fraction=s.veto_fraction, second_moment=s.second_moment, top1pct_mass=s.top1pct_gradient_mass,
        kl_k1=s.kl_k1, kl_k3=s.kl_k3, chi2=s.chi2, mean_prob_diff=s.mean_prob_diff))


def router_flip_rate(
    rollout_experts: Sequence[np.ndarray], trainer_experts: Sequence[np.ndarray],
    valid_masks: Sequence[np.ndarray],
) -> float:
    """Share of (valid token, MoE layer) positions whose top-1 expert differs.

    Arrays are [T, L, K] with experts ordered by routing weight, so column 0 is the top-1.
    """
    flips = 0
    positions = 0
    for rollout_TLK, trainer_TLK, valid_T in zip(rollout_experts, trainer_experts, valid_masks,
                                                  strict=True):
        differ_TL = top1_differs(rollout_TLK, trainer_TLK)[valid_T]
        flips += int(differ_TL.sum())
        positions += differ_TL.size
    return flips / positions if positions else 0.0


def budget_report(
    group: SampleGroup,
    trainer_logprobs: Sequence[np.ndarray],
    *,
    trainer_routed_experts: Sequence[np.ndarray] | None = None,
    policy_lag_steps: int | None = None,
    config: GateConfig = GateConfig(),
) -> BudgetReport:
    """The BudgetReport of a group, given the trainer's logprobs for each trajectory's response.

    `trainer_logprobs[i]` is float [T_i] aligned with `group.trajectories[i].response_token_ids`.
    Only valid tokens (action, not tool output) count.
    """
    if len(trainer_logprobs) != len(group.trajectories):
        raise ValueError(
            f"{len(trainer_logprobs)} trainer logprob arrays for {len(group.trajectories)} trajectories"
        )
    rollout_parts, trainer_parts, seq_parts, masks = [], [], [], []
    for index, (trajectory, trainer_T) in enumerate(zip(group.trajectories, trainer_logprobs)):
        if trajectory.logprobs is None:
            raise ValueError(f"trajectory {index} has no behaviour logprobs")
        trainer_T = np.asarray(trainer_T)
        if trainer_T.shape != trajectory.logprobs.shape:
            raise ValueError(
                f"trajectory {index}: trainer logprobs {trainer_T.shape} vs behaviour {trajectory.logprobs.shape}"
            )
        valid_T = valid_token_mask(trajectory)
        masks.append(valid_T)
        rollout_parts.append(trajectory.logprobs[valid_T])
        trainer_parts.append(trainer_T[valid_T])
        seq_parts.append(np.full(int(valid_T.sum()), index, dtype=np.int64))
    flip = None
    if trainer_routed_experts is not None:
        rollout_experts = [t.routed_experts for t in group.trajectories if t.routed_experts is not None]
        if len(rollout_experts) != len(group.trajectories):
            raise ValueError("trainer routed experts given but the group has none")
        flip = router_flip_rate(rollout_experts, trainer_routed_experts, masks)
    return budget_from_arrays(
        np.concatenate(rollout_parts),
        np.concatenate(trainer_parts),
        np.concatenate(seq_parts),
        len(group.trajectories),
        group_id=group.group_id,
        config=config,
        router_flip_rate=flip,
        policy_lag_steps=group.policy_lag_steps if policy_lag_steps is None else policy_lag_steps,
    )
