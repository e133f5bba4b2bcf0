"""`rollmarket squeeze RUN`: LoRA rank analysis of a run's trained adapter."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

console = Console()


def _share(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


@click.command("squeeze")
@click.argument("run", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--retention", type=float, default=None,
              help="Share of each update's energy (Σσ²) the rank must keep, in (0, 1] "
                   "[default: the run's squeeze.min_variance_retention, 0.95].")
@click.option("--checkpoint", default=None, metavar="vNNNN",
              help="Checkpoint to analyse [default: the newest].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of tables.")
def squeeze(run: Path, retention: float | None, checkpoint: str | None, as_json: bool) -> None:
    """Analyse the rank of RUN's LoRA adapter: the singular values of each module's update
    scale·B·A, the energy (Σσ²) kept by rank 1…r, the smallest rank that keeps the retention, and
    the rank to retrain with (the largest module rank); writes RUN/squeeze.json."""
    from ..research.squeeze import energy_columns, squeeze_run, write_report

    report = squeeze_run(run, retention=retention, checkpoint=checkpoint)
    target = write_report(report, run)
    if as_json:
        click.echo(report.to_json(), nl=False)
        return
    ks = energy_columns(report.lora_r)
    table = Table(title=f"{run.name} {report.checkpoint}: LoRA r={report.lora_r}, alpha={report.lora_alpha:g}, "
                        f"energy kept by rank k (%)", title_justify="left")
    table.add_column("module")
    table.add_column("σ₁", justify="right")
    for k in ks:
        table.add_column(f"k={k}", justify="right")
    table.add_column(f"rank for {100 * report.retention:g}%", justify="right")
    for i, m in enumerate(report.modules):
        energy = [None] * len(ks) if m.energy is None else [m.energy[k - 1] for k in ks]
        table.add_row(m.module, f"{m.singular_values[0]:.3g}", *map(_share, energy),
                      "-" if m.rank is None else str(m.rank), end_section=i == len(report.modules) - 1)
    if report.mean_energy is not None:
        table.add_row("[bold]mean[/]", "", *[_share(report.mean_energy[k - 1]) for k in ks],
                      str(report.mean_energy_rank))
        table.add_row("[bold]min[/]", "", *[_share(report.min_energy[k - 1]) for k in ks], "")
    console.print(table)
    if report.recommended_rank is None:
        console.print("no module's update has moved from zero yet: nothing to recommend", highlight=False)
    else:
        console.print(
            f"recommended rank [bold]{report.recommended_rank}[/] of {report.lora_r} (the largest module rank: every "
            f"module keeps ≥ {100 * report.retention:g}%); median module rank {report.median_rank:g}; the mean "
            f"energy reaches it at rank {report.mean_energy_rank}", highlight=False)
    if report.zero_modules:
        console.print(f"{report.zero_modules} modules with a zero update left out", highlight=False)
    console.print(f"wrote [bold]{target}[/]", highlight=False)
