"""`rollmarket profile`: pass@k, majority@k and reward statistics of agent runs."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

console = Console()


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


def _num(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def default_out(rollouts: Path) -> Path:
    """rollouts.jsonl -> rollouts.profile.json, next to the input."""
    return rollouts.with_name(rollouts.name.removesuffix(".jsonl") + ".profile.json")


@click.command("profile")
@click.argument("rollouts", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="JSON report to write [default: ROLLOUTS with .profile.json for .jsonl].")
@click.option("--by-task/--no-by-task", default=True, show_default=True, help="Print a row per task.")
@click.option("--seed", default=0, show_default=True,
              help="Seed of majority@k's Monte Carlo (large tasks only) and of the pass@k intervals' bootstrap.")
def profile(rollouts: Path, out: Path | None, by_task: bool, seed: int) -> None:
    """Profile ROLLOUTS (JSONL, one AgentTrajectory per line): per-task and global pass@k for k in
    1, 4, 16 (unbiased), majority@k, and the mean, median and std of the reward.

    The global pass@k comes with a 95% interval: a percentile bootstrap over tasks. Collect 16 or
    more samples per task (`rollmarket collect -k 16`) for any claim."""
    from ..verifiers.profile import (
        INTERVAL_RESAMPLES,
        MIN_SAMPLES_PER_TASK,
        profile_rollouts,
        read_rollouts,
        report_json,
    )

    runs, problems = read_rollouts(rollouts)
    for problem in problems[:5]:
        console.print(f"[yellow]skipped[/] {rollouts}: {problem}", highlight=False)
    if len(problems) > 5:
        console.print(f"[yellow]skipped[/] {len(problems) - 5} more lines", highlight=False)
    report = profile_rollouts(runs, source=str(rollouts), skipped_lines=len(problems), seed=seed)
    ks = report.ks
    overall = report.overall
    table = Table(title=f"{rollouts.name}: {overall.samples} runs of {overall.tasks} tasks", title_justify="left")
    table.add_column("task")
    table.add_column("n", justify="right")
    table.add_column("correct", justify="right")
    for k in ks:
        table.add_column(f"pass@{k} %", justify="right")
    for k in ks:
        table.add_column(f"maj@{k} %", justify="right")
    for name in ("mean", "median", "std"):
        table.add_column(f"reward {name}", justify="right")
    table.add_row("[bold]all[/]", str(overall.samples), str(overall.correct),
                  *[_pct(overall.pass_at_k[k]) for k in ks], *[_pct(overall.majority_at_k[k]) for k in ks],
                  _num(overall.reward_mean), _num(overall.reward_median), _num(overall.reward_std),
                  end_section=True)
    if by_task:
        for row in report.tasks:
            table.add_row(row.task_id, str(row.n), str(row.correct), *[_pct(row.pass_at_k[k]) for k in ks],
                          *[_pct(row.majority_at_k[k]) for k in ks], _num(row.reward_mean), _num(row.reward_median),
                          _num(row.reward_std))
    console.print(table)
    console.print("all: pass@k and majority@k macro-averaged over the tasks with n >= k; rewards over every run",
                  highlight=False)
    intervals = ", ".join(f"pass@{k} {_pct(i.mean)} [{_pct(i.lo)}, {_pct(i.hi)}]"
                          for k, i in overall.pass_at_k_interval.items() if i is not None)
    if intervals:
        console.print(f"95% intervals (percentile bootstrap over tasks, {INTERVAL_RESAMPLES} resamples): {intervals}",
                      highlight=False)
    fewest = overall.samples_per_task_min
    if fewest is not None and fewest < MIN_SAMPLES_PER_TASK:
        console.print(f"[yellow]note[/] {fewest} samples for some task: {MIN_SAMPLES_PER_TASK} or more per task "
                      f"for any claim (collect with -k {MIN_SAMPLES_PER_TASK}; docs/statistics.md)", highlight=False)
    reasons = ", ".join(f"{name} {count}" for name, count in overall.terminal_reasons.items()) or "none"
    console.print(f"runs ended: {reasons}; unverified {overall.unverified}", highlight=False)
    target = out or default_out(rollouts)
    target.write_text(report_json(report))
    console.print(f"wrote the report to [bold]{target}[/]", highlight=False)
