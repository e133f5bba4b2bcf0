"""What every number on the dashboard means: the /metrics page is this list.

Names are the fields of the observatory's records (DenseMismatchReport, RouterMismatchReport,
MatrixCell, AgentDivergenceReport); a test fails when a record gains a metric this list lacks.
Δ_t = logπ_trainer(y_t) − logπ_rollout(y_t) over action tokens (tool output excluded), c = 20,
w_t = exp(clip(Δ_t, −c, c)). verl's names carry its `mismatch/` or `training/` prefix; slime's its
`train/` prefix. "≈" marks a neighbour rather than the same quantity.
"""

from __future__ import annotations

from pydantic import Field

from ..contracts import Record


class MetricDoc(Record):
    name: str = Field(description="The field name in the observatory's records.")
    title: str
    group: str = Field(description="dense, router, agent or aggregate.")
    formula: str
    meaning: str
    bands: str | None = Field(default=None, description="Colour bands, where the dashboard colours it.")
    verl: str | None = Field(default=None, description="verl's name for it, if it logs one.")
    slime: str | None = Field(default=None, description="slime's name for it, if it logs one.")


class MetricsPage(Record):
    metrics: list[MetricDoc]
    groups: list[str]


METRICS: list[MetricDoc] = [
    MetricDoc(name="token_ess", title="Token ESS", group="dense",
              formula="(Σ w_t)² / (n · Σ w_t²)",
              meaning="Effective sample size of the per-token importance weights, as a fraction of the n tokens: "
                      "how much of the response the trainer can reuse after importance correction. 1.0 means the "
                      "engines agree on every token; a tile shows the mean over the cell's trajectories.",
              bands="green > 0.99 · amber 0.95–0.99 (needs stronger off-policy correction) · red < 0.95 (would be "
                    "dropped)",
              verl="mismatch/rollout_is_eff_sample_size (rollout_is_level=token)"),
    MetricDoc(name="sequence_ess", title="Sequence ESS", group="dense",
              formula="(Σ_i W_i)² / (m · Σ_i W_i²), W_i = exp(clip(Σ_t Δ_i,t, −c, c)) over m trajectories",
              meaning="ESS of whole-trajectory weights over a cell's trajectories; one bad token can sink a "
                      "sequence, so this falls faster than token ESS as responses grow.",
              verl="mismatch/rollout_is_eff_sample_size (rollout_is_level=sequence)"),
    MetricDoc(name="sequence_log_ratio", title="Sequence log ratio", group="dense", formula="Σ_t Δ_t",
              meaning="The log importance weight of the whole trajectory (before clipping).",
              verl="≈ mismatch/rollout_is_seq_* (sequence-level weight statistics)"),
    MetricDoc(name="mean_delta", title="Mean Δlogp", group="dense", formula="mean_t Δ_t",
              meaning="Signed bias: positive when the trainer finds the sampled tokens likelier than the rollout did."),
    MetricDoc(name="mean_abs_delta", title="Mean |Δlogp|", group="dense", formula="mean_t |Δ_t|",
              meaning="Average per-token log-probability gap between rollout and trainer; the sub-label of a dense "
                      "tile. ESS is a sequence-level roll-up of this gap.",
              slime="train/train_rollout_logprob_abs_diff"),
    MetricDoc(name="max_abs_delta", title="Max |Δlogp|", group="dense", formula="max_t |Δ_t| (unclipped)",
              meaning="The worst single token; averages can hide a spike that dominates a gradient."),
    MetricDoc(name="clipped_fraction", title="Clipped fraction", group="dense", formula="mean_t [|Δ_t| > 20]",
              meaning="Share of tokens whose weight the clamp changed; above 0.10 the gate asks for corrected "
                      "training.",
              verl="≈ mismatch/rollout_is_ratio_fraction_high + _low (at verl's thresholds)",
              slime="≈ train/tis_clipfrac (at the TIS clip)"),
    MetricDoc(name="veto_fraction", title="Veto fraction", group="dense", formula="mean_t [|Δ_t| > 30]",
              meaning="Share of catastrophic tokens; any one sends the trajectory to quarantine.",
              verl="≈ mismatch/rollout_is_catastrophic_token_fraction (ratio below its veto threshold)"),
    MetricDoc(name="second_moment", title="Second moment of w", group="dense", formula="mean_t w_t²",
              meaning="Variance driver of the importance-weighted gradient; 1.0 when the engines agree.",
              verl="≈ mismatch/rollout_is_std (std² = second moment − mean²)"),
    MetricDoc(name="top1pct_gradient_mass", title="Top-1% gradient mass", group="dense",
              formula="Σ of the largest ⌈n/100⌉ weights / Σ w",
              meaning="How much of the gradient a handful of tokens carry; about 0.01 when weights are even."),
    MetricDoc(name="kl_k1", title="KL (k1)", group="dense", formula="mean_t (logπ_rollout − logπ_trainer)",
              meaning="The plain KL(π_rollout ‖ π_trainer) estimator on sampled tokens; can be negative.",
              verl="mismatch/mismatch_kl"),
    MetricDoc(name="kl_k3", title="KL (k3)", group="dense", formula="mean_t (r − log r − 1), r = exp(Δ_t)",
              meaning="Low-variance, never-negative KL estimator; tiles carry its interval in the JSON.",
              verl="mismatch/mismatch_k3_kl"),
    MetricDoc(name="chi2", title="χ²", group="dense", formula="mean_t r² − 1",
              meaning="χ² divergence estimate: the variance cost of importance correction."),
    MetricDoc(name="log_ppl_rollout", title="Log-perplexity, rollout", group="dense",
              formula="−mean_t logπ_rollout(y_t)", meaning="How surprised the rollout engine was by its own sample.",
              verl="mismatch/mismatch_rollout_log_ppl"),
    MetricDoc(name="log_ppl_trainer", title="Log-perplexity, trainer", group="dense",
              formula="−mean_t logπ_trainer(y_t)", meaning="How surprised the trainer is by the rollout's sample.",
              verl="mismatch/mismatch_training_log_ppl"),
    MetricDoc(name="log_ppl_diff", title="Log-perplexity difference", group="dense",
              formula="log_ppl_trainer − log_ppl_rollout",
              meaning="Positive when the trainer is less confident than the rollout engine was.",
              verl="mismatch/mismatch_log_ppl_diff (opposite sign: rollout − training)"),
    MetricDoc(name="mean_prob_diff", title="Mean |Δp|", group="dense",
              formula="mean_t |p_rollout(y_t) − p_trainer(y_t)|",
              meaning="The gap in probability space; verl calls < 0.005 healthy and > 0.01 a precision bug.",
              verl="training/rollout_probs_diff_mean"),
    MetricDoc(name="n_tokens", title="Tokens compared", group="dense",
              formula="count of action tokens (a tile's 'tok' sums them)",
              meaning="The denominator of every per-token mean; tool output is excluded."),
    MetricDoc(name="response_length", title="Response length", group="dense",
              formula="all response tokens, tool output included",
              meaning="How long the stitched agent response is; the length-scaling charts group by its target."),
    MetricDoc(name="worst_token", title="Worst token", group="dense",
              formula="argmax_t |Δ_t| with 24 tokens before and 8 after",
              meaning="The single largest spike, with both logprobs and its surroundings; the worst-token card and "
                      "the viewer's outlined token."),
    MetricDoc(name="router_flip_rate", title="Router flip rate", group="router",
              formula="mean over (token, MoE layer) of [top-1 expert_rollout ≠ top-1 expert_trainer]",
              meaning="How often the engines route a token to a different first expert. Logprobs can agree while "
                      "routing differs; then the gradient lands on experts the rollout never used.",
              bands="green ≤ 5% · amber 5–15% · red > 15% (the gate quarantines above 15%)",
              slime="none: slime replays the rollout's routing instead (--use-rollout-routing-replay, R3)"),
    MetricDoc(name="token_expert_disagreement_rate", title="Token expert disagreement", group="router",
              formula="mean over tokens of [top-k sets differ at any MoE layer]",
              meaning="Share of tokens whose expert set differs somewhere in the network."),
    MetricDoc(name="per_layer_flip_rate", title="Per-layer flip rate", group="router",
              formula="router_flip_rate restricted to one MoE layer",
              meaning="Where in depth routing drifts; deeper layers usually drift more."),
    MetricDoc(name="worst_layer_flip_rate", title="Worst layer", group="router",
              formula="max over layers of per_layer_flip_rate (and worst_layer, its index)",
              meaning="The router tile's sub-label: a check that the mean is not hiding one wildly out-of-band layer."),
    MetricDoc(name="topk_overlap", title="Top-k overlap", group="router",
              formula="mean over (token, layer) of |A ∩ B| / k",
              meaning="How much of the expert set the engines share; 1.0 when they pick the same k experts."),
    MetricDoc(name="first_divergent_step", title="First divergent step", group="agent",
              formula="first turn index where two runs of the same task and seeds differ",
              meaning="Where the agent's path split between two rollout engines; the viewer highlights that turn."),
    MetricDoc(name="kind", title="Divergence kind", group="agent",
              formula="tool_choice | tool_args | content | termination | none",
              meaning="What differed first: which tool, its arguments, the text, or whether the run stopped."),
    MetricDoc(name="tool_choice_disagreement_rate", title="Tool-choice disagreement", group="agent",
              formula="share of aligned turns whose tool names differ",
              meaning="How often the engines pick different tools."),
    MetricDoc(name="tool_call_jaccard", title="Tool-call Jaccard", group="agent",
              formula="|A ∩ B| / |A ∪ B| over (tool name, argument hash) sets",
              meaning="1.0 when both runs made exactly the same calls."),
    MetricDoc(name="final_answer_match_strict", title="Final answer match (strict)", group="agent",
              formula="answer_a == answer_b", meaning="Whether the runs ended on the same text."),
    MetricDoc(name="final_answer_match_soft", title="Final answer match (soft)", group="agent",
              formula="equal after normalization, or numerically equal",
              meaning="Whether the runs reached the same answer, however written."),
    MetricDoc(name="split_turn", title="Split-turn mismatch", group="agent",
              formula="a dense report of engine B's logprobs on engine A's tokens of the split turn",
              meaning="The token-level mismatch just before the paths split; top_delta_tokens lists its largest |Δ|."),
    MetricDoc(name="n", title="n", group="aggregate", formula="trajectories in the cell",
              meaning="What a tile averages over; every aggregate shows it.",
              bands="a tile with n < 30 says so (low_n): its interval is wide"),
    MetricDoc(name="interval", title="95% interval", group="aggregate",
              formula="percentile bootstrap over the cell's trajectories: [2.5%, 97.5%] of resampled means",
              meaning="How far the tile's mean could move with other trajectories; shown as [lo, hi] under it."),
    MetricDoc(name="tokens", title="Cell tokens", group="aggregate", formula="Σ n_tokens over the cell",
              meaning="The router tile's 'tok': the denominator of its flip rate."),
]


def metrics_page() -> MetricsPage:
    groups = list(dict.fromkeys(m.group for m in METRICS))
    return MetricsPage(metrics=METRICS, groups=groups)
