"""Where two agent runs of the same task (same seeds, two rollout engines) part ways.

Turns are walked in order. At turn i:

    tool_choice   the sequences of tool names differ
    tool_args     the names agree but the arguments differ (canonical JSON of the parsed
                  arguments; the raw string when they did not parse)
    content       neither turn called a tool and the normalized texts differ
    termination   everything agreed up to the shorter run, but one run has more turns or the
                  runs stopped for different reasons
    none          the runs are the same turn for turn

Beside the first divergent turn: the share of aligned turns whose tool names differ, the Jaccard
of the (tool name, sha256 of canonical arguments) sets, and whether the final answers match
(strictly: equal after `tasks.answers.normalize`; softly: that, or numerically equal within 1e-6
relative, as the numeric verifier judges).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..contracts import (
    AgentDivergenceReport,
    AgentStep,
    AgentTrajectory,
    DeltaToken,
    DenseMismatchReport,
    DivergenceKind,
    ToolCallRecord,
    canonical_json,
)
from ..tasks.answers import check_answer, normalize


@dataclass(frozen=True, slots=True)
class DivergenceSummary:
    """How two runs of one task compare."""

    first_divergent_step: int | None
    """The first turn where the runs differ; None when they never do."""
    kind: DivergenceKind
    tool_choice_disagreement_rate: float
    """Share of aligned turns (the shorter run's) whose tool-name sequences differ; 0.0 for none."""
    tool_call_jaccard: float
    """|A∩B| / |A∪B| of the (name, argument hash) sets; 1.0 when neither run called a tool."""
    final_answer_match_strict: bool
    final_answer_match_soft: bool
    steps_a: int
    steps_b: int


def canonical_arguments(call: ToolCallRecord) -> str:
    """The arguments as canonical JSON when they parsed, else exactly as the model wrote them."""
    if call.arguments is not None:
        try:
            return canonical_json(call.arguments).decode()
        except ValueError:  # NaN or infinity inside: compare the raw text instead
            pass
    return call.raw_arguments


def _tool_names(step: AgentStep) -> list[str]:
    return [call.name for call in step.tool_calls]


def _turn_divergence(a: AgentStep, b: AgentStep) -> DivergenceKind:
    if _tool_names(a) != _tool_names(b):
        return DivergenceKind.tool_choice
    if [canonical_arguments(c) for c in a.tool_calls] != [canonical_arguments(c) for c in b.tool_calls]:
        return DivergenceKind.tool_args
    if not a.tool_calls and normalize(a.content) != normalize(b.content):
        return DivergenceKind.content
    return DivergenceKind.none


def _call_set(trajectory: AgentTrajectory) -> set[tuple[str, str]]:
    return {(call.name, hashlib.sha256(canonical_arguments(call).encode()).hexdigest())
            for call in trajectory.tool_calls}


def _answers_match(a: str | None, b: str | None, verifier: str) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return check_answer(verifier, a, b)


def trajectory_divergence(a: AgentTrajectory, b: AgentTrajectory) -> DivergenceSummary:
    """Compare run `a` with run `b` of the same task (see the module docstring)."""
    aligned = min(len(a.steps), len(b.steps))
    first, kind = None, DivergenceKind.none
    for index in range(aligned):
        kind = _turn_divergence(a.steps[index], b.steps[index])
        if kind is not DivergenceKind.none:
            first = index
            break
    else:
        if len(a.steps) != len(b.steps):
            first, kind = aligned, DivergenceKind.termination
        elif a.terminal_reason != b.terminal_reason:
            first, kind = max(aligned - 1, 0), DivergenceKind.termination

    name_flips = sum(_tool_names(a.steps[i]) != _tool_names(b.steps[i]) for i in range(aligned))
    calls_a, calls_b = _call_set(a), _call_set(b)
    union = calls_a | calls_b
    strict = _answers_match(a.final_answer, b.final_answer, "exact")
    return DivergenceSummary(
        first_divergent_step=first,
        kind=kind,
        tool_choice_disagreement_rate=name_flips / aligned if aligned else 0.0,
        tool_call_jaccard=len(calls_a & calls_b) / len(union) if union else 1.0,
        final_answer_match_strict=strict,
        final_answer_match_soft=strict or _answers_match(a.final_answer, b.final_answer, "numeric"),
        steps_a=len(a.steps),
        steps_b=len(b.steps),
    )


def first_token_split(tokens_a: Sequence[int], tokens_b: Sequence[int]) -> int | None:
    """The first index where two token-id sequences differ (the shorter length when one is a
    prefix of the other), or None when they are equal."""
    a_T, b_T = np.asarray(tokens_a), np.asarray(tokens_b)
    aligned = min(a_T.shape[0], b_T.shape[0])
    differ = np.flatnonzero(a_T[:aligned] != b_T[:aligned])
    if differ.size:
        return int(differ[0])
    return None if a_T.shape[0] == b_T.shape[0] else aligned


def to_report(
    summary: DivergenceSummary,
    *,
    task_id: str,
    engine_a: str,
    engine_b: str,
    sample_index: int = 0,
    split_turn: DenseMismatchReport | None = None,
    top_delta_tokens: Sequence[DeltaToken] = (),
) -> AgentDivergenceReport:
    """The AgentDivergenceReport of one pair of runs from its summary."""
    s = summary
    return AgentDivergenceReport(
        task_id=task_id, sample_index=sample_index, engine_a=engine_a, engine_b=engine_b,
        first_divergent_step=s.first_divergent_step, kind=s.kind,
        tool_choice_disagreement_rate=s.tool_choice_disagreement_rate,
        tool_call_jaccard=s.tool_call_jaccard, final_answer_match_strict=s.final_answer_match_strict,
        final_answer_match_soft=s.final_answer_match_soft, steps_a=s.steps_a, steps_b=s.steps_b,
        split_turn=split_turn, top_delta_tokens=list(top_delta_tokens),
    )
