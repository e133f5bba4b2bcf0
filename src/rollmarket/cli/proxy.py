"""`rollmarket proxy` (the capture proxy) and `rollmarket captures` (what it recorded)."""

from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from .. import __version__
from ..proxy.settings import ProxySettings
from .options import settings_options

console = Console()


@click.command("proxy")
@settings_options(ProxySettings)
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--access-log/--no-access-log", default=False, show_default=True, help="Log every request.")
def proxy(log_level: str, access_log: bool, **values) -> None:
    """Forward OpenAI-compatible calls to an upstream server and record token ids, logprobs and experts."""
    from ..localhost import check_port
    from ..proxy.server import serve

    settings = ProxySettings(**{k: v for k, v in values.items() if v is not None})
    check_port(settings.host, settings.port)
    console.print(f"[bold]rollmarket proxy[/] {__version__} on http://{settings.host}:{settings.port}/v1 "
                  f"-> {settings.upstream}/v1; captures in {settings.store}"
                  f" ({'extras kept' if settings.keep_extras else 'extras stripped'})", highlight=False)
    serve(settings, log_level=log_level, access_log=access_log)


@click.group()
def captures() -> None:
    """Read what a capture proxy recorded."""


_store = click.option("--store", type=click.Path(path_type=Path, exists=True, dir_okay=False), required=True,
                      help="The proxy's SQLite capture file.")


@captures.command("export")
@_store
@click.option("--out", type=click.Path(path_type=Path, dir_okay=False), required=True,
              help="JSONL file to write, one capture per line ('-' for stdout).")
@click.option("--conversation", default=None, help="Only the captures of this conversation.")
@click.option("--since", "since_seq", default=0, show_default=True, help="Only captures after this sequence number.")
@click.option("--errors/--no-errors", default=True, show_default=True, help="Include calls that did not end ok.")
def captures_export(store: Path, out: Path, conversation: str | None, since_seq: int, errors: bool) -> None:
    """Write captures as JSON lines (token arrays as lists)."""
    from ..contracts.capture import CaptureOutcome
    from ..proxy.store import CaptureStore

    source = CaptureStore(store)
    written = 0
    stdout = str(out) == "-"
    handle = click.get_text_stream("stdout") if stdout else open(out, "w", encoding="utf-8")
    try:
        for _, capture in source.iter_captures(conversation=conversation, since_seq=since_seq):
            if not errors and capture.outcome is not CaptureOutcome.ok:
                continue
            handle.write(capture.model_dump_json() + "\n")
            written += 1
    finally:
        if not stdout:
            handle.close()
    if not stdout:
        console.print(f"wrote {written} captures to [bold]{out}[/]", highlight=False)


@captures.command("ls")
@_store
@click.option("--limit", default=20, show_default=True, help="How many of the newest captures to show.")
def captures_ls(store: Path, limit: int) -> None:
    """Show the newest captures."""
    from ..proxy.store import CaptureStore

    source = CaptureStore(store)
    table = Table("seq", "time (UTC)", "capture", "conversation", "turn", "endpoint", "model", "status",
                  "outcome", "n", "prompt", "response")
    for row in source.summaries(limit=limit):
        when = datetime.fromtimestamp(row["received_at"], timezone.utc).strftime("%H:%M:%S.%f")[:-3]
        table.add_row(str(row["seq"]), when, row["capture_id"], row["conversation_id"], str(row["turn_index"]),
                      row["endpoint"].removeprefix("/v1/") + (" (stream)" if row["stream"] else ""),
                      row["model"] or "", str(row["status_code"]), row["outcome"], str(row["n_choices"]),
                      str(row["prompt_tokens"]), str(row["response_tokens"]))
    console.print(table)
    console.print(f"{source.count()} captures in {store}", highlight=False)
