"""`rollmarket suites`: list, show, rebuild and export the shipped task suites."""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from ..contracts import TaskSpec
from ..tasks import suites as S

console = Console()
_split = click.option("--split", type=click.Choice(S.SPLITS), default="heldout", show_default=True)


@click.group()
def suites() -> None:
    """List, show, rebuild and export the shipped task suites (JSONL of TaskSpec lines)."""


def _verifiers(tasks: list[TaskSpec]) -> list[str]:
    names: set[str] = set()
    for task in tasks:
        names.add(task.verifier)
        names.update(c["verifier"] for c in task.verifier_args.get("components", []))
    return sorted(names)


@suites.command("ls")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per suite.")
def suites_ls(as_json: bool) -> None:
    """Show every suite: what it asks, its kinds, split sizes and the verifiers its tasks use."""
    table = Table("suite", "description", "kinds", "train", "heldout", "verifiers")
    for name, suite in S.SUITES.items():
        loaded = {split: S.load_suite(name, split) for split in S.SPLITS}
        kinds = Counter(t.metadata["kind"] for t in loaded["train"] + loaded["heldout"])
        verifiers = _verifiers(loaded["train"] + loaded["heldout"])
        if as_json:
            click.echo(json.dumps({"name": name, "description": suite.description, "kinds": dict(kinds),
                                   "sizes": {s: len(t) for s, t in loaded.items()}, "verifiers": verifiers}))
            continue
        table.add_row(name, suite.description, ", ".join(sorted(kinds)), str(len(loaded["train"])),
                      str(len(loaded["heldout"])), ", ".join(verifiers))
    if not as_json:
        console.print(table)


@suites.command("show")
@click.argument("name", type=click.Choice(S.suite_names()), metavar="NAME")
@_split
@click.option("--n", "count", default=3, show_default=True, help="How many tasks (from the top of the file).")
@click.option("--kind", default=None, help="Only tasks of this kind (e.g. python_eval, chain5, read_file).")
@click.option("--json", "as_json", is_flag=True, help="Print the TaskSpec lines as they are stored.")
def suites_show(name: str, split: str, count: int, kind: str | None, as_json: bool) -> None:
    """Print tasks of suite NAME: the question, tools, verifier, answer and gold tool calls."""
    tasks = [t for t in S.load_suite(name, split) if kind is None or t.metadata["kind"] == kind][:count]
    for task in tasks:
        if as_json:
            click.echo(task.model_dump_json())
            continue
        meta = task.metadata
        console.rule(f"[bold]{task.task_id}[/]  {meta['kind']}  ({meta['source_task']})")
        console.print(f"[bold]Q[/] {task.messages[-1]['content']}", highlight=False)
        console.print(f"[dim]tools[/] {', '.join(task.tools)}   [dim]verifier[/] {task.verifier}   "
                      f"[dim]answer[/] [green]{task.answer}[/]", highlight=False)
        for i, call in enumerate(meta["gold_calls"], start=1):
            console.print(f"  [dim]{i}.[/] {call['name']} {json.dumps(call['arguments'])}", highlight=False)
        if task.files:
            console.print(f"  [dim]files[/] {', '.join(task.files)}", highlight=False)


@suites.command("build")
@click.option("--out", "out_dir", type=click.Path(path_type=Path), default=None,
              help="Write <out>/<suite>/<split>.jsonl [default: the package's data/suites].")
@click.option("--check", is_flag=True, help="Write nothing; exit 1 if a shipped file differs from a fresh build.")
def suites_build(out_dir: Path | None, check: bool) -> None:
    """Regenerate every suite's train and heldout JSONL (deterministic: same code, same bytes)."""
    if check:
        stale = [f"{name}/{split}" for name in S.SUITES for split in S.SPLITS
                 if S.suite_path(name, split).read_text(encoding="utf-8") != S.tasks_jsonl(S.build_suite(name, split))]
        if stale:
            console.print(f"[red]stale:[/] {', '.join(stale)}; run `rollmarket suites build`")
            sys.exit(1)
        console.print("shipped suites match a fresh build")
        return
    with console.status("building suites"):
        paths = S.build_all(out_dir)
    for path in paths:
        console.print(f"wrote {path} ({sum(1 for _ in path.open())} tasks)", highlight=False)


@suites.command("export")
@click.argument("name", type=click.Choice(S.suite_names()), metavar="NAME")
@click.option("--split", type=click.Choice(S.SPLITS), required=True)
@click.option("--out", "out_file", type=click.Path(path_type=Path), required=True, help="JSONL file to write.")
@click.option("--n", "count", default=None, type=int, help="Only the first N tasks [default: all].")
@click.option("--kind", default=None, help="Only tasks of this kind.")
def suites_export(name: str, split: str, out_file: Path, count: int | None, kind: str | None) -> None:
    """Write suite NAME's split as a tasks file (for `rollmarket collect --tasks FILE`)."""
    tasks = [t for t in S.load_suite(name, split) if kind is None or t.metadata["kind"] == kind]
    tasks = tasks[:count] if count is not None else tasks
    if not tasks:
        raise click.UsageError("no tasks match")
    S.write_tasks(tasks, out_file)
    console.print(f"wrote {len(tasks)} tasks to {out_file}", highlight=False)
