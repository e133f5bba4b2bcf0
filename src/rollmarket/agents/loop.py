"""The agent loop: call the model, run the tools it asks for, feed the results back, until it answers.

    messages = task prompt
    for step in range(max_steps):
        turn = model(messages, tools)              # keeps prompt ids, response ids, logprobs, experts
        if turn hit max_tokens:  stop (length)
        if no tool calls:        stop (final_answer)
        for call in turn.tool_calls:
            result = tool(call)                    # a failure is a tool message, never a crash
            messages += tool message(result)
    stop (max_steps)

Model failures end the run with `model_error`; nothing in here raises for what a model or a tool
does. The training view of a run (one token sequence with masks) is built from the ids kept
here by `agents.stitch`, never by tokenizing text again.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..contracts import (
    AgentStep,
    AgentTrajectory,
    TaskSpec,
    TerminalReason,
    ToolCallRecord,
    VerifyResult,
)
from ..contracts.seeds import turn_seed
from .model import ChatModel, ModelCallError, ModelTurn, Sampling
from .toolbox import LocalToolbox, Toolbox, parse_arguments

log = logging.getLogger(__name__)

Verify = Callable[[TaskSpec, AgentTrajectory], VerifyResult]


@dataclass(frozen=True)
class AgentSettings:
    max_steps: int = 6
    """Model turns per run; a run still calling tools after this many ends with max_steps."""
    require_token_ids: bool = True
    """End a run with model_error when the server returns no token ids (training needs them)."""


def task_messages(task: TaskSpec) -> list[dict]:
    return [dict(m) for m in task.messages] if task.messages else [{"role": "user", "content": task.prompt}]


class Agent:
    """Runs tasks against one chat model with one toolbox; optionally verifies each run."""

    def __init__(self, model: ChatModel, toolbox: Toolbox | None = None, settings: AgentSettings | None = None,
                 verify: Verify | None = None):
        self.model = model
        self.toolbox = toolbox or LocalToolbox()
        self.settings = settings or AgentSettings()
        self.verify = verify

    def run(self, task: TaskSpec, sampling: Sampling, *, sample_index: int = 0,
            should_stop: Callable[[], bool] | None = None) -> AgentTrajectory:
        """One run of `task`. Never raises for model or tool behaviour."""
        started = time.perf_counter()
        messages = task_messages(task)
        tools = self.toolbox.schemas(list(task.tools)) if task.tools else []
        steps: list[AgentStep] = []
        final_answer = None
        error = None
        reason = TerminalReason.max_steps
        with self.toolbox.session(task) as tool_session:
            for index in range(self.settings.max_steps):
                if should_stop is not None and should_stop():
                    reason, error = TerminalReason.aborted, "stopped by the caller"
                    break
                try:
                    turn = self.model.complete(messages, tools, sampling,
                                               seed=turn_seed(sampling.seed, sample_index, index))
                except ModelCallError as exc:
                    reason = TerminalReason.length if exc.context_overflow else TerminalReason.model_error
                    error = str(exc)
                    break
                if self.settings.require_token_ids and (turn.token_ids_R is None or turn.prompt_token_ids_P is None):
                    reason, error = TerminalReason.model_error, "the server returned no token ids (return_token_ids)"
                    break
                calls = []
                if turn.finish_reason != "length":
                    for call in turn.tool_calls:
                        fn = call["function"]
                        result = tool_session.call(fn["name"], fn["arguments"])
                        calls.append(ToolCallRecord(id=call["id"], name=fn["name"], raw_arguments=fn["arguments"],
                                                    arguments=parse_arguments(fn["arguments"]), result=result))
                steps.append(_step(index, turn, calls))
                messages.append(_assistant_message(turn))
                if turn.finish_reason == "length":
                    reason = TerminalReason.length
                    break
                if not calls:
                    reason, final_answer = TerminalReason.final_answer, turn.content
                    break
                messages += [{"role": "tool", "tool_call_id": c.id, "name": c.name, "content": c.result.content}
                             for c in calls]
        trajectory = AgentTrajectory(
            task_id=task.task_id, sample_index=sample_index, seed=sampling.seed, model=self.model.model,
            messages=messages, steps=steps, final_answer=final_answer, terminal_reason=reason, error=error,
            wall_time_s=time.perf_counter() - started,
        )
        if self.verify is not None:
            trajectory = trajectory.model_copy(update={"verification": self.verify(task, trajectory)})
        return trajectory

    def run_group(self, task: TaskSpec, n: int, sampling: Sampling, *, concurrency: int | None = None,
                  should_stop: Callable[[], bool] | None = None) -> list[AgentTrajectory]:
        """`n` runs of one task, concurrently so that the server can batch them; in sample order."""
        workers = max(1, min(n, concurrency or n))
        with ThreadPoolExecutor(workers, thread_name_prefix="agent") as pool:
            futures = [pool.submit(self.run, task, sampling, sample_index=i, should_stop=should_stop)
                       for i in range(n)]
            return [f.result() for f in futures]


def _assistant_message(turn: ModelTurn) -> dict:
    message: dict = {"role": "assistant", "content": turn.content}
    if turn.tool_calls:
        message["tool_calls"] = [dict(c) for c in turn.tool_calls]
    return message


def _step(index: int, turn: ModelTurn, calls: list[ToolCallRecord]) -> AgentStep:
    return AgentStep(
        index=index, prompt_token_ids=turn.prompt_token_ids_P, response_token_ids=turn.token_ids_R,
        logprobs=turn.logprobs_R, routed_experts=turn.routed_experts_RLK, content=turn.content,
        reasoning=turn.reasoning, tool_calls=calls, finish_reason=turn.finish_reason, latency_s=turn.latency_s,
    )
