"""Collecting rollouts: every task K times against one model, one AgentTrajectory JSON line per run.

Resumable: runs already in the output file (by task id and sample index) are skipped, so an
interrupted collection continues where it stopped and a finished one is a no-op. Runs the model
server failed (model_error, aborted) go to the failures file instead and are retried next time.
Each (task, sample) has its own seed, so a resumed collection samples what the first would have.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from ..contracts import AgentTrajectory, TaskSpec, TerminalReason
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


def task_seed(base: int, task_id: str) -> int:
    """The seed of a task's runs: the base seed mixed with the task id (stable across resumes)."""
    import hashlib

    return (base * 7_919 + int(hashlib.sha256(task_id.encode()).hexdigest()[:8], 16)) % 2**31


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
    lock = threading.Lock()

    def one(task: TaskSpec, index: int) -> AgentTrajectory:
        seeded = Sampling(**{**sampling.__dict__, "seed": task_seed(sampling.seed or 0, task.task_id)})
        return agent.run(task, seeded, sample_index=index)

    with open(out, "a", buffering=1) as out_file, open(failures, "a", buffering=1) as fail_file, \
            ThreadPoolExecutor(max(1, concurrency), thread_name_prefix="collect") as pool:
        pending = set()
        queue = iter(todo)
        for _ in range(max(1, concurrency) * 2):
            item = next(queue, None)
            if item is not None:
                pending.add(pool.submit(one, *item))
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                run = future.result()
                with lock:
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
                item = next(queue, None)
                if item is not None:
                    pending.add(pool.submit(one, *item))
    return stats
