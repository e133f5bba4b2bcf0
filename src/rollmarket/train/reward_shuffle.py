"""The shuffled-reward control (`reward.shuffle = "batch"`): rewards permuted within each step's batch.

A claim that RL taught the model something needs a control that runs the same loop with the same
compute but whose reward carries no information about the response. Here each step's rewards
(every trajectory of every group the step judged) are pooled and permuted across the batch before
the advantages are taken, so a trajectory is trained with another trajectory's reward, usually one
of another task's. The batch keeps its rewards' multiset (the same number of successes, the same
mean reward) and each group its size; only which response gets which reward is lost. A run with
it should not gain on held-out tasks beyond noise; if it does, the gain came from something other
than the reward (the data's format, the loss's entropy effects, the evaluation's noise).

The permutation of step k is seeded by the run's sampling seed and k (`shuffle_seed`), so a run
and its resumed self, and two runs with one seed, shuffle alike; the batch's order is canonical
(groups by job id, each group's runs by sample index), not the order the groups arrived in.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

SHUFFLE_MODES = ("none", "batch")


class RewardShuffleError(ValueError):
    """A shuffle mode that does not exist, or groups that cannot be shuffled (an empty group)."""


def shuffle_seed(sampling_seed: int, step: int) -> int:
    """Step `step`'s permutation seed: the first 8 hex digits of sha256("shuffle:<seed>:<step>"),
    the rule the job seeds follow with their own prefix (docs/training.md)."""
    return int(hashlib.sha256(f"shuffle:{sampling_seed}:{step}".encode()).hexdigest()[:8], 16)


def shuffle_batch_rewards(group_rewards: Sequence[Sequence[float]], *, mode: str, seed: int) -> list[list[float]]:
    """The rewards each group trains with: `group_rewards` itself for mode "none"; for "batch",
    the flattened rewards (groups in the order given, each group's runs in order) permuted by
    numpy's PCG64 generator seeded with `seed`, then cut back into groups of the same sizes.

    Returns new lists; raises RewardShuffleError for an unknown mode or an empty group."""
    if mode not in SHUFFLE_MODES:
        raise RewardShuffleError(f"unknown reward shuffle mode {mode!r}; expected one of {SHUFFLE_MODES}")
    sizes = [len(g) for g in group_rewards]
    if any(size == 0 for size in sizes):
        raise RewardShuffleError("a group without rewards cannot be shuffled")
    if mode == "none":
        return [[float(r) for r in g] for g in group_rewards]
    rewards_N = np.array([float(r) for g in group_rewards for r in g], dtype=np.float64)
    shuffled_N = rewards_N[np.random.default_rng(seed).permutation(rewards_N.size)]
    out, start = [], 0
    for size in sizes:
        out.append(shuffled_N[start:start + size].tolist())
        start += size
    return out


def changed_fraction(own: Sequence[Sequence[float]], trained: Sequence[Sequence[float]]) -> float | None:
    """Share of the runs trained with a reward other than their own (`reward_shuffle/changed_fraction`);
    None for an empty batch."""
    pairs = [(a, b) for g_own, g_trained in zip(own, trained, strict=True)
             for a, b in zip(g_own, g_trained, strict=True)]
    return sum(a != b for a, b in pairs) / len(pairs) if pairs else None
