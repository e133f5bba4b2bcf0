"""`rollmarket verifier`: the verifiers as a resources server (tools and /verify over HTTP), and NeMo Gym
dataset files imported as tasks."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import click
from rich.console import Console

from .. import __version__
from ..verifiers.settings import ResourcesSettings
from .options import settings_options

console = Console(stderr=True)


@click.group("verifier")
def verifier() -> None:
    """Serve the verifiers and tools over HTTP."""


@verifier.command("serve")
@settings_options(ResourcesSettings)
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--access-log/--no-access-log", default=False, show_default=True, help="Log every request.")
def verifier_serve(log_level: str, access_log: bool, **values) -> None:
    """Serve POST /seed_session, POST /<tool>, POST /verify and POST /close_session.

    Each session (cookie rollmarket_session or header x-rollmarket-session) gets its own copy of
    its task's files, its own tool state and a record of its tool calls, which /verify scores
    when the request gives none.
    """
    from ..verifiers.server import serve
    from ..verifiers.verifier import VERIFIERS

    from ..localhost import check_port

    settings = ResourcesSettings(**{k: v for k, v in values.items() if v is not None})
    check_port(settings.host, settings.port)
    console.print(f"[bold]rollmarket verifier[/] {__version__} on http://{settings.host}:{settings.port} "
                  f"(verifiers: {', '.join(sorted(VERIFIERS))}; sessions idle {settings.session_ttl_s:g}s, "
                  f"at most {settings.max_sessions})", highlight=False)
    serve(settings, log_level=log_level, access_log=access_log)


@verifier.command("import-gym")
@click.argument("rows_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), metavar="ROWS")
@click.option("--out", "out_file", type=click.Path(path_type=Path), required=True, help="Tasks file (JSONL) to write.")
@click.option("--dataset", default="auto", show_default=True,
              type=click.Choice(["auto", "math", "mcqa", "code", "instructions"]),
              help="The NeMo Gym dataset the rows were written for; auto: read it from each row's fields.")
def verifier_import_gym(rows_file: Path, out_file: Path, dataset: str) -> None:
    """Turn a NeMo Gym dataset file (JSONL rows) into a tasks file, one task per row.

    The rows' own fields (math's expected_answer, mcqa's options, code_gen's unit tests,
    instruction_following's instruction_id_list and kwargs) become each task's verifier and args,
    as /verify reads them. A row that does not fit stops the import, naming its line; nothing is
    written then.
    """
    from ..tasks.suites import write_tasks
    from ..verifiers.gym_rows import GymRowError, import_rows

    try:
        tasks = import_rows(rows_file.read_text(encoding="utf-8").splitlines(), dataset)
    except GymRowError as exc:
        raise click.ClickException(f"{rows_file}: {exc}") from None
    if not tasks:
        raise click.ClickException(f"{rows_file}: no rows")
    write_tasks(tasks, out_file)
    kinds = Counter(task.verifier for task in tasks)
    console.print(f"wrote {len(tasks)} tasks to {out_file} ("
                  f"{', '.join(f'{n} {name}' for name, n in sorted(kinds.items()))})", highlight=False)
