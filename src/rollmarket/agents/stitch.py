"""The training view of an agent run: one token sequence with masks, stitched from the engine's ids.

Every turn i of a run comes back from the server as a prompt P_i (the whole conversation so far,
tokenized by the engine's chat template) and a response R_i (the sampled ids). When the template
is consistent, each prompt extends the previous context:

    P_{i+1} = P_i + R_i + D_{i+1}

where D_{i+1} is what the template put between the turns: the end of the assistant turn, the tool
results wrapped in their markers, and the next assistant header. The training view is then

    prompt   = P_0
    response = R_0 + D_1 + R_1 + D_2 + ... + R_n
    action_mask      1 on every R_i token, 0 on every D token
    tool_output_mask 1 on every D token (tool output and template glue: not the policy's)
    logprobs         the engine's behaviour logprobs on R tokens, 0 on D tokens
    routed_experts   the engine's experts on R tokens, 0 on D tokens (meaningless: masked out)

All of it is slicing of ids the engine returned; no text is tokenized here. Teacher forcing
`prompt + response` therefore scores every R token in exactly the context the engine sampled it
in, which `tests/test_agents.py` checks against the per-turn logprobs.

When a prompt does NOT extend the previous context (a template that rewrites history, e.g. one
that drops earlier reasoning, or text that tokenizes differently from the sampled ids), the ids
before the break were sampled in a context that no longer exists in the sequence. The view then
starts again at the turn after the last break: that turn's prompt holds the earlier turns as
plain context (not trained on), and the turns from there on are stitched as above. `breaks`
lists the turns where this happened and `first_step` where the view starts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..contracts import AgentStep, AgentTrajectory, FinishReason, TerminalReason, Trajectory


class StitchError(ValueError):
    """The run has no ids to stitch (no turns, or a server that returned no token ids)."""


@dataclass(frozen=True)
class TrainingView:
    prompt_token_ids_P: np.ndarray
    response_token_ids_T: np.ndarray
    logprobs_T: np.ndarray | None
    action_mask_T: np.ndarray
    tool_output_mask_T: np.ndarray
    routed_experts_TLK: np.ndarray | None
    turn_boundaries: list[int]
    """Response offsets where each assistant turn in the view starts."""
    first_step: int
    """Index of the first turn in the view (0 unless the context broke)."""
    breaks: list[int]
    """Turns whose prompt did not extend the context before them."""


def extends(prompt_P: np.ndarray, context_C: np.ndarray) -> bool:
    """True when `prompt_P` starts with `context_C`."""
    return prompt_P.shape[0] >= context_C.shape[0] and bool(np.array_equal(prompt_P[: context_C.shape[0]], context_C))


def _ids(step: AgentStep) -> tuple[np.ndarray, np.ndarray]:
    if step.prompt_token_ids is None or step.response_token_ids is None:
        raise StitchError(f"turn {step.index} has no token ids; the server must return them (return_token_ids)")
    return step.prompt_token_ids, step.response_token_ids


def stitch(steps: list[AgentStep]) -> TrainingView:
    """The training view of a run's turns (see the module docstring)."""
    if not steps:
        raise StitchError("the run has no model turns")
    pairs = [_ids(step) for step in steps]
    breaks = [i for i in range(1, len(pairs))
              if not extends(pairs[i][0], np.concatenate([pairs[i - 1][0], pairs[i - 1][1]]))]
    first = breaks[-1] if breaks else 0
    prompt_P = pairs[first][0]
    pieces, logprobs, actions, experts, boundaries = [], [], [], [], []
    have_logprobs = all(s.logprobs is not None for s in steps[first:])
    have_experts = all(s.routed_experts is not None for s in steps[first:])
    length = 0
    context = prompt_P.shape[0]
    for i in range(first, len(steps)):
        prompt_i, response_i = pairs[i]
        if i > first:
            delta = prompt_i[context:]
            pieces.append(delta)
            actions.append(np.zeros(delta.shape[0], np.uint8))
            if have_logprobs:
                logprobs.append(np.zeros(delta.shape[0], np.float32))
            if have_experts:
                step_experts = steps[i].routed_experts
                assert step_experts is not None  # have_experts: every step has them
                _, layers, k = step_experts.shape
                experts.append(np.zeros((delta.shape[0], layers, k), np.int16))
            length += delta.shape[0]
        boundaries.append(length)
        pieces.append(response_i)
        actions.append(np.ones(response_i.shape[0], np.uint8))
        if have_logprobs:
            logprobs.append(np.asarray(steps[i].logprobs, np.float32))
        if have_experts:
            experts.append(np.asarray(steps[i].routed_experts, np.int16))
        length += response_i.shape[0]
        context = prompt_i.shape[0] + response_i.shape[0]
    action_T = np.concatenate(actions)
    return TrainingView(
        prompt_token_ids_P=prompt_P, response_token_ids_T=np.concatenate(pieces).astype(np.int32),
        logprobs_T=np.concatenate(logprobs) if have_logprobs else None, action_mask_T=action_T,
        tool_output_mask_T=(1 - action_T).astype(np.uint8),
        routed_experts_TLK=np.concatenate(experts) if have_experts else None,
        turn_boundaries=boundaries, first_step=first, breaks=breaks,
    )


FINISH = {
    TerminalReason.final_answer: FinishReason.stop,
    TerminalReason.max_steps: FinishReason.max_steps,
    TerminalReason.length: FinishReason.length,
    TerminalReason.model_error: FinishReason.error,
    TerminalReason.aborted: FinishReason.abort,
}


def to_trajectory(run: AgentTrajectory, sample_index: int | None = None) -> Trajectory:
    """The exchange's Trajectory for one agent run: its training view, reward and finish reason."""
    view = stitch(run.steps)
    verification = run.verification
    return Trajectory(
        sample_index=run.sample_index if sample_index is None else sample_index,
        prompt_token_ids=view.prompt_token_ids_P, response_token_ids=view.response_token_ids_T,
        logprobs=view.logprobs_T, action_mask=view.action_mask_T, tool_output_mask=view.tool_output_mask_T,
        routed_experts=view.routed_experts_TLK,
        reward=0.0 if verification is None else float(verification.reward),
        reward_components={} if verification is None else dict(verification.components),
        turn_boundaries=view.turn_boundaries, finish_reason=FINISH[run.terminal_reason],
    )
