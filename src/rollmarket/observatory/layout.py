"""The files of an observatory run, which the dashboard reads (files are the source of truth).

    runs/<UTC stamp>-<id>/
        config.json                               ObserveSettings as run, code version (observe.json
                                                  when the observatory runs inside another run's
                                                  directory, such as a demo's, whose config.json it keeps)
        matrix.json                               ObservatoryMatrix: tiles, length scaling, divergence
        trajectories/<rollout>.jsonl              AgentTrajectory per line (the agent runs)
        reports/<rollout>__<trainer>.dense.jsonl  DenseMismatchReport per line
        reports/<rollout>__<trainer>.router.jsonl RouterMismatchReport per line (MoE models)
        viewer/<rollout>.jsonl                    TrajectoryView per line: what the trajectory page shows
        divergence.jsonl                          AgentDivergenceReport per line

A directory with a matrix.json is an observatory run; the dashboard lists every such directory
under --runs. Engine names are profile names such as `fp8` (rollout) and `fp32`, `bf16`,
`fsdp-bf16` (trainer); they are safe in file names.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from ..contracts import Record

MATRIX = "matrix.json"
CONFIG = "config.json"
EMBEDDED_CONFIG = "observe.json"
"""The observatory's settings in a directory that holds another run (whose config.json stays its own)."""
DIVERGENCE = "divergence.jsonl"


def trajectory_id(task_id: str, sample_index: int, max_tokens: int | None = None) -> str:
    """'<task_id>#<sample>' for agent runs; '<task_id>#<sample>@<max_tokens>' for length probes."""
    base = f"{task_id}#{sample_index}"
    return base if max_tokens is None else f"{base}@{max_tokens}"


def pair(rollout: str, trainer: str) -> str:
    return f"{rollout}__{trainer}"


def trajectories_path(run: Path, rollout: str) -> Path:
    return run / "trajectories" / f"{rollout}.jsonl"


def dense_path(run: Path, rollout: str, trainer: str) -> Path:
    return run / "reports" / f"{pair(rollout, trainer)}.dense.jsonl"


def router_path(run: Path, rollout: str, trainer: str) -> Path:
    return run / "reports" / f"{pair(rollout, trainer)}.router.jsonl"


def viewer_path(run: Path, rollout: str) -> Path:
    return run / "viewer" / f"{rollout}.jsonl"


class ViewToolCall(Record):
    name: str
    arguments: str = Field(description="As the model wrote them.")
    result: str
    outcome: str


class ViewTurn(Record):
    """One assistant turn: what came before it, its tokens, and each engine's logprob of them."""

    index: int
    new_messages: list[dict] = Field(
        description="Messages added since the previous turn (the prompt for turn 0; tool results after).")
    tokens: list[str] = Field(description="Decoded text of each response token (special tokens shown).")
    token_ids: list[int]
    rollout_logprobs: list[float]
    trainer_logprobs: dict[str, list[float]] = Field(
        description="Trainer engine name -> its logprob of each token (teacher forcing the stitched run).")
    content: str
    tool_calls: list[ViewToolCall] = Field(default_factory=list)
    finish_reason: str


class TrajectoryView(Record):
    """One agent run as the trajectory viewer shows it."""

    trajectory_id: str
    task_id: str
    rollout_engine: str
    prompt: str = Field(description="The user's question.")
    turns: list[ViewTurn]
    final_answer: str | None
    terminal_reason: str
    reward: float | None
    expected: str | None = None
