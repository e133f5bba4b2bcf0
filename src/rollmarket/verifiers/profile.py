"""Reward profiles of agent runs: pass@k, majority@k and reward statistics, per task and overall.

pass@k (Chen et al. 2021, unbiased): the chance that at least one of k samples drawn without
replacement from a task's n samples (c of them correct) is correct,

    pass@k = 1 - C(n-c, k) / C(n, k) = 1 - prod_{i=n-c+1}^{n} (1 - k/i)

computed as that product (no huge binomials). None when n < k: there is no such draw.

majority@k: the chance that a majority vote over k samples drawn without replacement is right.
Each sample votes with its key: the verifier's `info["canonical"]`, else its normalized final
answer; a sample with neither abstains. The most frequent key wins; a tie is broken uniformly at
random among the tied keys; the vote is right with the probability that a drawn sample with the
winning key passed (for a verifier whose key decides correctness, simply: the key is right). A
draw where every sample abstains is wrong. Computed exactly over the counts drawn from each key
(multivariate hypergeometric) while that is at most `EXACT_LIMIT` cases, else by seeded Monte Carlo
over `MC_DRAWS` draws. None when n < k.

Correct means `verification.passed`; a run with no verification counts as wrong with reward 0.

The overall pass@k carries a 95% percentile-bootstrap interval over tasks (`INTERVAL_RESAMPLES`
resamples of the tasks with n >= k, seeded): how much the average would move on another draw of
tasks like these, with these samples. It says nothing about another seed or another training run
(docs/statistics.md). Fewer than `MIN_SAMPLES_PER_TASK` samples per task are too few for a claim.
"""

from __future__ import annotations

import json
import math
import random
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from pydantic import Field, ValidationError

from ..contracts import AgentTrajectory, Interval, Record
from ..tasks.answers import normalize

KS = (1, 4, 16)
EXACT_LIMIT = 20_000
"""Most count vectors majority@k enumerates; past this it estimates by Monte Carlo."""
EXACT_MAX_KEYS = 64
"""Tasks with more distinct vote keys than this go straight to Monte Carlo."""
MC_DRAWS = 10_000
INTERVAL_RESAMPLES = 2000
"""Bootstrap resamples (over tasks) of the overall pass@k interval."""
MIN_SAMPLES_PER_TASK = 16
"""Samples per task below which the profile warns: too few for any claim (docs/statistics.md)."""


def pass_at_k(n: int, c: int, k: int) -> float | None:
    """Unbiased pass@k of a task with n samples, c correct; None when n < k."""
    if k < 1 or n < 0 or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs k >= 1 and 0 <= c <= n (got n={n}, c={c}, k={k})")
    if n < k:
        return None
    if n - c < k:
        return 1.0
    miss = 1.0
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def _vote(counts: Sequence[int], rates: Sequence[float]) -> float:
    """The value of one draw: counts[g] samples from key group g (group 0 abstains)."""
    top = max(counts[1:], default=0)
    if top == 0:
        return 0.0
    winners = [rates[g] for g in range(1, len(counts)) if counts[g] == top]
    return sum(winners) / len(winners)


def majority_at_k(keys: Sequence[str | None], passed: Sequence[bool], k: int, *, seed: int = 0) -> float | None:
    """majority@k of one task's samples (their vote keys, None = abstain, and correctness); None when n < k."""
    if len(keys) != len(passed):
        raise ValueError("keys and passed must have the same length")
    n = len(keys)
    if k < 1:
        raise ValueError("k must be >= 1")
    if n < k:
        return None
    members: dict[str | None, list[bool]] = {None: []}
    for key, ok in zip(keys, passed):
        members.setdefault(key, []).append(bool(ok))
    groups = [members.pop(None), *sorted(members.values(), key=len, reverse=True)]
    sizes = [len(g) for g in groups]
    rates = [sum(g) / len(g) if g else 0.0 for g in groups]
    exact = _exact_majority(sizes, rates, k)
    if exact is not None:
        return exact
    return _sampled_majority(sizes, rates, k, seed)


def _exact_majority(sizes: list[int], rates: list[float], k: int) -> float | None:
    """Σ over count vectors of Π C(size_g, count_g) * vote / C(n, k); None past EXACT_LIMIT vectors."""
    if len(sizes) > EXACT_MAX_KEYS + 1 or _count_vectors(sizes, k) > EXACT_LIMIT:
        return None
    suffix = [0] * (len(sizes) + 1)
    for g in range(len(sizes) - 1, -1, -1):
        suffix[g] = suffix[g + 1] + sizes[g]
    counts = [0] * len(sizes)
    total = 0.0

    def walk(g: int, left: int, weight: int) -> None:
        nonlocal total
        if g == len(sizes):
            total += weight * _vote(counts, rates)
            return
        for c in range(max(0, left - suffix[g + 1]), min(sizes[g], left) + 1):
            counts[g] = c
            walk(g + 1, left - c, weight * math.comb(sizes[g], c))
        counts[g] = 0

    walk(0, k, 1)
    return total / math.comb(sum(sizes), k)


def _count_vectors(sizes: list[int], k: int) -> int:
    """How many count vectors (c_g <= size_g, sum k) there are: a small dynamic program."""
    ways = [1] + [0] * k
    for size in sizes:
        ways = [sum(ways[t - c] for c in range(min(size, t) + 1)) for t in range(k + 1)]
    return ways[k]


def _sampled_majority(sizes: list[int], rates: list[float], k: int, seed: int) -> float:
    labels = [g for g, size in enumerate(sizes) for _ in range(size)]
    rng = random.Random(seed)
    total = 0.0
    for _ in range(MC_DRAWS):
        drawn = Counter(g for g in rng.sample(labels, k) if g != 0)
        if not drawn:
            continue
        top = max(drawn.values())
        winners = [rates[g] for g, count in drawn.items() if count == top]
        total += sum(winners) / len(winners)
    return total / MC_DRAWS


def vote_key(run: AgentTrajectory) -> str | None:
    """What a run votes for: the verifier's canonical answer, else its normalized final answer."""
    if run.verification is not None:
        key = run.verification.info.get("canonical")
        if key is not None:
            return str(key)
    if run.final_answer and run.final_answer.strip():
        return normalize(run.final_answer) or None
    return None


def reward_stats(rewards: Sequence[float]) -> dict[str, float | None]:
    """reward_mean, reward_median, reward_std (population), reward_min, reward_max; None when empty."""
    if not rewards:
        return dict.fromkeys(("reward_mean", "reward_median", "reward_std", "reward_min", "reward_max"))
    return {"reward_mean": statistics.fmean(rewards), "reward_median": statistics.median(rewards),
            "reward_std": statistics.pstdev(rewards), "reward_min": min(rewards), "reward_max": max(rewards)}


class _Rewards(Record):
    reward_mean: float | None = Field(default=None, description="Mean reward; None with no samples.")
    reward_median: float | None = Field(default=None, description="Median reward.")
    reward_std: float | None = Field(default=None, description="Population standard deviation of the reward.")
    reward_min: float | None = None
    reward_max: float | None = None


class TaskProfile(_Rewards):
    """One task's samples."""

    task_id: str
    n: int = Field(description="Samples of this task.")
    correct: int = Field(description="Samples whose verification passed.")
    pass_at_k: dict[int, float | None] = Field(description="Unbiased pass@k per k; None when n < k.")
    majority_at_k: dict[int, float | None] = Field(description="majority@k per k; None when n < k.")
    distinct_answers: int = Field(description="Distinct vote keys among the samples (abstentions not counted).")
    terminal_reasons: dict[str, int] = Field(description="How the task's runs ended, counted.")


class GlobalProfile(_Rewards):
    """All tasks together; the reward statistics are over every sample (a micro average)."""

    tasks: int
    samples: int
    correct: int
    unverified: int = Field(description="Runs with no verification (counted as wrong, reward 0).")
    pass_at_k: dict[int, float | None] = Field(
        description="Macro average over tasks with n >= k of their pass@k; None when no task has k samples.")
    majority_at_k: dict[int, float | None] = Field(description="Macro average over tasks with n >= k of majority@k.")
    tasks_at_k: dict[int, int] = Field(description="How many tasks entered each k's averages (those with n >= k).")
    pass_at_k_interval: dict[int, Interval | None] = Field(
        default_factory=dict, description="pass@k with its 95% percentile-bootstrap interval over those tasks "
                                          "(2000 resamples of the tasks); None when no task has k samples.")
    samples_per_task_min: int | None = Field(
        default=None, description="The fewest samples of any task (>= 16 for any claim); None with no tasks.")
    terminal_reasons: dict[str, int] = Field(description="How the runs ended, counted.")


class ProfileReport(Record):
    """What `rollmarket profile` writes: the global profile and one row per task."""

    source: str | None = Field(default=None, description="The rollouts file profiled.")
    ks: list[int]
    skipped_lines: int = Field(default=0, description="Input lines that were not an AgentTrajectory.")
    overall: GlobalProfile
    tasks: list[TaskProfile]


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _task_interval(values: list[float | None], seed: int) -> Interval | None:
    """The mean over tasks with its percentile-bootstrap interval (tasks resampled); None entries
    (tasks with n < k) left out; None when none is left."""
    from ..observatory.stats import bootstrap_interval

    kept = [v for v in values if v is not None]
    return bootstrap_interval(kept, n_resamples=INTERVAL_RESAMPLES, seed=seed) if kept else None


def profile_rollouts(records: Iterable[AgentTrajectory], *, ks: Sequence[int] = KS, source: str | None = None,
                     skipped_lines: int = 0, seed: int = 0) -> ProfileReport:
    """Per-task and global pass@k, majority@k and reward statistics of agent runs."""
    by_task: dict[str, list[AgentTrajectory]] = {}
    for run in records:
        by_task.setdefault(run.task_id, []).append(run)
    rows: list[TaskProfile] = []
    all_rewards: list[float] = []
    reasons: Counter[str] = Counter()
    unverified = 0
    for task_id in sorted(by_task):
        runs = sorted(by_task[task_id], key=lambda r: r.sample_index)
        passed = [r.verification is not None and r.verification.passed for r in runs]
        keys = [vote_key(r) for r in runs]
        rewards = [float(r.reward) for r in runs]
        task_reasons = Counter(r.terminal_reason.value for r in runs)
        n, c = len(runs), sum(passed)
        rows.append(TaskProfile(
            task_id=task_id, n=n, correct=c,
            pass_at_k={k: pass_at_k(n, c, k) for k in ks},
            majority_at_k={k: majority_at_k(keys, passed, k, seed=seed) for k in ks},
            distinct_answers=len({key for key in keys if key is not None}),
            terminal_reasons=dict(sorted(task_reasons.items())), **reward_stats(rewards),
        ))
        all_rewards += rewards
        reasons += task_reasons
        unverified += sum(r.verification is None for r in runs)
    overall = GlobalProfile(
        tasks=len(rows), samples=len(all_rewards), correct=sum(r.correct for r in rows), unverified=unverified,
        pass_at_k={k: _mean([r.pass_at_k[k] for r in rows if r.pass_at_k[k] is not None]) for k in ks},
        majority_at_k={k: _mean([r.majority_at_k[k] for r in rows if r.majority_at_k[k] is not None]) for k in ks},
        tasks_at_k={k: sum(r.n >= k for r in rows) for k in ks},
        pass_at_k_interval={k: _task_interval([r.pass_at_k[k] for r in rows], seed) for k in ks},
        samples_per_task_min=min((r.n for r in rows), default=None),
        terminal_reasons=dict(sorted(reasons.items())), **reward_stats(all_rewards),
    )
    return ProfileReport(source=source, ks=list(ks), skipped_lines=skipped_lines, overall=overall, tasks=rows)


def read_rollouts(path: str | Path) -> tuple[list[AgentTrajectory], list[str]]:
    """The runs in a JSONL file (one `AgentTrajectory.model_dump_json()` per line) and a note per
    line that is not one (a truncated last line after a crash, say); blank lines are ignored."""
    runs: list[AgentTrajectory] = []
    problems: list[str] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                runs.append(AgentTrajectory.model_validate_json(line))
            except (ValidationError, ValueError) as exc:
                first = exc.errors()[0]["msg"] if isinstance(exc, ValidationError) and exc.errors() else str(exc)
                problems.append(f"line {number}: {first[:200]}")
    return runs, problems


def report_json(report: ProfileReport) -> str:
    """The report as indented JSON (what `rollmarket profile` writes)."""
    return json.dumps(report.model_dump(mode="json"), indent=2) + "\n"
