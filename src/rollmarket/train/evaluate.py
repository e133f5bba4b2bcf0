"""Held-out evaluation of the policy being trained: the trainer's own weights behind the agent loop.

    eval/accuracy/mean    share of held-out tasks solved at temperature 0
    eval/pass@k           unbiased pass@k (Chen et al. 2021) from `samples` runs per task at
                          the evaluation temperature, for k = 1, 2, 4 … ≤ samples
    eval/reward/mean      mean reward of the sampled runs

The model is served on a loopback port with `serve-model`'s app for the duration of the call, so
the evaluation runs the same agent, tools and verifiers as the workers.
"""

from __future__ import annotations

from dataclasses import replace

from ..agents import Agent, AgentSettings, ChatModel, LocalToolbox, Sampling
from ..agents.collect import run_grouped
from ..contracts import TaskSpec
from ..engines import RolloutEngine
from ..verifiers import verify_trajectory
from ..verifiers.profile import pass_at_k

MAX_IN_FLIGHT = 128
"""Agent runs in flight at once (threads). The server batches at most 64 sequences, so more only
queue; ChatModel itself holds calls beyond its connection pool (at 512 runs an evaluation once
slowed ~7x and lost runs to transport errors, 2026-11-26). Every run has its own seed: this sets the
speed, not the samples."""


def _passed(run) -> bool:
    return bool(run.verification and run.verification.passed)


def evaluate_policy(learner, tasks: list[TaskSpec], *, samples: int, temperature: float, max_tokens: int,
                    max_turns: int, seed: int = 0) -> tuple[dict[str, float], list[dict]]:
    """The eval/* metrics and one row per task (greedy pass, sampled passes: for paired statistics)."""
    from .reference import serve_in_process  # the reference loop's loopback server

    if not tasks:
        return {}, []
    engine = RolloutEngine(replace(learner.loaded, model=learner.model.eval()))
    with serve_in_process(engine) as url:
        agent = Agent(ChatModel(url), LocalToolbox(), AgentSettings(max_steps=max_turns), verify=verify_trajectory)
        greedy_runs = [runs[0] for runs in run_grouped(
            agent, tasks, 1, Sampling(temperature=0.0, max_tokens=max_tokens, seed=0), concurrency=MAX_IN_FLIGHT)]
        sampled = run_grouped(agent, tasks, samples, Sampling(temperature=temperature, max_tokens=max_tokens,
                                                              seed=seed), concurrency=MAX_IN_FLIGHT)
    out = {"eval/accuracy/mean": sum(map(_passed, greedy_runs)) / len(tasks)}
    k = 1
    while k <= samples:
        values = [pass_at_k(len(runs), sum(map(_passed, runs)), k) for runs in sampled]
        out[f"eval/pass@{k}"] = sum(v for v in values if v is not None) / len(values)
        k *= 2
    rewards = [r.reward for runs in sampled for r in runs]
    out["eval/reward/mean"] = sum(rewards) / len(rewards)
    out["eval/tasks"] = len(tasks)
    per_task = [{"task_id": task.task_id, "greedy_passed": _passed(g), "sampled_passed": [_passed(r) for r in runs],
                 "sampled_rewards": [r.reward for r in runs]}
                for task, g, runs in zip(tasks, greedy_runs, sampled)]
    return out, per_task
