"""`rollmarket explain`: a dry run of a train config or campaign file. Nothing is started or written."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

console = Console()


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def _settings_table(title: str, settings: dict) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("key")
    table.add_column("value")
    for key, value in settings.items():
        table.add_row(key, json.dumps(value))
    return table


@click.command("explain")
@click.argument("config", type=click.Path(path_type=Path, dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--measure", is_flag=True, help="Measure the model's decode and forward rates on this machine "
                                              "(a few seconds) instead of reading benchmarks/results.")
@click.option("--parallel", type=click.IntRange(min=1), default=None,
              help="Runs at once, for a campaign's estimate (default: as `rollmarket campaign` would run it).")
@click.option("--json", "as_json", is_flag=True, help="Print the dry run as JSON.")
def explain(config: Path, overrides: tuple[str, ...], measure: bool, parallel: int | None, as_json: bool) -> None:
    """A dry run of a train config or campaign file: what would run, jobs, tokens, evaluation cost and an
    estimate of time.

    Nothing is started or written. Token counts are upper bounds (every turn at rollout.max_tokens,
    every run at its turn limit); the time is estimated from measured token rates (docs/campaigns.md,
    "Before you run").

    \b
      rollmarket explain configs/campaign-example.toml
      rollmarket explain configs/train-lookup.toml loop.steps=40 --measure
    """
    from ..research.explain import explain as dry_run

    plan = dry_run(config, list(overrides), measure=measure, parallel=parallel)
    if as_json:
        click.echo(json.dumps(plan, indent=2))
        return
    runs = plan["runs"]
    conditions = sorted({r["condition"] for r in runs if r["condition"] is not None})
    seeds = sorted({r["seed"] for r in runs})
    head = (f"[bold]{plan['kind']} {plan['name']}[/]: {len(runs)} run(s)"
            + (f" = {len(conditions)} conditions × {len(seeds)} seeds {seeds}, seed_mode {plan['seed_mode']}"
               if plan["kind"] == "campaign" else ""))
    console.print(head, highlight=False)
    if plan["settings"]["common"]:
        console.print(_settings_table("settings that differ from the defaults (every run)", plan["settings"]["common"]))
    for name, settings in plan["settings"]["conditions"].items():
        console.print(_settings_table(f"condition {name}", settings) if settings else f"condition {name}: no overrides",
                      highlight=False)
    table = Table(title="work per run (tokens: upper bounds)", title_justify="left")
    for column in ("condition", "seed", "steps", "jobs/step × G", "trajectories", "tokens ≤", "evaluations",
                   "eval runs", "eval tokens ≤"):
        table.add_column(column, justify="left" if column == "condition" else "right")
    for r in runs:
        table.add_row(str(r["condition"] or "-"), str(r["seed"]), str(r["steps"]), f"{r['groups_per_step']} × {r['group_size']}",
                      f"{r['trajectories']:,}", f"{r['tokens_max']:,}", str(r["evaluations"]),
                      f"{r['eval_runs']:,}", f"{r['eval_tokens_max']:,}")
    console.print(table)
    t = plan["totals"]
    console.print(f"total: {t['runs']} runs, {t['groups']:,} groups, {t['trajectories']:,} trajectories, "
                  f"≤ {t['tokens_max']:,} generated tokens in training, {t['eval_runs']:,} evaluation runs "
                  f"(≤ {t['eval_tokens_max']:,} tokens)", highlight=False)
    estimate = plan["estimate"]
    if estimate is None:
        console.print("time: no measured rate for this model; pass --measure to measure one here", highlight=False)
        return
    parts = estimate["parts_s"]
    console.print(f"time: ~{_minutes(estimate['wall_s'])} ({estimate['waves']} wave(s) of ≤ "
                  f"{estimate['parallel']} runs on {estimate['cores']} cores; a run ≤ {_minutes(estimate['per_run_s'])}: "
                  f"generation {parts['generation_s']:.0f} s, training {parts['training_s']:.0f} s, evaluation "
                  f"{parts['evaluation_s']:.0f} s, start-up {parts['startup_s']:.0f} s): token upper bounds at the rates "
                  f"of {estimate['rates']['source']}; a loaded machine is slower.", highlight=False)
