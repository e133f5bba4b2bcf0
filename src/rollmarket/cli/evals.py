"""`rollmarket eval` (score stored rollouts again, compare two models' evals task by task) and
`rollmarket curriculum` (pick training tasks from a reward profile): research/evals.py and
tasks/curriculum.py do the work; this prints and writes."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import click
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

console = Console()

_COLOURS = {"CONFIRMED": "green", "REFUTED": "red", "EQUIVALENT": "cyan", "INCONCLUSIVE": "yellow"}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}"


@click.group("eval")
def eval_group() -> None:
    """Score stored rollouts again and compare two models' evals by task and by seed."""


def _scorer(verifier: str, family: str | None, args: dict | None, stack: ExitStack):
    """(the scorer, its label, a check of one retargeted task or None): a resources server for a
    URL (scoring with `family`, else each task's own verifier), else the local family named."""
    from ..research.evals import retarget

    if verifier.startswith(("http://", "https://")):
        from ..verifiers.client import ResourcesClient

        # No session is seeded: /verify scores the task and trajectory in the body and keeps nothing.
        client = stack.enter_context(ResourcesClient(verifier))
        return ((lambda task, run: client.verify_trajectory(retarget(task, family, args), run)),
                verifier + (f" ({family})" if family else ""), None)
    if family is not None:
        raise click.BadParameter("--family goes with a resources server's URL in --verifier", param_hint="--family")
    from ..verifiers.verifier import VERIFIERS, verify_trajectory

    if verifier not in VERIFIERS:
        raise click.BadParameter(f"unknown verifier {verifier!r}; known: {', '.join(sorted(VERIFIERS))} "
                                 f"(or a resources server's URL)", param_hint="--verifier")
    return ((lambda task, run: verify_trajectory(retarget(task, verifier, args), run)), verifier,
            lambda task: VERIFIERS[verifier].check(retarget(task, verifier, args)))


@eval_group.command("reverify")
@click.argument("rollouts", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--tasks", "tasks_spec", required=True,
              help="The tasks the rollouts were collected on: a tasks JSONL file or a suite (NAME or NAME:SPLIT).")
@click.option("--verifier", required=True, metavar="NAME|URL",
              help="A local verifier family (`rollmarket verifier` lists them in /health) or a resources "
                   "server's base URL (its POST /verify scores each run).")
@click.option("--family", default=None, metavar="NAME",
              help="With a URL: the verifier family the server scores with [default: each task's own].")
@click.option("--verifier-args", default=None, metavar="JSON",
              help="The verifier's args for every task [default: the task's own args when the verifier is the "
                   "task's own, else none].")
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="Re-scored rollouts JSONL (each run's old verification kept in info.previous); the report "
                   "goes beside it as .reverify.json.")
@click.option("--concurrency", type=click.IntRange(1, 256), default=4, show_default=True,
              help="Runs scored at once (a resources server or an LLM judge answers several requests together).")
def reverify_command(rollouts: Path, tasks_spec: str, verifier: str, family: str | None, verifier_args: str | None,
                     out: Path, concurrency: int) -> None:
    """Score stored rollouts again with another verifier and show where it disagrees with the old one.

    Writes the re-scored runs to --out (profile or compare them like any rollouts) and a report
    with the old and new rewards side by side and the disagreement table. Each result is appended
    to a journal beside --out (.reverify-journal.jsonl) as it finishes: run the same command again
    after a crash and only the runs not in it are scored; the journal goes once --out is written."""
    import hashlib

    from ..research.evals import ReverifyJournal, reverify, reverify_json
    from ..runs import atomic_write_text
    from ..verifiers.profile import read_rollouts
    from ..verifiers.verifier import VerifierConfigError
    from .agents import _load_tasks

    try:
        args = None if verifier_args is None else json.loads(verifier_args)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON ({exc})", param_hint="--verifier-args") from None
    if args is not None and not isinstance(args, dict):
        raise click.BadParameter("must be a JSON object", param_hint="--verifier-args")
    if out.resolve() == rollouts.resolve():
        raise click.BadParameter("must not be the rollouts file itself", param_hint="--out")
    tasks = _load_tasks(tasks_spec)
    runs, problems = read_rollouts(rollouts)
    for problem in problems[:5]:
        console.print(f"[yellow]skipped[/] {rollouts}: {problem}", highlight=False)
    with ExitStack() as stack:
        score, label, check = _scorer(verifier, family, args, stack)
        if check is not None:
            used = {run.task_id for run in runs}
            for task in tasks:
                if task.task_id in used:
                    try:
                        check(task)
                    except VerifierConfigError as exc:
                        raise click.BadParameter(f"task {task.task_id}: {exc}", param_hint="--verifier") from None
        # What the results depend on: a journal of other work is refused, never mixed in.
        fingerprint = {"rollouts": hashlib.sha256(rollouts.read_bytes()).hexdigest(),
                       "tasks": hashlib.sha256("".join(sorted(t.model_dump_json() for t in tasks)).encode()).hexdigest(),
                       "verifier": label, "verifier_args": args}
        journal = ReverifyJournal(out.with_name(out.name.removesuffix(".jsonl") + ".reverify-journal.jsonl"),
                                  fingerprint)
        done = journal.load()
        if done:
            console.print(f"resuming: {len(done)} of {len(runs)} runs already scored in {journal.path}",
                          highlight=False)

        def finished(index, run) -> None:
            journal.append(index, run)
            progress.advance(bar)

        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            bar = progress.add_task(f"reverify with {label}", total=len(runs), completed=len(done))
            try:
                rescored, report = reverify(runs, tasks, score, verifier=label, source=str(rollouts),
                                            concurrency=concurrency, done=done, on_result=finished)
            finally:
                journal.close()
    atomic_write_text(out, "".join(run.model_dump_json() + "\n" for run in rescored))
    report_path = out.with_name(out.name.removesuffix(".jsonl") + ".reverify.json")
    atomic_write_text(report_path, reverify_json(report))
    journal.path.unlink(missing_ok=True)
    table = Table(title=f"{rollouts.name}: {report.runs} runs, old verification vs {label}", title_justify="left")
    table.add_column("old \\ new")
    table.add_column("passed", justify="right")
    table.add_column("failed", justify="right")
    for old, row in report.table.items():
        table.add_row(old, str(row["passed"]), str(row["failed"]))
    console.print(table)
    console.print(f"agree on {report.agree} of {report.runs} runs; pass rate {_pct(report.old_pass_rate)}% → "
                  f"{_pct(report.new_pass_rate)}%; disagreements: "
                  + (", ".join(f"{k} {v}" for k, v in report.disagreements.items()) or "none"), highlight=False)
    worst = sorted((t for t in report.by_task if t["disagree"]), key=lambda t: -t["disagree"])[:10]
    if worst:
        tasks_table = Table(title="tasks where they disagree most", title_justify="left")
        for name in ("task", "runs", "old correct", "new correct", "disagree"):
            tasks_table.add_column(name, justify="left" if name == "task" else "right")
        for t in worst:
            tasks_table.add_row(t["task_id"], str(t["runs"]), str(t["old_correct"]), str(t["new_correct"]),
                                str(t["disagree"]))
        console.print(tasks_table)
    console.print(f"wrote {out} and {report_path}", highlight=False)


def _comparison_table(comparison, title: str, units: str) -> None:
    table = Table(title=title, title_justify="left")
    for name in ("metric", units, "baseline", "candidate", "Δ \\[t interval]", "p exact (Holm)", "d_z", "verdict"):
        table.add_column(name, justify="left" if name in ("metric", "verdict") else "right")
    for m in comparison.metrics:
        lo, hi = m.t_interval
        colour = _COLOURS.get(m.verdict, "white")
        table.add_row(m.metric, str(m.n_seeds), f"{m.baseline_mean:.4f}", f"{m.candidate_mean:.4f}",
                      f"{m.mean_difference:+.4f} [{lo:.4f}, {hi:.4f}]",
                      f"{m.sign_flip['p']:.4g} ({m.p_holm:.4g})",
                      "-" if m.cohens_dz is None else f"{m.cohens_dz:.2f}", f"[{colour}]{m.verdict}[/]")
    console.print(table)


@eval_group.command("compare")
@click.argument("candidate", type=click.Path(path_type=Path, exists=True))
@click.argument("baseline", type=click.Path(path_type=Path, exists=True))
@click.option("--metric", "metrics", multiple=True, type=click.Choice(["pass@1", "pass@4", "pass@16", "reward"]),
              help="A per-task number to compare, repeatable [default: pass@1].")
@click.option("--alpha", type=float, default=None, help="Significance level [default: 0.05].")
@click.option("--margin", "equivalence_margin", type=float, default=None,
              help="Equivalence margin for TOST, in the metric's units [default: none: no EQUIVALENT verdict].")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the Monte Carlo sign flips.")
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), default=None,
              help="Also write the comparison as JSON to this file.")
def compare_command(candidate: Path, baseline: Path, metrics: tuple[str, ...], alpha: float | None,
                    equivalence_margin: float | None, seed: int, out: Path | None) -> None:
    """Compare two models' evals on the same tasks: paired differences, intervals and verdicts.

    CANDIDATE and BASELINE are rollouts JSONL (`rollmarket collect`) or profiles (`rollmarket
    profile`), or directories holding one of those per training seed (seed0.jsonl, seed1.jsonl,
    ...; the sides pair by file name). One eval a side: tasks are the unit (each task's pass@k or
    mean reward is one number per side). One per seed: the seed is the unit of the verdicts (each
    seed's mean over the tasks, paired by seed, and a bootstrap over seeds and tasks), with the
    per-task comparison beside it. Both get the exact sign-flip test, the t interval, TOST and the
    verdicts of `rollmarket compare` (docs/statistics.md)."""
    from ..research.evals import compare_evals, comparison_json, load_side
    from ..research.stats import StatsSettings
    from ..runs import atomic_write_text

    settings = StatsSettings.from_table({}, alpha=alpha, equivalence_margin=equivalence_margin, seed=seed)
    base_name, cand_name = baseline.name, candidate.name
    if base_name == cand_name:
        base_name, cand_name = str(baseline), str(candidate)
    report = compare_evals(load_side(baseline), load_side(candidate), list(metrics) or ["pass@1"], settings,
                           baseline_name=base_name, candidate_name=cand_name)
    seeded = report.seed_comparison is not None
    _comparison_table(report.comparison, f"{cand_name} vs {base_name}, task by task"
                      + (" (each task averaged over the seeds; interval over tasks)" if seeded else ""), "tasks")
    if seeded:
        _comparison_table(report.seed_comparison, f"{cand_name} vs {base_name}, seed by seed (the unit of the "
                          f"verdicts; t interval over seeds)", "seeds")
        for m in report.seed_comparison.metrics:
            boot = m.two_way_bootstrap
            console.print(f"{m.metric}: two-way bootstrap over {boot['seeds']} seeds × {boot['tasks']} tasks: "
                          f"Δ {boot['mean']:+.4f} [{boot['lo']:.4f}, {boot['hi']:.4f}]", highlight=False)
    for m in (report.seed_comparison or report.comparison).metrics:
        console.print(f"[{_COLOURS.get(m.verdict, 'white')}]{m.verdict}[/] {m.metric} ({m.unit} as the unit): "
                      f"{m.reason}", highlight=False)
    for side, only in ((base_name, report.tasks_only_baseline), (cand_name, report.tasks_only_candidate)):
        if only:
            console.print(f"[yellow]note[/] {len(only)} task(s) only in {side}, left out: {only[:5]}",
                          highlight=False)
    if out is not None:
        atomic_write_text(out, comparison_json(report))
        console.print(f"wrote {out}", highlight=False)


@click.command("curriculum")
@click.argument("profile", type=click.Path(path_type=Path, exists=True, dir_okay=False))
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="The curriculum JSON to write (`rollmarket train rollout.curriculum=PATH` reads it).")
@click.option("--max-pass", type=click.FloatRange(0, 1), default=0.9, show_default=True,
              help="Tasks with pass@1 at or above this are solved: dropped.")
@click.option("--min-pass", type=click.FloatRange(0, 1), default=0.0, show_default=True,
              help="Tasks with pass@1 at or below this are hopeless: dropped.")
@click.option("--min-samples", type=click.IntRange(1), default=4, show_default=True,
              help="Tasks with fewer samples are dropped as unmeasured.")
@click.option("--mode", type=click.Choice(["weight", "keep"]), default="weight", show_default=True,
              help="weight: sample kept tasks in proportion to p(1 − p); keep: uniformly.")
def curriculum_command(profile: Path, out: Path, max_pass: float, min_pass: float, min_samples: int,
                       mode: str) -> None:
    """Pick training tasks from a reward profile: drop the solved and the hopeless, keep the learnable.

    PROFILE is a `rollmarket profile` JSON or rollouts JSONL of the training tasks. Train on the
    result with `rollmarket train CONFIG rollout.curriculum=OUT`."""
    from pydantic import ValidationError

    from ..research.evals import load_profile
    from ..runs import atomic_write_text
    from ..tasks.curriculum import CurriculumSettings, build_curriculum

    try:
        settings = CurriculumSettings(max_pass=max_pass, min_pass=min_pass, min_samples=min_samples, mode=mode)
    except ValidationError as exc:
        raise click.BadParameter(exc.errors()[0]["msg"], param_hint="--min-pass/--max-pass") from None
    curriculum = build_curriculum(load_profile(profile), settings)
    atomic_write_text(out, curriculum.model_dump_json(indent=2) + "\n")
    table = Table(title=f"{profile.name}: {len(curriculum.tasks)} tasks kept", title_justify="left")
    for name in ("task", "n", "pass@1 %", "weight"):
        table.add_column(name, justify="left" if name == "task" else "right")
    for t in curriculum.tasks:
        table.add_row(t.task_id, str(t.n), _pct(t.pass_at_1), f"{t.weight:.3f}")
    console.print(table)
    console.print(f"dropped: {len(curriculum.solved)} solved (pass@1 ≥ {max_pass:g}), {len(curriculum.hopeless)} "
                  f"hopeless (pass@1 ≤ {min_pass:g}), {len(curriculum.unmeasured)} with < {min_samples} samples",
                  highlight=False)
    console.print(f"wrote {out}; train on it with rollout.curriculum={out}", highlight=False)
