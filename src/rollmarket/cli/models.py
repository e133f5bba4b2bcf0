"""`rollmarket models`: build and inspect the tiny shipped models."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from .options import ModelDir

console = Console()


@click.group()
def models() -> None:
    """Build and inspect the tiny shipped models (tiny-dense, tiny-moe, tiny-start)."""


@models.command("build")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=Path("models"), show_default=True,
              help="Directory that receives <out>/<name>/.")
@click.option("--seed", default=0, show_default=True, help="Seed of model init and batch order.")
@click.option("--steps", default=None, type=int, help="Optimizer steps of tiny-dense [default: 4000; --quick: 4].")
@click.option("--moe-steps", default=None, type=int,
              help="Optimizer steps of tiny-moe after upcycling [default: 2000; --quick: 4].")
@click.option("--upcycle/--no-upcycle", default=True, show_default=True,
              help="Start tiny-moe from tiny-dense (--only moe then reuses <out>/tiny-dense).")
@click.option("--minutes", default=30.0, show_default=True, help="Wall-time cap on each model's training.")
@click.option("--start-steps", default=None, type=int,
              help="Optimizer steps of tiny-start's fine-tune on mixed demonstrations [default: 400; --quick: 4].")
@click.option("--tool-share", default=None, type=click.FloatRange(0.0, 1.0),
              help="Share of tiny-start's demonstrations that use the tools [default: 0.65].")
@click.option("--only", type=click.Choice(["dense", "moe", "start"]), default=None,
              help="Build one model only (moe reuses <out>/tiny-dense, start reuses <out>/tiny-moe).")
@click.option("--threads", default=1, show_default=True,
              help="torch CPU threads (1 is fastest when other work shares the CPU).")
@click.option("--quick", is_flag=True, help="A seconds-long smoke build (tiny data, a few steps).")
def build_command(out_dir: Path, seed: int, steps: int | None, moe_steps: int | None, upcycle: bool, minutes: float,
                  start_steps: int | None, tool_share: float | None, only: str | None, threads: int,
                  quick: bool) -> None:
    """Generate tasks, train the tokenizer, train and evaluate the models, write HF model dirs."""
    from ..models.build import BuildConfig, build

    overrides = {"out": out_dir, "seed": seed, "max_minutes": minutes, "threads": threads, "upcycle": upcycle}
    if steps is not None:
        overrides["steps"] = steps
    if moe_steps is not None:
        overrides["moe_steps"] = moe_steps
    if start_steps is not None:
        overrides["start_steps"] = start_steps
    if tool_share is not None:
        overrides["tool_share"] = tool_share
    if only is not None:
        overrides["only"] = (f"tiny-{only}",)
    config = BuildConfig.quick(**overrides) if quick else BuildConfig(**overrides)
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        bars: dict[str, int] = {}

        def on_event(kind: str, fields: dict) -> None:
            if kind == "stage":
                console.print(f"[dim]{fields['text']}[/]")
            elif kind == "train_start":
                bars["train"] = progress.add_task(f"train {fields['model']}", total=fields["steps"], info="")
            elif kind == "step":
                progress.update(bars["train"], completed=fields["step"] + 1, info=f"loss {fields['loss']:.3f}")
            elif kind == "eval_start":
                bars["eval"] = progress.add_task(f"eval {fields['model']}", total=fields["n"], info="")
                bars["correct"] = 0
            elif kind == "episode":
                bars["correct"] += int(fields["correct"])
                progress.advance(bars["eval"])
                progress.update(bars["eval"], info=f"correct {bars['correct']}")
            elif kind == "done":
                _print_report(fields["report"])

        try:
            build(config, on_event)
        except FileNotFoundError as exc:  # --only moe/start without the model it starts from
            raise click.UsageError(str(exc)) from None
    console.print(f"wrote {', '.join(str(out_dir / n) for n in config.only)}")


def _print_report(report: dict) -> None:
    table = Table("family", "accuracy", "n", "tool calls / task", title=f"{report['model']} (held-out, greedy)")
    for family, row in report["eval"]["families"].items():
        table.add_row(family, f"{row['accuracy']:.2f}", str(row["n"]), f"{row['mean_tool_calls']:.2f}")
    console.print(table)
    console.print(f"{report['model']}: {report['parameters']:,} parameters, {report['safetensors_bytes'] / 1e6:.1f} MB, "
                  f"trained {report['train']['steps_done']} steps in {report['train']['wall_s']:.0f}s, "
                  f"final loss {report['loss']['last']:.3f}")
    if headroom := report.get("headroom"):
        for who in ("parent", "model"):
            h = headroom[who]
            console.print(f"{'tiny-moe (before)' if who == 'parent' else report['model']}: held-out "
                          f"{headroom['family']} sampled at T={h['temperature']} ({h['tasks']} tasks × {h['samples']}): "
                          + ", ".join(f"{k} {v:.2f}" for k, v in h.items() if k.startswith("pass@"))
                          + f", tool calls in {h['tool_rate']:.0%} of runs")


@models.command("info")
@click.argument("path", type=ModelDir())
@click.option("--json", "as_json", is_flag=True, help="Print build_report.json as is.")
def info_command(path: str, as_json: bool) -> None:
    """Show a model directory's architecture, size and build report."""
    path = Path(path)
    report_path = path / "build_report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else None
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return
    config = json.loads((path / "config.json").read_text())
    size = (path / "model.safetensors").stat().st_size
    experts = config.get("num_experts") or config.get("num_local_experts")
    console.print(f"[bold]{path}[/]: {config['architectures'][0]}, {config['num_hidden_layers']} layers, "
                  f"hidden {config['hidden_size']}, vocab {config['vocab_size']}"
                  + (f", {experts} experts top-{config['num_experts_per_tok']}" if experts else "")
                  + f", {size / 1e6:.1f} MB")
    if report and "eval" in report:
        _print_report(report)
    elif report:
        console.print(f"build report: {report}")
