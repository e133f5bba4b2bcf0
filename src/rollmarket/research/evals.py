"""Evals you can compare: score stored rollouts again with another verifier, and compare two
models' evals on the same tasks with the research workbench's statistics (research/stats.py).

`reverify` re-scores each stored run (its final answer and tool calls) with a local verifier
family or a resources server's `/verify`, several at once, keeping the old verification beside the
new one, and counts where they disagree; `ReverifyJournal` keeps the finished results so that a
rerun after a crash scores only the rest.

`compare_evals` pairs two evals. With one eval a side the unit of replication is the task (each
task's pass@k or mean reward is one number per side), and the per-task differences go through the
same sign-flip test, t interval, TOST, Holm and verdicts as `rollmarket compare` does with seeds;
its intervals say how the mean would move on another draw of tasks like these, nothing about
another training seed. With one eval per training seed a side, the seed is the unit of the
verdicts (tasks nested in it: each seed's mean over the tasks, and the two-way bootstrap that
resamples seeds and tasks), and the per-task comparison is reported beside it (docs/statistics.md).

Library only: the CLI (cli/evals.py) prints and writes.
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..contracts import AgentTrajectory, TaskSpec, VerifyResult
from ..verifiers.profile import MIN_SAMPLES_PER_TASK, ProfileReport, profile_rollouts, read_rollouts
from .stats import (Comparison, StatsError, StatsSettings, TooFewSeeds, UnpairedSeeds, Verdict, _clean, judge,
                    paired_comparison, two_way_bootstrap)


class EvalError(StatsError):
    """Input `rollmarket eval` cannot use; `fix` says what to do instead."""


class UnknownTasks(EvalError):
    """Stored runs of tasks the given task set does not have."""


class JournalMismatch(EvalError):
    """A reverify journal that is not of this work (other rollouts, tasks or verifier) or is damaged."""


class NoCommonTasks(EvalError):
    """The two sides of a comparison share fewer than 2 tasks."""


# ---------------------------------------------------------------------------------------------
# Reverify


@dataclass(frozen=True)
class Rescored:
    """One stored run scored again: the old and the new reward side by side."""

    task_id: str
    sample_index: int
    old_reward: float
    old_passed: bool | None
    """None when the stored run had no verification."""
    new_reward: float
    new_passed: bool
    new_why: str | None


@dataclass
class ReverifyReport:
    """What `rollmarket eval reverify` writes beside the re-scored rollouts."""

    source: str
    verifier: str
    runs: int
    agree: int
    disagreements: dict[str, int]
    """old→new passed counts that differ: "passed→failed", "failed→passed", "unverified→passed", ..."""
    table: dict[str, dict[str, int]]
    """old outcome (passed, failed, unverified) → new outcome (passed, failed) → runs."""
    old_pass_rate: float | None
    new_pass_rate: float | None
    mean_reward_change: float | None
    by_task: list[dict] = field(default_factory=list)
    """Per task: runs, old and new correct, disagreements."""
    changed: list[Rescored] = field(default_factory=list)
    """Every run whose passed flag changed."""


def _outcome(passed: bool | None) -> str:
    return "unverified" if passed is None else "passed" if passed else "failed"


Scorer = Callable[[TaskSpec, AgentTrajectory], VerifyResult]
"""Scores one run of one task: a local verifier family, or a resources server's /verify."""


def retarget(task: TaskSpec, verifier: str | None, args: Mapping[str, Any] | None) -> TaskSpec:
    """`task` scored by `verifier` (None: its own) with `args` (None: its own args when the verifier
    is its own, else none)."""
    if verifier is None or verifier == task.verifier:
        return task if args is None else task.model_copy(update={"verifier_args": dict(args)})
    return task.model_copy(update={"verifier": verifier, "verifier_args": dict(args or {})})


def rescore(task: TaskSpec, run: AgentTrajectory, score: Scorer) -> AgentTrajectory:
    """`run` with its verification by `score` (the old one kept in `info["previous"]`)."""
    new = score(task, run)
    old = run.verification
    info = {**new.info, "previous": None if old is None else old.model_dump(mode="json")}
    return run.model_copy(update={"verification": new.model_copy(update={"info": info})})


def reverify(runs: Sequence[AgentTrajectory], tasks: Iterable[TaskSpec], score: Scorer, *, verifier: str,
             source: str = "", concurrency: int = 1, done: Mapping[int, AgentTrajectory] | None = None,
             on_result: Callable[[int, AgentTrajectory], None] | None = None
             ) -> tuple[list[AgentTrajectory], ReverifyReport]:
    """Score every run again with `score` (the tasks already retargeted), at most `concurrency` at
    once (verifiers are often HTTP judges); the runs with their new verification (the old one kept
    in `info["previous"]`) and the comparison of old with new.

    `done` holds runs already scored (by their index in `runs`, from a journal): they are not
    scored again. `on_result(index, run)` is called in the calling thread as each run finishes,
    in the order they finish (a journal appends it there). A scorer's exception stops the
    scheduling of further runs and is raised once the in-flight ones end; the finished ones have
    had their `on_result`. Raises UnknownTasks, before scoring anything, when a run's task is not
    among `tasks`, and JournalMismatch when `done` is not about these runs."""
    if concurrency < 1:
        raise EvalError(f"concurrency must be at least 1, got {concurrency}", fix="pass --concurrency 1 or more")
    by_id = {task.task_id: task for task in tasks}
    missing = sorted({run.task_id for run in runs} - set(by_id))
    if missing:
        raise UnknownTasks(f"{len(missing)} task(s) of the rollouts are not in the task set: {missing[:5]}",
                           fix="pass the --tasks the rollouts were collected on")
    rescored: dict[int, AgentTrajectory] = {}
    for index, run in (done or {}).items():
        if not 0 <= index < len(runs) or (runs[index].task_id, runs[index].sample_index) != (
                run.task_id, run.sample_index):
            raise JournalMismatch(f"a finished result (index {index}, task {run.task_id}) is not that run of the "
                                  f"rollouts", fix="remove the journal to score every run again")
        rescored[index] = run
    pending = [i for i in range(len(runs)) if i not in rescored]
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="reverify") as pool:
        futures = {pool.submit(rescore, by_id[runs[i].task_id], runs[i], score): i for i in pending}
        try:
            for future in as_completed(futures):
                index = futures[future]
                rescored[index] = future.result()
                if on_result is not None:
                    on_result(index, rescored[index])
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)
            raise
    ordered = [rescored[i] for i in range(len(runs))]
    return ordered, reverify_report(runs, ordered, verifier=verifier, source=source)


def reverify_report(runs: Sequence[AgentTrajectory], rescored: Sequence[AgentTrajectory], *, verifier: str,
                    source: str = "") -> ReverifyReport:
    """Old against new verification of each run (`rescored[i]` is `runs[i]` scored again)."""
    rows = [Rescored(task_id=run.task_id, sample_index=run.sample_index, old_reward=run.reward,
                     old_passed=None if run.verification is None else run.verification.passed,
                     new_reward=new.verification.reward, new_passed=new.verification.passed,
                     new_why=new.verification.info.get("why"))
            for run, new in zip(runs, rescored)]
    table: dict[str, dict[str, int]] = {old: {"passed": 0, "failed": 0} for old in ("passed", "failed", "unverified")}
    for row in rows:
        table[_outcome(row.old_passed)][_outcome(row.new_passed)] += 1
    changed = [r for r in rows if r.old_passed is not r.new_passed]
    flips = Counter(f"{_outcome(r.old_passed)}→{_outcome(r.new_passed)}" for r in changed)
    by_task: dict[str, dict] = {}
    for row in rows:
        entry = by_task.setdefault(row.task_id, {"task_id": row.task_id, "runs": 0, "old_correct": 0,
                                                 "new_correct": 0, "disagree": 0})
        entry["runs"] += 1
        entry["old_correct"] += bool(row.old_passed)
        entry["new_correct"] += row.new_passed
        entry["disagree"] += row.old_passed is not row.new_passed
    n = len(rows)
    return ReverifyReport(
        source=source, verifier=verifier, runs=n, agree=n - len(changed), disagreements=dict(sorted(flips.items())),
        table=table, old_pass_rate=sum(bool(r.old_passed) for r in rows) / n if n else None,
        new_pass_rate=sum(r.new_passed for r in rows) / n if n else None,
        mean_reward_change=sum(r.new_reward - r.old_reward for r in rows) / n if n else None,
        by_task=[by_task[t] for t in sorted(by_task)], changed=changed)


class ReverifyJournal:
    """The results of one reverify as they finish, one JSON line each, so that a rerun after a
    crash scores only what is left.

    The first line is the fingerprint of the work (the rollouts' and tasks' digests, the
    verifier and its args): a journal of other work is refused, never mixed in. Each result line
    is written and flushed as its run finishes; a kill -9 can tear only the last line, which is
    cut off when the journal is opened again."""

    def __init__(self, path: str | Path, fingerprint: Mapping[str, Any]):
        self.path = Path(path)
        self.fingerprint = dict(fingerprint)
        self._handle = None

    def load(self) -> dict[int, AgentTrajectory]:
        """The finished results by run index (none when there is no journal); cuts off a torn last
        line. JournalMismatch when the journal is of other work or damaged before its end."""
        if not self.path.exists():
            return {}
        data = self.path.read_bytes()
        # Every whole line ends in a newline; what follows the last one is a torn write (or nothing).
        *whole, _torn = data.split(b"\n")
        done: dict[int, AgentTrajectory] = {}
        for number, line in enumerate(whole):
            try:
                record = json.loads(line)
                if number == 0:
                    if record.get("reverify") != self.fingerprint:
                        raise JournalMismatch(
                            f"{self.path}: the journal of another reverify (other rollouts, tasks, verifier or args)",
                            fix="pass another --out, or remove the journal to start over")
                else:
                    done[int(record["key"])] = AgentTrajectory.model_validate(record["run"])
            except JournalMismatch:
                raise
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise JournalMismatch(f"{self.path}: line {number + 1} is damaged ({str(exc).splitlines()[0]})",
                                      fix="remove the journal to score every run again") from None
        whole_bytes = sum(len(line) + 1 for line in whole)
        if whole_bytes < len(data):
            with open(self.path, "r+b") as handle:
                handle.truncate(whole_bytes)
        return done

    def append(self, index: int, run: AgentTrajectory) -> None:
        """Add one finished result (the journal and its fingerprint line are created on the first)."""
        if self._handle is None:
            new = not self.path.exists() or self.path.stat().st_size == 0
            self._handle = open(self.path, "a", encoding="utf-8")
            if new:
                self._handle.write(json.dumps({"reverify": self.fingerprint}) + "\n")
        self._handle.write(json.dumps({"key": index, "run": run.model_dump(mode="json")}) + "\n")
        self._handle.flush()

    def close(self) -> None:
        """Close the file (kept: remove it once the results are written elsewhere)."""
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def reverify_json(report: ReverifyReport) -> str:
    """The reverify report as indented JSON."""
    return json.dumps(_clean(asdict(report)), indent=2) + "\n"


# ---------------------------------------------------------------------------------------------
# Compare


EVAL_METRICS = ("pass@1", "pass@4", "pass@16", "reward")
"""Per-task numbers `eval compare` can pair: a profile's pass@k, or its mean reward."""


def load_profile(path: str | Path) -> ProfileReport:
    """A reward profile: a `rollmarket profile` JSON report, or rollouts JSONL profiled here."""
    path = Path(path)
    if not path.is_file():
        raise EvalError(f"{path}: no such file", fix="pass rollouts JSONL or a profile JSON")
    if path.suffix == ".json":
        try:
            return ProfileReport.model_validate_json(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise EvalError(f"{path}: not a reward profile ({str(exc).splitlines()[0]})",
                            fix="pass the JSON `rollmarket profile` wrote, or the rollouts JSONL") from None
    runs, problems = read_rollouts(path)
    if not runs:
        raise EvalError(f"{path}: no agent runs in it" + (f" ({problems[0]})" if problems else ""),
                        fix="pass rollouts JSONL (`rollmarket collect --out`) or a profile JSON")
    return profile_rollouts(runs, source=str(path), skipped_lines=len(problems))


def load_side(path: str | Path) -> ProfileReport | dict[str, ProfileReport]:
    """One side of `eval compare`: a file (one eval, `load_profile`), or a directory holding one
    eval per seed (rollouts `*.jsonl` or profiles `*.json`), keyed by file stem: seed0.jsonl is
    seed "seed0", and it pairs with the other side's seed0."""
    path = Path(path)
    if not path.is_dir():
        return load_profile(path)
    files = sorted(f for f in path.iterdir() if f.is_file() and f.suffix in (".jsonl", ".json"))
    stems = Counter(f.stem for f in files)
    twice = sorted(stem for stem, count in stems.items() if count > 1)
    if twice:
        raise EvalError(f"{path}: seed(s) {twice} both as .jsonl and .json", fix="keep one eval per seed")
    if not files:
        raise EvalError(f"{path}: no *.jsonl or *.json eval in it", fix="put one eval per seed in the directory")
    return {f.stem: load_profile(f) for f in files}


def _per_task(profile: ProfileReport, metric: str) -> dict[str, tuple[float, int]]:
    """Task id → (value, samples); tasks without the value (n < k) left out."""
    out: dict[str, tuple[float, int]] = {}
    for row in profile.tasks:
        if metric == "reward":
            value = row.reward_mean
        else:
            k = int(metric.removeprefix("pass@"))
            if k not in row.pass_at_k:
                raise EvalError(f"{profile.source}: the profile has no pass@{k} (has {sorted(row.pass_at_k)})",
                                fix="profile the rollouts again, or compare the rollouts JSONL")
            value = row.pass_at_k[k]
        if value is not None:
            out[row.task_id] = (float(value), row.n)
    return out


def _margin(settings: StatsSettings, metric: str) -> float | None:
    """The equivalence margin of an eval metric: one number for every metric, or the table's entry."""
    margins = settings.equivalence_margin
    return margins.get(metric) if isinstance(margins, dict) else margins


@dataclass
class EvalComparison:
    """What `rollmarket eval compare` writes: per-task paired differences with intervals and verdicts,
    and with several seeds a side, the seed-level verdicts that count."""

    baseline: str
    candidate: str
    settings: dict
    comparison: Comparison
    """Per task (unit: tasks): each task's value (averaged over the seeds when there are several)
    paired across the sides. Its intervals are over tasks like these, for these seeds."""
    tasks_only_baseline: list[str]
    tasks_only_candidate: list[str]
    per_task: dict[str, list[dict]]
    """Metric → one row per paired task: baseline, candidate and their difference."""
    seed_comparison: Comparison | None = None
    """With several seeds a side (unit: seeds): each seed's mean over the tasks every seed of both
    sides has, paired by seed; the t interval is over seeds, `two_way_bootstrap` resamples seeds
    and tasks. None with one eval a side."""
    verdicts_from: str = "tasks"
    """Which comparison's verdicts count: "seeds" when there are several, else "tasks"."""


def _check_metrics(metrics: Sequence[str]) -> None:
    unknown = [m for m in metrics if m not in EVAL_METRICS]
    if unknown or not metrics:
        raise EvalError(f"unknown eval metric(s) {unknown or 'none given'}", fix=f"use {', '.join(EVAL_METRICS)}")


def _samples_blocker(result, samples: int, metric: str) -> None:
    """A pass@k comparison on too few samples per task cannot decide (issue 13: ≥ 16)."""
    if metric == "reward":
        return
    result.samples_per_task = samples
    if samples < MIN_SAMPLES_PER_TASK:
        result.blockers.append(f"{samples} samples for some task; a pass@k claim needs ≥ {MIN_SAMPLES_PER_TASK} "
                               f"(collect with -k {MIN_SAMPLES_PER_TASK})")


def compare_evals(baseline: ProfileReport | Mapping[str, ProfileReport],
                  candidate: ProfileReport | Mapping[str, ProfileReport], metrics: Sequence[str] = ("pass@1",),
                  settings: StatsSettings = StatsSettings(), *, baseline_name: str = "baseline",
                  candidate_name: str = "candidate") -> EvalComparison:
    """Candidate vs baseline on each metric; Holm across the metrics; verdicts.

    One profile a side: tasks are the unit (each task's value paired across the sides). A mapping
    seed → profile a side (the same seeds on both, at least 2): seeds are the unit of the verdicts
    (each seed's mean over the common tasks, paired by seed, and the two-way bootstrap over seeds
    × tasks), and the per-task comparison of the seed-averaged values is reported beside them.
    A seed-level CONFIRMED or REFUTED whose two-way bootstrap interval holds 0 becomes
    INCONCLUSIVE: it holds for these tasks but not for tasks like them."""
    _check_metrics(metrics)
    seeded = isinstance(baseline, Mapping)
    if seeded != isinstance(candidate, Mapping):
        raise EvalError("one side has several seeds and the other one eval",
                        fix="give both sides one eval, or both a directory of one eval per seed")
    if seeded:
        seeds = _paired_seeds(baseline, candidate, baseline_name, candidate_name)
        base_sides, cand_sides = [baseline[s] for s in seeds], [candidate[s] for s in seeds]
    else:
        seeds, base_sides, cand_sides = [], [baseline], [candidate]
    task_results, seed_results, rows = [], [], {}
    only_base: set[str] = set()
    only_cand: set[str] = set()
    for metric in metrics:
        base = [_per_task(p, metric) for p in base_sides]
        cand = [_per_task(p, metric) for p in cand_sides]
        in_base, in_cand = set.intersection(*(set(b) for b in base)), set.intersection(*(set(c) for c in cand))
        tasks = sorted(in_base & in_cand)
        only_base |= in_base - in_cand
        only_cand |= in_cand - in_base
        if len(tasks) < 2:
            raise NoCommonTasks(f"{metric}: {len(tasks)} task(s) with a value on both sides"
                                + (" in every seed" if seeded else "") + "; pairing needs at least 2",
                                fix="evaluate both models on the same tasks (with n >= k)")
        samples = min(side[t][1] for side in base + cand for t in tasks)
        b_ST = np.array([[side[t][0] for t in tasks] for side in base])
        c_ST = np.array([[side[t][0] for t in tasks] for side in cand])
        margin = _margin(settings, metric)
        result = paired_comparison(metric, True, tasks, b_ST.mean(axis=0).tolist(), c_ST.mean(axis=0).tolist(),
                                   settings, len(metrics), margin=margin, unit="tasks")
        _samples_blocker(result, samples, metric)
        task_results.append(result)
        if seeded:
            by_seed = paired_comparison(metric, True, seeds, b_ST.mean(axis=1).tolist(), c_ST.mean(axis=1).tolist(),
                                        settings, len(metrics), margin=margin, unit="seeds")
            _samples_blocker(by_seed, samples, metric)
            mean, lo, hi = two_way_bootstrap(c_ST - b_ST, resamples=settings.resamples,
                                             confidence=1 - settings.alpha, seed=settings.seed)
            by_seed.two_way_bootstrap = {"mean": mean, "lo": lo, "hi": hi, "resamples": settings.resamples,
                                         "tasks": len(tasks), "seeds": len(seeds)}
            seed_results.append(by_seed)
        rows[metric] = [{"task_id": t, "baseline": float(b), "candidate": float(c), "difference": float(c - b)}
                        for t, b, c in zip(tasks, b_ST.mean(axis=0), c_ST.mean(axis=0))]
    judge(task_results, settings)
    seed_comparison = None
    if seeded:
        judge(seed_results, settings)
        for result in seed_results:
            _require_bootstrap(result)
        seed_comparison = Comparison(baseline=baseline_name, candidate=candidate_name, metrics=seed_results)
    return EvalComparison(baseline=baseline_name, candidate=candidate_name, settings=asdict(settings),
                          comparison=Comparison(baseline=baseline_name, candidate=candidate_name, metrics=task_results),
                          tasks_only_baseline=sorted(only_base), tasks_only_candidate=sorted(only_cand),
                          per_task=rows, seed_comparison=seed_comparison, verdicts_from="seeds" if seeded else "tasks")


def _paired_seeds(baseline: Mapping[str, ProfileReport], candidate: Mapping[str, ProfileReport],
                  baseline_name: str, candidate_name: str) -> list[str]:
    if set(baseline) != set(candidate):
        raise UnpairedSeeds(f"{candidate_name} vs {baseline_name}: seeds do not pair (only {baseline_name}: "
                            f"{sorted(set(baseline) - set(candidate)) or 'none'}; only {candidate_name}: "
                            f"{sorted(set(candidate) - set(baseline)) or 'none'})",
                            fix="give each side one eval per seed, named alike (seed0.jsonl, seed1.jsonl, ...)")
    if len(baseline) < 2:
        raise TooFewSeeds(f"{len(baseline)} seed(s) a side; the seed is the unit of replication and a comparison "
                          f"needs at least 2", fix="evaluate a model of each training seed")
    return sorted(baseline)


def _require_bootstrap(result) -> None:
    """A seed-level CONFIRMED or REFUTED needs the seeds × tasks bootstrap interval to agree."""
    boot = result.two_way_bootstrap
    if result.verdict in (Verdict.confirmed.value, Verdict.refuted.value) and boot["lo"] <= 0 <= boot["hi"]:
        result.verdict = Verdict.inconclusive.value
        result.reason = (f"significant over these seeds on these tasks, but the two-way bootstrap (seeds and tasks "
                         f"resampled) interval [{boot['lo']:.4g}, {boot['hi']:.4g}] holds 0: it may not hold on "
                         f"other tasks like these. " + result.reason)


def comparison_json(report: EvalComparison) -> str:
    """The eval comparison as indented JSON."""
    data = asdict(report)
    for key in ("comparison", "seed_comparison"):
        for metric in (data[key] or {}).get("metrics", []):
            metric.pop("blockers", None)
    return json.dumps(_clean(data), indent=2) + "\n"
