"""`rollmarket train`: the closed-loop trainer. Prints one line per step; the run directory is the record."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console

console = Console()


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def step_line(row: dict) -> str:
    """One step as a console line: accuracy, gate decisions, mismatch, loss, time."""
    gate = "/".join(str(row.get(f"gate/{k}", 0)) for k in ("train", "train_with_correction", "replay", "quarantine"))
    precisions = sorted({k.split("/")[1] for k in row if k.startswith("mismatch/") and k.endswith("/groups")})
    mismatch = "  ".join(
        f"{p} ESS {_fmt(row.get(f'mismatch/{p}/token_ess_mean'), '.4f')} |Δ| {_fmt(row.get(f'mismatch/{p}/mean_abs_delta'), '.1e')}"
        f" flip {_fmt(row.get(f'mismatch/{p}/router_flip_rate'), '.1%')}" for p in precisions)
    line = (f"step {row['step']:3d} v{row['policy_version']}  correct {row['correct_rate']:.3f} "
            f"(running {row['running_correct_rate']:.3f})  gate t/c/r/q {gate}  datums {row['num_datums']:3d}  "
            f"loss {_fmt(row.get('loss'), '+.4f')}  {mismatch}  {row['timing_s/step']:.1f}s")
    if "eval/accuracy/mean" in row:
        line += f"  [bold]eval {row['eval/accuracy/mean']:.3f}[/] pass@1 {_fmt(row.get('eval/pass@1'), '.3f')}"
    return line


def accuracy_line(summary: dict) -> str | None:
    """Held-out accuracy before → after from a run's summary.json, or None without evaluations."""
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    if not (before and after):
        return None
    return (f"held-out accuracy (greedy, {before['eval/tasks']} tasks) {before['eval/accuracy/mean']:.3f} → "
            f"{after['eval/accuracy/mean']:.3f}; pass@1 {before['eval/pass@1']:.3f} → {after['eval/pass@1']:.3f} "
            f"in {summary['minutes']:.1f} min")


@click.command("train", context_settings={"ignore_unknown_options": False})
@click.argument("config", required=False, type=click.Path(path_type=Path, dir_okay=False))
@click.argument("overrides", nargs=-1)
@click.option("--local", is_flag=True, help="Start an exchange and one worker per local.workers entry (PRECISION or PRECISION@lagK) in this "
                                            "process (quick experiments; no other process needed).")
@click.option("--resume", type=click.Path(path_type=Path, file_okay=False, exists=True), default=None,
              help="Continue a run from its newest checkpoint (its saved config; OVERRIDES still apply).")
@click.option("--run-dir", type=click.Path(path_type=Path, file_okay=False, exists=True), default=None,
              help="Write the run into this existing directory instead of a new one under runs_root (a demo's).")
@click.option("--print-config", is_flag=True, help="Print the resolved config as JSON and exit.")
@click.option("--list-keys", is_flag=True, help="Print every config key with its type, default and help, and exit.")
def train_command(config: Path | None, overrides: tuple[str, ...], local: bool, resume: Path | None,
                  run_dir: Path | None, print_config: bool, list_keys: bool) -> None:
    """Train a policy through the exchange (GRPO family): CONFIG.toml plus KEY=VALUE overrides.

    \b
      rollmarket train configs/train-lookup.toml --local
      rollmarket train configs/train-lookup.toml optim.lr=1e-4 loop.steps=40 --local
      rollmarket train cfg.toml exchange.url=http://127.0.0.1:8470   # workers run elsewhere
      rollmarket train --resume runs/20261126T101500Z-ab12cd --local
      rollmarket train --list-keys
    """
    from ..train.config import TrainConfigError, config_keys, resolve, validate

    if list_keys:
        keys = config_keys()
        width = max(len(k.key) for k in keys)
        for k in keys:
            click.echo(f"{k.key:<{width}}  {k.type} = {k.default}  {k.help}".rstrip())
        return
    if run_dir is not None and resume is not None:
        raise click.UsageError("--run-dir names a new run's directory; --resume goes on in the old one's")
    from ..train.loop import Trainer, resume_config

    if config is not None and "=" in str(config) and not config.exists():
        overrides, config = (str(config), *overrides), None  # only overrides were given
    if resume and not (resume / "config.json").is_file():
        raise TrainConfigError(f"{resume} is not a training run directory (no config.json)",
                               fix="pass a directory that `rollmarket train` made under runs/")
    cfg, warnings = resume_config(resume, list(overrides)) if resume else (resolve(config, list(overrides)), [])
    for warning in warnings:
        console.print(f"[yellow]warning[/] {warning.message()}", highlight=False)
    if print_config:
        click.echo(cfg.model_dump_json(indent=2))
        return
    validate(cfg, local=local)  # before the run directory is made

    def on_event(kind: str, data: dict) -> None:
        if kind == "setup":
            console.print(f"[bold]rollmarket train[/] → {data['run_dir']}"
                          + (" (local exchange and workers)" if data["local"] else ""), highlight=False)
        elif kind == "quorum":
            console.print(f"waiting for workers to load policy v{data['version']}…", highlight=False)
        elif kind == "eval":
            console.print(f"evaluating on {cfg.eval.tasks} held-out {cfg.rollout.suite} tasks (step {data['step']})…",
                          highlight=False)

    trainer = Trainer(cfg, local=local, resume=resume, on_step=lambda row: console.print(step_line(row), highlight=False),
                      on_event=on_event, run_dir=run_dir)
    with console.status("training…", spinner="dots"):
        run_dir = trainer.run()
    summary = json.loads((run_dir / "summary.json").read_text())
    if line := accuracy_line(summary):
        console.print(line, highlight=False)
    console.print(f"metrics: {run_dir}/metrics.jsonl  generations: {run_dir}/generations.jsonl", highlight=False)
    for tracker in summary.get("trackers", []):
        console.print(f"{tracker['tracker']}: {tracker['open']}", highlight=False)
