"""The mismatch observatory: how far two engines' numerics and two agent runs drift apart.

The metrics (formulas in DESIGN.md, 'Formulas', and docs/observatory.md, 'Metrics'):

    dense_summary(rollout_logprobs, trainer_logprobs, mask)   token/sequence ESS, |Δ|, KL, χ², ...
    offpolicy_figures(rollout_lp_N, trainer_lp_N, lengths_S)   verl's rollout_corr/* figures, as verl computes them
    router_summary(rollout_experts_TLK, trainer_experts_TLK)   MoE router flips and overlap
    trajectory_divergence(run_a, run_b)                        where two agent runs part ways
    bootstrap_interval(values)                                 an aggregate with its 95% interval

Importing this package does not import torch.
"""

from .dense import (
    CLAMP,
    VETO,
    DenseSummary,
    dense_summary,
    dense_summary_many,
    sequence_ess,
    worst_token_index,
)
from .dense import to_report as dense_report
from .divergence import DivergenceSummary, canonical_arguments, first_token_split, trajectory_divergence
from .divergence import to_report as divergence_report
from .offpolicy import OffPolicyFigures, offpolicy_figures
from .router import RouterSummary, router_summary, top1_differs
from .router import to_report as router_report
from .stats import bootstrap_interval

__all__ = [
    "CLAMP", "VETO", "DenseSummary", "DivergenceSummary", "OffPolicyFigures", "RouterSummary", "bootstrap_interval",
    "canonical_arguments", "dense_report", "dense_summary", "dense_summary_many", "divergence_report",
    "first_token_split", "offpolicy_figures", "router_report", "router_summary", "sequence_ess", "top1_differs",
    "trajectory_divergence", "worst_token_index",
]
