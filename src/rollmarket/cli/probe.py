"""`rollmarket probe URL`: what an OpenAI-compatible endpoint gives an RL user."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

console = Console(stderr=True)

_STYLE = {"yes": "green", "partial": "yellow", "no": "red"}


@click.command("probe")
@click.argument("url")
@click.option("--model", default=None, help="Model to ask for (default: the first one GET /models lists).")
@click.option("--api-key", envvar="OPENAI_API_KEY", default=None, help="Bearer key, if the server wants one.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON on stdout instead of a table.")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the report (JSON) to this file; RUNS/probes/NAME.json shows as the dashboard's /probe/NAME.")
@click.option("--timeout", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Seconds to wait for each request.")
def probe(url: str, model: str | None, api_key: str | None, as_json: bool, out: Path | None,
          timeout: float) -> None:
    """Ask an OpenAI-compatible endpoint what it gives an RL user: token ids, logprobs, routed experts, seeds, tool calls, streaming.

    URL is the server's base (http://HOST:PORT or http://HOST:PORT/v1). A few small real requests
    are sent; each capability is yes, no or partial with the evidence seen. The exit code is 0
    whenever the endpoint could be probed, whatever it answered; 1 when it is unreachable, not
    OpenAI-compatible, refuses the key or does not serve --model.
    """
    from ..agents.probe import probe as run_probe

    with console.status(f"probing {url} ..."):
        report = run_probe(url, model=model, api_key=api_key, timeout=timeout)
    text = report.model_dump_json(indent=2)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
        console.print(f"wrote the report to [bold]{out}[/]", highlight=False)
    if as_json:
        click.echo(text)
        return
    table = Table(title=f"{report.url} — model {report.model}")
    table.add_column("capability")
    table.add_column("status")
    table.add_column("detail")
    for cap in report.capabilities:
        table.add_row(cap.name, f"[{_STYLE[cap.status]}]{cap.status}[/]", cap.detail)
    Console().print(table)
