"""How every sampling seed is derived: one rule, so that the same task gets the same draws wherever
it is sampled.

    task_seed(base, task_id)           collect, observe and eval: a task's runs under a base seed.
                                       The same (base, task) gives the same seed in all three, in
                                       any order, on any subset of tasks, after any resume.
    task_seed(base, task_id, draw)     training, which samples a task many times: `draw` is the
                                       job's index in the run, so each group gets its own draws and
                                       a resumed run enqueues the very same jobs.
    job_seed(job_id)                   a worker given a job without a seed: every worker that runs
                                       the job samples it alike.
    turn_seed(seed, sample, turn)      inside a run: each sample of a group and each of its model
                                       turns draws from its own seed.

All are below 2**31 (a seed every engine accepts).
"""

from __future__ import annotations

import hashlib


def _hash31(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") % 2**31


def task_seed(base: int, task_id: str, draw: int = 0) -> int:
    """The seed of a task's runs: a hash of the base seed, the task id and which draw of it this is."""
    return _hash31(f"task:{base}:{task_id}:{draw}")


def job_seed(job_id: str) -> int:
    """A job without a seed still samples the same way on every worker that runs it."""
    return _hash31(f"job:{job_id}")


def turn_seed(seed: int | None, sample_index: int, turn: int) -> int | None:
    """The seed of one model turn of one sample: distinct per sample and per turn, the same on every
    rerun; None (unseeded) stays None."""
    if seed is None:
        return None
    return (seed * 1_000_003 + sample_index * 1_009 + turn) % 2**31
