"""`rollmarket stats` (a campaign's conditions against its baseline) and `rollmarket compare` (any
runs against any runs): the seed as the unit, exact sign-flip tests, intervals, power, TOST and
verdicts (research/stats.py; docs/statistics.md)."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

console = Console()

_COLOURS = {"CONFIRMED": "green", "REFUTED": "red", "EQUIVALENT": "cyan", "INCONCLUSIVE": "yellow"}


def _common_options(command):
    options = [
        click.option("--metric", "metrics", multiple=True, metavar="KEY@WHERE",
                     help="A metric to compare, repeatable: KEY@final, KEY@auc (area under the curve over steps, "
                          "divided by the span) or KEY@STEP; append :lower when lower is better [default: the "
                          "campaign's [stats] metrics, else eval/pass@1@final]."),
        click.option("--alpha", type=float, default=None, help="Significance level [default: [stats] alpha, else "
                                                                "0.05]."),
        click.option("--margin", "equivalence_margin", type=float, default=None,
                     help="Equivalence margin for TOST, in the metric's units [default: [stats] "
                          "equivalence_margin; none: no EQUIVALENT verdict]."),
        click.option("--target-effect", type=float, default=None,
                     help="An effect (metric units) to plan for: the report says how many seeds it needs."),
        click.option("--paired-only", is_flag=True,
                     help="Compare the seeds both sides have instead of refusing unpaired seeds."),
        click.option("--seed", type=int, default=0, show_default=True,
                     help="Seed of the Monte Carlo sign flips (beyond 20 seeds) and the bootstrap."),
        click.option("--json", "as_json", is_flag=True, help="Print the report as JSON instead of the table."),
        click.option("--markdown", type=click.Path(path_type=Path, dir_okay=False), default=None,
                     help="Also write the report as markdown to this file."),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _num(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _p(value: float | None) -> str:
    return "-" if value is None else f"{value:.2g}" if value < 0.001 else f"{value:.4f}".rstrip("0").rstrip(".")


def _show(report, title: str) -> None:
    table = Table(title=title, title_justify="left")
    for name, justify in (("condition", "left"), ("metric", "left"), ("seeds", "right"), ("baseline", "right"),
                          ("candidate", "right"), ("Δ [t interval]", "right"), ("p exact (Holm)", "right"),
                          ("d_z [interval]", "right"), ("MDE", "right"), ("verdict", "left")):
        table.add_column(name, justify=justify, no_wrap=name in ("metric", "verdict"))
    for comparison in report.comparisons:
        for m in comparison.metrics:
            lo, hi = m.t_interval
            dz_lo, dz_hi = m.cohens_dz_interval or (None, None)
            dz = "-" if m.cohens_dz is None else f"{m.cohens_dz:.2f} [{_num(dz_lo, 2)}, {_num(dz_hi, 2)}]"
            colour = _COLOURS.get(m.verdict, "white")
            table.add_row(comparison.candidate, m.metric, str(m.n_seeds), _num(m.baseline_mean),
                          _num(m.candidate_mean), f"{m.mean_difference:+.4f} [{lo:.4f}, {hi:.4f}]",
                          f"{_p(m.sign_flip['p'])} ({_p(m.p_holm)})", dz, _num(m.power.get("mde")),
                          f"[{colour}]{m.verdict}[/]")
    console.print(table)
    for comparison in report.comparisons:
        for m in comparison.metrics:
            colour = _COLOURS.get(m.verdict, "white")
            console.print(f"[{colour}]{m.verdict}[/] {comparison.candidate} vs {comparison.baseline}, {m.metric}: "
                          f"{m.reason}", highlight=False)
            for note in m.notes:
                console.print(f"  note: {note}", highlight=False)
            if m.two_way_bootstrap:
                b = m.two_way_bootstrap
                console.print(f"  two-way (seed, task) bootstrap over {b['seeds']} seeds × {b['tasks']} tasks: "
                              f"Δ {b['mean']:+.4f} [{b['lo']:.4f}, {b['hi']:.4f}] ({b['resamples']} resamples)",
                              highlight=False)
        if comparison.dropped_seeds:
            console.print(f"  seeds left out (unpaired): {comparison.dropped_seeds}", highlight=False)
    for run in report.missing_runs:
        console.print(f"[yellow]no data[/] {run['condition']} seed {run['seed']} ({run['status']})", highlight=False)


def _emit(report, title: str, as_json: bool, markdown: Path | None, out: Path | None) -> None:
    from ..research.stats import report_json, report_markdown
    from ..runs import atomic_write_text

    text = report_json(report)
    if out is not None:
        atomic_write_text(out, text)
    if markdown is not None:
        atomic_write_text(markdown, report_markdown(report))
    if as_json:
        click.echo(text, nl=False)
        return
    _show(report, title)
    written = [str(p) for p in (out, markdown) if p is not None]
    if written:
        console.print(f"wrote {' and '.join(written)}", highlight=False)


@click.command("stats")
@click.argument("campaign_dir", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--baseline", default=None, help="The condition the others are compared with [default: [stats] "
                                                "baseline, else the first condition].")
@click.option("--before-after", is_flag=True,
              help="Compare each condition with itself before training (its step-0 evaluation) instead of "
                   "with the baseline: did training change the metric?")
@_common_options
def stats_command(campaign_dir: Path, baseline: str | None, before_after: bool, metrics: tuple[str, ...],
                  alpha: float | None, equivalence_margin: float | None, target_effect: float | None,
                  paired_only: bool, seed: int, as_json: bool, markdown: Path | None) -> None:
    """Compare every condition of a campaign with its baseline, seed by seed, and give verdicts.

    CAMPAIGN_DIR is the directory `rollmarket campaign` wrote. Per metric: the exact sign-flip p
    (Holm across the metrics), the t interval of the paired difference, Cohen's d_z, power and the
    minimum detectable effect, TOST against [stats] equivalence_margin, and a verdict
    (CONFIRMED, REFUTED, EQUIVALENT, INCONCLUSIVE) with the evidence it rests on
    (docs/statistics.md). Writes CAMPAIGN_DIR/stats.json."""
    from ..research.stats import campaign_report, load_campaign

    campaign = load_campaign(campaign_dir)
    report = campaign_report(campaign, baseline=baseline, metrics=list(metrics) or None, before_after=before_after,
                             alpha=alpha,
                             equivalence_margin=equivalence_margin, target_effect=target_effect,
                             paired_only=paired_only or None, seed=seed)
    title = f"campaign {campaign.name}: " + ("after vs before training" if before_after else f"vs {report.baseline}")
    _emit(report, title, as_json, markdown, campaign_dir / ("stats-before-after.json" if before_after else "stats.json"))


def _side_name(runs, default: str) -> str:
    labels = {run.condition for run in runs}
    return labels.pop() if len(labels) == 1 and None not in labels else default


@click.command("compare", context_settings={"ignore_unknown_options": True})
@click.argument("runs", nargs=-1, required=True, metavar="RUN_OR_GLOB... --vs RUN_OR_GLOB...")
@_common_options
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Also write the report as JSON to this file.")
@click.pass_context
def compare_command(ctx: click.Context, runs: tuple[str, ...], metrics: tuple[str, ...], alpha: float | None,
                    equivalence_margin: float | None, target_effect: float | None, paired_only: bool, seed: int,
                    as_json: bool, markdown: Path | None, out: Path | None) -> None:
    """Compare any training runs with others, paired by seed, and give verdicts.

    Candidate runs come before --vs, baseline runs after it: run directories, globs or directories
    of runs (unquoted shell globs work). Runs pair by the metrics rows' seed label, else by their
    seed settings. The same tests and verdicts as `rollmarket stats` (docs/statistics.md)."""
    from ..research.stats import Metric, StatsReport, StatsSettings, compare, load_run, resolve_run_dirs
    from dataclasses import asdict

    args = list(runs)
    unknown = [a for a in args if a.startswith("-") and a != "--vs"]
    if unknown:
        raise click.UsageError(f"no such option: {unknown[0]}", ctx=ctx)
    if args.count("--vs") != 1 or args.index("--vs") in (0, len(args) - 1):
        raise click.UsageError("give candidate runs, then --vs, then baseline runs", ctx=ctx)
    split = args.index("--vs")
    candidate = [load_run(p) for a in args[:split] for p in resolve_run_dirs(a)]
    baseline = [load_run(p) for a in args[split + 1:] for p in resolve_run_dirs(a)]
    shared = {r.path.resolve() for r in candidate} & {r.path.resolve() for r in baseline}
    if shared:
        raise click.UsageError(f"{sorted(shared)[0]} is on both sides of --vs", ctx=ctx)
    settings = StatsSettings.from_table({}, alpha=alpha, equivalence_margin=equivalence_margin,
                                        target_effect=target_effect, paired_only=paired_only or None, seed=seed)
    parsed = [Metric.parse(m) for m in (metrics or ("eval/pass@1@final",))]
    base_name, cand_name = _side_name(baseline, "baseline"), _side_name(candidate, "candidate")
    if base_name == cand_name:
        base_name, cand_name = "baseline", "candidate"
    comparison = compare(baseline, candidate, parsed, settings, baseline_name=base_name, candidate_name=cand_name)
    report = StatsReport(kind="compare", source=" ".join(args), baseline=base_name,
                         metrics=[m.spec for m in parsed], settings=asdict(settings), comparisons=[comparison])
    _emit(report, f"{cand_name} vs {base_name}", as_json, markdown, out)
