"""Collecting rollouts: every task K times against one model, one AgentTrajectory JSON line per run.

Resumable: runs already in the output file (by task id and sample index) are skipped, so an
interrupted collection continues where it stopped and a finished one is a no-op. Runs the model
server failed (model_error, aborted) go to the failures file instead and are retried next time.
Each (task, sample) has its own seed, so a resumed collection samples what the first would have.

`run_tasks` (runs as they finish) and `run_grouped` (runs per task, in order) are the one way the
project runs an agent over many tasks: collect, the observatory's agent runs, a training run's
evals and the reference trainer's groups all go through them, so all seed a task by the one rule
(contracts/seeds.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

from ..contracts import AgentTrajectory, TaskSpec, TerminalReason
from ..contracts.seeds import task_seed
from .loop import Agent
from .model import Sampling

FAILED = (TerminalReason.model_error, TerminalReason.aborted)


@dataclass
class CollectStats:
    planned: int = 0
    skipped: int = 0
    done: int = 0
    failed: int = 0
    passed: int = 0
    reward_sum: float = 0.0

    @property
    def pass_rate(self) -> float | None:
        return self.passed / self.done if self.done else None


def run_tasks(agent: Agent, items: Sequence[tuple[TaskSpec, int]], sampling: Sampling, *, concurrency: int,
              draws: Sequence[int] | None = None) -> Iterator[tuple[int, AgentTrajectory]]:
    """Run the agent on each (task, sample index) of ``items``, ``concurrency`` at a time; yield
    (position in ``items``, run) as each finishes.

    Every run is seeded by the seed rule: ``task_seed(sampling.seed or 0, task id, draw)``, with
    ``draws[position]`` (default 0) telling repeated draws of one task apart (training); the
    sample index then gives each sample its own turns' seeds (``turn_seed``). At most twice
    ``concurrency`` runs are submitted ahead of the consumer."""
    base = sampling.seed or 0

    def one(position: int) -> tuple[int, AgentTrajectory]:
        task, index = items[position]
        seed = task_seed(base, task.task_id, draws[position] if draws is not None else 0)
        return position, agent.run(task, replace(sampling, seed=seed), sample_index=index)

    width = max(1, concurrency)
    with ThreadPoolExecutor(width, thread_name_prefix="agent-runs") as pool:
        queue = iter(range(len(items)))
        pending = {pool.submit(one, p) for p in (next(queue, None) for _ in range(2 * width)) if p is not None}
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                yield future.result()
                position = next(queue, None)
                if position is not None:
                    pending.add(pool.submit(one, position))


def run_grouped(agent: Agent, tasks: Sequence[TaskSpec], samples: int, sampling: Sampling, *, concurrency: int,
                draws: Sequence[int] | None = None,
                on_run: Callable[[int, int], None] | None = None) -> list[list[AgentTrajectory]]:
    """``samples`` runs of each task (``run_tasks``), per task in sample order. ``draws``: one per
    task (its draw in the seed rule); ``on_run(done, total)`` after each run finishes."""
    items = [(task, index) for task in tasks for index in range(samples)]
    per_item = None if draws is None else [draws[i] for i, _ in enumerate(tasks) for _ in range(samples)]
    runs: list[AgentTrajectory | None] = [None] * len(items)
    for done, (position, run) in enumerate(run_tasks(agent, items, sampling, concurrency=concurrency,
                                                     draws=per_item), start=1):
        runs[position] = run
        if on_run is not None:
            on_run(done, len(items))
    complete = [run for run in runs if run is not None]
    assert len(complete) == len(items)  # run_tasks yields every item once
    return [complete[i * samples:(i + 1) * samples] for i in range(len(tasks))]


def done_runs(path: Path) -> set[tuple[str, int]]:
    """(task_id, sample_index) of every complete line in an existing rollouts file."""
    done: set[tuple[str, int]] = set()
    if not path.exists():
        return done
    with open(path) as handle:
        for line in handle:
            try:
                data = json.loads(line)
                done.add((data["task_id"], int(data["sample_index"])))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut by a crash: that run is redone
    return done


def _truncate_partial_line(path: Path) -> None:
    # A crash mid-write leaves a last line without its newline; drop it so appends stay valid JSONL.
    if not path.exists() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if not data.endswith(b"\n"):
        path.write_bytes(data[: data.rfind(b"\n") + 1])


def collect(agent: Agent, tasks: Iterable[TaskSpec], *, repeats: int, out: Path, failures: Path,
            sampling: Sampling, concurrency: int = 4,
            on_run: Callable[[AgentTrajectory, CollectStats], None] | None = None) -> CollectStats:
    """Run every task `repeats` times; append runs to `out` and failed runs to `failures`."""
    tasks = list(tasks)
    out.parent.mkdir(parents=True, exist_ok=True)
    failures.parent.mkdir(parents=True, exist_ok=True)
    _truncate_partial_line(out)
    already = done_runs(out)
    stats = CollectStats()
    todo = []
    for task in tasks:
        for index in range(repeats):
            stats.planned += 1
            if (task.task_id, index) in already:
                stats.skipped += 1
            else:
                todo.append((task, index))
    with open(out, "a", buffering=1) as out_file, open(failures, "a", buffering=1) as fail_file:
        for _, run in run_tasks(agent, todo, sampling, concurrency=concurrency):
            if run.terminal_reason in FAILED:
                stats.failed += 1
                fail_file.write(run.model_dump_json() + "\n")
            else:
                stats.done += 1
                stats.passed += bool(run.verification and run.verification.passed)
                stats.reward_sum += run.reward
                out_file.write(run.model_dump_json() + "\n")
            if on_run is not None:
                on_run(run, stats)
    return stats
