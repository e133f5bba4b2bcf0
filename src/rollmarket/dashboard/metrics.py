"""What every number on the dashboard means: the /metrics page is this list.

Names are the fields of the observatory's records (DenseMismatchReport, RouterMismatchReport,
MatrixCell, AgentDivergenceReport); a test fails when a record gains a metric this list lacks.
Δ_t = logπ_trainer(y_t) − logπ_rollout(y_t) over action tokens (tool output excluded), c = 20,
w_t = exp(clip(Δ_t, −c, c)). verl's names carry its `rollout_corr/` or `training/` prefix (verl's
rollout_corr_helper.py; its older releases said `mismatch/`); slime's its `train/` prefix. "≈" marks a
neighbour rather than the same quantity; verl's own figures are in docs/metrics.md.
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
              verl="≈ rollout_corr/rollout_is_eff_sample_size (rollout_is=token; verl clips the weights to "
                   "[1/C, C] first, C = 2 by default)"),
    MetricDoc(name="sequence_ess", title="Sequence ESS", group="dense",
              formula="(Σ_i W_i)² / (m · Σ_i W_i²), W_i = exp(clip(Σ_t Δ_i,t, −c, c)) over m trajectories",
              meaning="ESS of whole-trajectory weights over a cell's trajectories; one bad token can sink a "
                      "sequence, so this falls faster than token ESS as responses grow.",
              verl="≈ rollout_corr/rollout_is_eff_sample_size (rollout_is=sequence; verl clips to [1/C, C] and "
                   "weights each sequence by its tokens)"),
    MetricDoc(name="sequence_log_ratio", title="Sequence log ratio", group="dense", formula="Σ_t Δ_t",
              meaning="The log importance weight of the whole trajectory (before clipping).",
              verl="≈ rollout_corr/rollout_is_seq_* (sequence-level weight statistics)"),
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
              verl="≈ rollout_corr/rollout_is_ratio_fraction_high + _low (at C and 1/C, not at e^±20)",
              slime="≈ train/tis_clipfrac (at the TIS clip)"),
    MetricDoc(name="veto_fraction", title="Veto fraction", group="dense", formula="mean_t [|Δ_t| > 30]",
              meaning="Share of catastrophic tokens; any one sends the trajectory to quarantine.",
              verl=None),
    MetricDoc(name="second_moment", title="Second moment of w", group="dense", formula="mean_t w_t²",
              meaning="Variance driver of the importance-weighted gradient; 1.0 when the engines agree.",
              verl="≈ rollout_corr/rollout_is_std (std² = second moment − mean², of weights clipped to [1/C, C])"),
    MetricDoc(name="top1pct_gradient_mass", title="Top-1% gradient mass", group="dense",
              formula="Σ of the largest ⌈n/100⌉ weights / Σ w",
              meaning="How much of the gradient a handful of tokens carry; about 0.01 when weights are even."),
    MetricDoc(name="kl_k1", title="KL (k1)", group="dense", formula="mean_t (logπ_rollout − logπ_trainer)",
              meaning="The plain KL(π_rollout ‖ π_trainer) estimator on sampled tokens; can be negative.",
              verl="rollout_corr/kl"),
    MetricDoc(name="kl_k3", title="KL (k3)", group="dense", formula="mean_t (r − log r − 1), r = w_t",
              meaning="Low-variance, never-negative KL estimator; tiles carry its interval in the JSON.",
              verl="rollout_corr/k3_kl (verl does not clamp r: equal while no |Δ_t| > 20)"),
    MetricDoc(name="chi2", title="χ²", group="dense", formula="mean_t r² − 1, r = w_t",
              meaning="χ² divergence estimate: the variance cost of importance correction.",
              verl="rollout_corr/chi2_token (verl's bound on Δ is ±20 too)"),
    MetricDoc(name="log_ppl_rollout", title="Log-perplexity, rollout", group="dense",
              formula="−mean_t logπ_rollout(y_t)", meaning="How surprised the rollout engine was by its own sample.",
              verl="rollout_corr/rollout_log_ppl (of one trajectory; verl averages per-sequence values)"),
    MetricDoc(name="log_ppl_trainer", title="Log-perplexity, trainer", group="dense",
              formula="−mean_t logπ_trainer(y_t)", meaning="How surprised the trainer is by the rollout's sample.",
              verl="rollout_corr/training_log_ppl (of one trajectory; verl averages per-sequence values)"),
    MetricDoc(name="log_ppl_diff", title="Log-perplexity difference", group="dense",
              formula="log_ppl_trainer − log_ppl_rollout",
              meaning="Positive when the trainer is less confident than the rollout engine was.",
              verl="rollout_corr/log_ppl_diff (the same sign, mean logπ_rollout − mean logπ_trainer; of one "
                   "trajectory)"),
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
    MetricDoc(name="router_replay", title="Router replay (R3)", group="aggregate",
              formula="the trainer engine `<engine>+replay` routes each produced token to the rollout's top-k experts",
              meaning="A replay cell sits beside the same engine without replay: what mismatch is left once routing "
                      "cannot differ. Its router flip rate, measured from the experts the forward used, is 0 by "
                      "construction."),
    MetricDoc(name="absent", title="Absent cell", group="aggregate", formula="n = 0, with the reason",
              meaning="Why a cell has no numbers: e.g. a replay cell of a rollout engine that returned no routed "
                      "experts (vLLM on the CPU)."),
    MetricDoc(name="rollout_corr", title="verl's rollout_corr figures", group="aggregate",
              formula="verl's rollout_is_eff_sample_size (weights clipped to [1/C, C], C = 2), "
                      "rollout_is_ratio_fraction_high/_low, kl, k3_kl, chi2_token, chi2_seq and the ppl figures, "
                      "with the cell's trajectories as verl's batch",
              meaning="The numbers verl would log for this pair of engines, under verl's names (in the tile's JSON); "
                      "formulas in docs/metrics.md.",
              verl="rollout_corr/*"),
    MetricDoc(name="position_scaling", title="Mismatch by response position", group="aggregate",
              formula="per bucket of response positions (0–15, 16–31, 32–63, … doubling), over the probes' valid "
                      "tokens: mean_t |Δ_t| and mean_t (r − log r − 1), with token and trajectory counts",
              meaning="Whether drift grows along the response. Token ESS per trajectory falls with length even "
                      "when every token drifts alike (one token gives 1), so read growth here, not from ESS vs "
                      "length. Tokens a probe sampled after its EOS (ignore_eos) are excluded and counted."),
]


def metrics_page() -> MetricsPage:
    groups = list(dict.fromkeys(m.group for m in METRICS))
    return MetricsPage(metrics=METRICS, groups=groups)
