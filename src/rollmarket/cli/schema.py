"""`rollmarket schema`: the JSON Schema of every contract."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

console = Console()


@click.command()
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Directory to write <Contract>.schema.json files into.")
def schema(out_dir: Path) -> None:
    """Write the JSON Schema of every contract."""
    from ..contracts.schema import write_schemas

    written = write_schemas(out_dir)
    console.print(f"wrote {len(written)} schema files to [bold]{out_dir}[/]")
