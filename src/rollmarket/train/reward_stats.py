"""Reward ties inside prompt groups: how much learning signal a step's groups carry.

A group-relative advantage needs rewards that differ inside a group; these figures say how often
they do not. Definitions follow retrain (the research guide's trainer, its "Tinker forecasting
note"), over ELIGIBLE groups only, those with at least two rollouts:

- ``reward_tie_group_rate``: fraction of eligible groups with any repeated reward;
- ``reward_uniform_group_rate``: fraction of eligible groups whose rewards all tie (no signal);
- ``reward_tie_pair_rate``: tied pairs / all pairs, pooled over the eligible groups
  (a group of G has G(G−1)/2 pairs; a value shared by k rollouts ties k(k−1)/2 of them);
- ``reward_unique_fraction_mean``: mean over eligible groups of (distinct rewards / G);
- ``reward_tie_eligible_groups``: how many groups were eligible.

With no eligible group the rates are None (null in metrics.jsonl), never 0. With binary rewards and
G > 2 some reward repeats in every group (pigeonhole), so the group tie rate is 1 and only the pair
rate and the unique fraction say anything. Rewards tie when exactly equal, the rule the advantages
use (retrain buckets rewards within 1e-6).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

REWARD_TIE_METRICS = ("reward_tie_group_rate", "reward_uniform_group_rate", "reward_tie_pair_rate",
                      "reward_unique_fraction_mean", "reward_tie_eligible_groups")


def reward_tie_stats(groups: Iterable[Sequence[float]]) -> dict[str, float | int | None]:
    """The reward-tie metrics (module docstring) of a step's groups, each a sequence of its rewards."""
    eligible = tie = uniform = tied_pairs = pairs = 0
    unique_fraction_sum = 0.0
    for rewards in groups:
        g = len(rewards)
        if g < 2:
            continue
        counts = Counter(float(r) for r in rewards)
        eligible += 1
        tie += int(len(counts) < g)
        uniform += int(len(counts) == 1)
        tied_pairs += sum(k * (k - 1) // 2 for k in counts.values())
        pairs += g * (g - 1) // 2
        unique_fraction_sum += len(counts) / g
    if not eligible:
        return {"reward_tie_group_rate": None, "reward_uniform_group_rate": None, "reward_tie_pair_rate": None,
                "reward_unique_fraction_mean": None, "reward_tie_eligible_groups": 0}
    return {"reward_tie_group_rate": tie / eligible, "reward_uniform_group_rate": uniform / eligible,
            "reward_tie_pair_rate": tied_pairs / pairs, "reward_unique_fraction_mean": unique_fraction_sum / eligible,
            "reward_tie_eligible_groups": eligible}
