"""`rollmarket diff RUN_A RUN_B`: two training runs side by side."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

console = Console()


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return json.dumps(value) if not isinstance(value, str) else value


@click.command("diff")
@click.argument("run_a", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.argument("run_b", type=click.Path(path_type=Path, file_okay=False, exists=True))
@click.option("--json", "as_json", is_flag=True, help="Print the comparison as JSON.")
def diff(run_a: Path, run_b: Path, as_json: bool) -> None:
    """Two training runs side by side: the settings that differ and their headline metrics.

    Settings come from each run's config.json (only keys that differ); metrics from metrics.jsonl
    (final value, and best with its step where a side is better) and the held-out evaluation before
    and after training. For a verdict over seeds use `rollmarket stats` on a campaign.

    \b
      rollmarket diff runs/20261126T101500Z-ab12cd runs/20261126T111500Z-cd34ef
      rollmarket diff RUN_A RUN_B --json
    """
    from ..research.rundiff import diff_runs

    result = diff_runs(run_a, run_b)
    if as_json:
        click.echo(json.dumps(result, indent=2))
        return
    a, b = result["a"], result["b"]
    for tag, side in (("A", a), ("B", b)):
        state = "finished" if side["finished"] else "not finished"
        console.print(f"{tag}: {side['dir']} ({side['steps']}/{side['planned_steps']} steps, {state})", highlight=False)
    settings = Table(title="settings that differ", title_justify="left")
    for column in ("key", "A", "B"):
        settings.add_column(column)
    for row in result["settings"]:
        settings.add_row(row["key"], _fmt(row["a"]), _fmt(row["b"]))
    console.print(settings if result["settings"] else "settings: the same")
    metrics = Table(title="metrics (final; best at step, where a side is better)", title_justify="left")
    for column in ("metric", "A final", "B final", "A best", "B best"):
        metrics.add_column(column, justify="left" if column == "metric" else "right")
    for row in result["metrics"]:
        def best(side: dict) -> str:
            return "-" if side["best"] is None else f"{_fmt(side['best'])} @{side['best_step']}"
        metrics.add_row(row["key"], _fmt(row["a"]["final"]), _fmt(row["b"]["final"]), best(row["a"]), best(row["b"]))
    console.print(metrics)
    if result["evaluation"]:
        evaluation = Table(title="held-out evaluation before → after", title_justify="left")
        for column in ("metric", "A", "B"):
            evaluation.add_column(column, justify="left" if column == "metric" else "right")
        for row in result["evaluation"]:
            evaluation.add_row(row["key"], f"{_fmt(row['a_before'])} → {_fmt(row['a_after'])}",
                               f"{_fmt(row['b_before'])} → {_fmt(row['b_after'])}")
        console.print(evaluation)
