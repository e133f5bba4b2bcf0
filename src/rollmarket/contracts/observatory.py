"""What the observatory writes: per-trajectory mismatch reports, agent divergence, and the matrix.

Formulas are in DESIGN.md and docs/observatory.md; `rollmarket.observatory` computes them.
"""

from __future__ import annotations

from enum import Enum

from pydantic import Field

from .base import Record
from .budget import RolloutCorrFigures
from .limits import MAX_ITEMS, MAX_LAYERS, Count, Key, Message, Name, Text, TokenCount


class WorstToken(Record):
    """The response token with the largest |Δlogp| in a trajectory, with its surroundings."""

    position: TokenCount = Field(description="Offset in the stitched response.")
    token_id: int = Field(ge=0, le=2**31 - 1)
    token_text: Text
    delta: float = Field(description="logπ_trainer − logπ_rollout at this token.")
    rollout_logprob: float
    trainer_logprob: float
    context_before: Text = Field(default="", description="Decoded text of up to 24 tokens before it.")
    context_after: Text = Field(default="", description="Decoded text of up to 8 tokens after it.")
    turn: Count | None = Field(default=None, description="The agent turn the token belongs to.")


class DenseMismatchReport(Record):
    """Token-probability mismatch of one trajectory between a rollout and a trainer engine.

    Δ_t = logπ_trainer(y_t) − logπ_rollout(y_t) over action tokens (tool output excluded).
    """

    trajectory_id: Key = Field(description="'<task_id>#<sample_index>': the same id on every engine pair.")
    rollout_engine: Name
    trainer_engine: Name
    n_tokens: Count = Field(description="Action tokens compared.")
    token_ess: float | None = Field(description="(Σw)² / (n·Σw²), w = exp(clip(Δ, ±20)).")
    sequence_log_ratio: float = Field(description="ΣΔ over the trajectory (the sequence-level log weight).")
    mean_delta: float | None
    mean_abs_delta: float | None
    max_abs_delta: float | None
    clipped_fraction: float | None = Field(description="Share of tokens with |Δ| > 20.")
    veto_fraction: float | None = Field(description="Share of tokens with |Δ| > 30.")
    second_moment: float | None = Field(description="mean(w²).")
    top1pct_gradient_mass: float | None = Field(description="Share of Σw held by the largest 1% of weights.")
    kl_k1: float | None = Field(description="mean(logπ_rollout − logπ_trainer).")
    kl_k3: float | None = Field(description="mean(r − log r − 1), r = exp(Δ).")
    chi2: float | None = Field(description="mean(r²) − 1.")
    log_ppl_rollout: float | None
    log_ppl_trainer: float | None
    log_ppl_diff: float | None = Field(description="log_ppl_trainer − log_ppl_rollout.")
    mean_prob_diff: float | None = Field(description="mean |p_rollout − p_trainer|.")
    response_length: Count = Field(description="All response tokens, tool output included.")
    worst_token: WorstToken | None = None


class RouterMismatchReport(Record):
    """MoE routing mismatch of one trajectory: the experts each engine picked for the same tokens."""

    trajectory_id: Key
    rollout_engine: Name
    trainer_engine: Name
    n_tokens: Count
    num_layers: int = Field(ge=0, le=MAX_LAYERS, description="MoE layers compared.")
    top_k: int = Field(ge=0, le=MAX_LAYERS)
    router_flip_rate: float | None = Field(description="Share of (token, layer) whose top-1 expert differs.")
    token_expert_disagreement_rate: float | None = Field(
        description="Share of tokens whose top-k expert set differs at any layer.")
    per_layer_flip_rate: list[float] = Field(default_factory=list, max_length=MAX_LAYERS)
    worst_layer: int | None = Field(default=None, ge=0, le=MAX_LAYERS)
    worst_layer_flip_rate: float | None = None
    topk_overlap: float | None = Field(description="mean |A∩B| / k over (token, layer).")


class DivergenceKind(str, Enum):
    none = "none"
    tool_choice = "tool_choice"
    tool_args = "tool_args"
    content = "content"
    termination = "termination"


class DeltaToken(Record):
    """One token of the split turn with its Δ, for 'what happened just before the paths split'."""

    position: TokenCount
    token_text: Text
    delta: float
    rollout_logprob: float
    trainer_logprob: float


class AgentDivergenceReport(Record):
    """Two runs of the same task with the same seeds on two rollout engines, compared."""

    task_id: Key
    sample_index: Count = 0
    engine_a: Name
    engine_b: Name
    first_divergent_step: Count | None = Field(description="First turn where the runs differ; None if they never do.")
    kind: DivergenceKind
    tool_choice_disagreement_rate: float = Field(description="Share of aligned turns whose tool names differ.")
    tool_call_jaccard: float = Field(description="Jaccard of the (tool name, argument hash) sets of the runs.")
    final_answer_match_strict: bool
    final_answer_match_soft: bool = Field(description="Equal after normalization, or numerically equal.")
    steps_a: Count
    steps_b: Count
    split_turn: DenseMismatchReport | None = Field(
        default=None, description="Engine B's logprobs vs engine A's on A's tokens of the turn where they split.")
    top_delta_tokens: list[DeltaToken] = Field(
        default_factory=list, max_length=MAX_ITEMS, description="The largest-|Δ| tokens of the split turn up to the split point.")


class Interval(Record):
    """A mean with its bootstrap 95% interval over n trajectories."""

    mean: float | None
    lo: float | None
    hi: float | None
    n: Count


class MatrixCell(Record):
    """One (rollout engine, trainer engine) tile."""

    rollout_engine: Name
    trainer_engine: Name
    n: Count = Field(description="Trajectories in the cell.")
    tokens: int = Field(ge=0, le=2**63 - 1, description="Action tokens over all of them.")
    token_ess: Interval
    sequence_ess: float | None = Field(description="Sequence ESS over the cell's trajectories (one number).")
    mean_abs_delta: Interval
    max_abs_delta: float | None
    kl_k3: Interval
    mean_prob_diff: Interval
    router_flip_rate: Interval | None = None
    token_expert_disagreement_rate: Interval | None = None
    worst_layer: int | None = Field(default=None, ge=0, le=MAX_LAYERS)
    worst_layer_flip_rate: float | None = None
    worst_token: WorstToken | None = None
    worst_trajectory_id: Key | None = None
    low_n: bool = Field(description="True when n < 30: the tile says so.")
    rollout_corr: RolloutCorrFigures | None = Field(
        default=None, description="verl's rollout_corr figures with the cell's trajectories as the batch (C = 2, token).")
    router_replay: bool = Field(
        default=False, description="The trainer engine replayed the rollout's routed experts (R3, `<engine>+replay`): "
                                   "its router flips are zero by construction; the cell beside it is the same engine "
                                   "routing by itself.")
    absent: Message | None = Field(
        default=None, description="Why the cell has no numbers (n = 0): e.g. a replay cell whose rollout engine "
                                  "returned no routed experts.")


class LengthPoint(Record):
    """ESS and |Δ| of one cell over trajectories whose response length falls in one bucket.

    Token ESS per trajectory falls with length even when every token drifts alike (a small-sample
    effect); `PositionProfile` is the per-token view that separates the two."""

    rollout_engine: Name
    trainer_engine: Name
    max_tokens: TokenCount = Field(description="The length target (a --lengths value) the trajectories were sampled with.")
    mean_response_tokens: float = Field(description="Sampled tokens per probe, those after an EOS included.")
    token_ess: Interval
    mean_abs_delta: Interval
    mean_valid_tokens: float | None = Field(
        default=None, description="Tokens per probe the statistics cover: up to and including the first EOS.")
    tokens_after_eos: Count = Field(
        default=0, description="Tokens sampled past an EOS (ignore_eos) over the probes, excluded from every figure.")


class PositionBucket(Record):
    """Per-token mismatch at response positions [start, stop), pooled over trajectories."""

    start: Count
    stop: Count
    n_tokens: Count = Field(description="Valid tokens at these positions over all trajectories.")
    n_trajectories: Count = Field(description="Trajectories with a valid token here.")
    mean_abs_delta: float = Field(description="mean |Δ| over those tokens.")
    kl_k3: float = Field(description="mean(r − log r − 1), r = exp(clip(Δ, ±20)), over those tokens.")


class PositionProfile(Record):
    """|Δ| and k3 by response position for one cell's length probes (buckets [0, 16), then doubling)."""

    rollout_engine: Name
    trainer_engine: Name
    n_trajectories: Count
    tokens_after_eos: Count = Field(description="Tokens past an EOS, excluded from the buckets.")
    buckets: list[PositionBucket] = Field(max_length=64)


class ObservatoryMatrix(Record):
    """matrix.json of an observatory run."""

    model: Key
    suite: Name | None = None
    rollout_engines: list[Name] = Field(max_length=MAX_ITEMS)
    trainer_engines: list[Name] = Field(max_length=MAX_ITEMS)
    cells: list[MatrixCell] = Field(max_length=MAX_ITEMS)
    length_scaling: list[LengthPoint] = Field(default_factory=list, max_length=MAX_ITEMS)
    position_scaling: list[PositionProfile] = Field(default_factory=list, max_length=MAX_ITEMS)
    divergence: list[AgentDivergenceReport] = Field(default_factory=list, max_length=MAX_ITEMS)
    created_at: Name
