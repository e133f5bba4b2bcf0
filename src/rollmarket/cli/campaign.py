"""`rollmarket campaign`: conditions × seeds from one TOML file, with a live view of every run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click
from rich.console import Console
from rich.live import Live
from rich.table import Table

console = Console()

STYLE = {"pending": "dim", "running": "cyan", "resuming": "cyan", "done": "green", "failed": "bold red"}


def status_table(statuses, title: str) -> Table:
    """One row per run: condition, seed, state, step k/N, elapsed time, its run directory."""
    table = Table(title=title, title_justify="left")
    for column in ("condition", "seed", "status", "step", "time", "run"):
        table.add_column(column, justify="right" if column in ("seed", "step", "time") else "left")
    now = time.monotonic()
    for s in statuses:
        state = "done (earlier)" if s.skipped else ("resumed" if s.resumed and s.state == "done" else s.state)
        elapsed = "" if s.started is None else f"{((s.finished or now) - s.started) / 60:.1f} min"
        table.add_row(s.condition, str(s.seed), f"[{STYLE[s.state]}]{state}[/]", f"{s.step}/{s.steps}", elapsed,
                      str(s.run_dir.name) if s.run_dir else "")
    return table


def run_live(runner, console: Console, title: str) -> None:
    """Run a CampaignRunner with the live table of its runs (also used by experiments/*.py)."""
    with Live(status_table(runner.statuses, title), console=console, refresh_per_second=2) as live:
        runner.on_update = lambda statuses: live.update(status_table(statuses, title))
        runner.run()
    if not console.is_terminal:  # the last frame ends without a newline when output is a file
        console.line()


@click.command("campaign")
@click.argument("campaign_file", metavar="[CAMPAIGN.toml]", required=False,
                type=click.Path(path_type=Path, dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--out", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Campaign directory (default runs/campaign-<UTC stamp>-<id>/). An earlier campaign's "
                   "directory resumes it: finished runs are skipped, unfinished ones resumed.")
@click.option("--resume", type=click.Path(path_type=Path, file_okay=False, exists=True), default=None,
              help="Resume the campaign in this directory with the file and overrides it was started with "
                   "(from its campaign.json), from the directory it was started in.")
@click.option("--parallel", type=click.IntRange(min=1), default=None,
              help="Runs at once (default: [campaign] parallel, else the machine's cores); each run uses one "
                   "torch thread.")
def campaign(campaign_file: Path | None, overrides: tuple[str, ...], out: Path | None, resume: Path | None,
             parallel: int | None) -> None:
    """Run conditions × seeds from one TOML file, each run a `rollmarket train --local` process.

    The file is a train config (its sections apply to every run) plus [campaign] (name, seeds,
    seed_mode, parallel) and [[campaign.conditions]] (name and overrides of any training key);
    KEY=VALUE overrides apply to every run. Every setting is checked before anything starts.
    Every metrics row carries `condition` and `seed`; docs/campaigns.md has the layout.

    \b
      rollmarket campaign configs/campaign-example.toml
      rollmarket campaign configs/campaign-example.toml loop.steps=2 --parallel 2
      rollmarket campaign --resume runs/campaign-20261126T160000Z-ab12cd     # after a crash or kill
    """
    from ..research.campaign import CampaignRunner, load_campaign, new_campaign_dir_name, parse_campaign, read_manifest

    if resume is not None:
        if campaign_file is not None or overrides or out is not None:
            raise click.UsageError("--resume DIR takes the campaign file and overrides from DIR/campaign.json; "
                                   "pass no CAMPAIGN.toml, KEY=VALUE or --out with it")
        manifest = read_manifest(resume)
        plan = parse_campaign(manifest["file"], source=manifest.get("source", str(resume)),
                              overrides=manifest.get("overrides", []))
        out = resume
    elif campaign_file is None:
        raise click.UsageError("pass CAMPAIGN.toml (e.g. configs/campaign-example.toml) or --resume DIR")
    else:
        plan = load_campaign(campaign_file, list(overrides))  # every run resolved and validated: nothing made yet
        out = out or Path(plan.runs[0].config.runs_root) / new_campaign_dir_name()
    runner = CampaignRunner(plan, out, parallel=parallel)
    runner.check()  # another campaign in --out, or changed settings: refused before the live view
    console.print(f"[bold]rollmarket campaign[/] {plan.name}: {len(plan.conditions)} conditions × "
                  f"{len(plan.seeds)} seeds = {len(plan.runs)} runs, {runner.parallel} at once → {out}",
                  highlight=False)
    run_live(runner, console, f"campaign {plan.name}")
    table = Table(title="held-out accuracy (greedy) before → after", title_justify="left")
    for column in ("condition", "seed", "accuracy", "pass@1", "minutes"):
        table.add_column(column, justify="left" if column == "condition" else "right")
    for s in runner.statuses:
        summary = json.loads((s.run_dir / "summary.json").read_text())
        before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}

        def pair(key: str) -> str:
            return f"{before[key]:.3f} → {after[key]:.3f}" if key in before and key in after else "-"
        table.add_row(s.condition, str(s.seed), pair("eval/accuracy/mean"), pair("eval/pass@1"),
                      f"{summary.get('minutes', 0):.1f}")
    console.print(table)
    console.print(f"campaign: {out}/campaign.json", highlight=False)
