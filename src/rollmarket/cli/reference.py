"""Render the CLI reference (docs/cli.md) from the commands' own --help.

    python -m rollmarket.cli.reference > docs/cli.md
"""

from __future__ import annotations

import click

from .main import main


def _walk(command: click.Command, path: list[str]):
    yield path, command
    if isinstance(command, click.Group):
        for name in sorted(command.list_commands(click.Context(command))):
            yield from _walk(command.get_command(click.Context(command), name), [*path, name])


def render() -> str:
    parts = ["# CLI reference", "",
             "Generated from `--help` by `python -m rollmarket.cli.reference > docs/cli.md`; "
             "a test fails when this file and the commands disagree.", ""]
    for path, command in _walk(main, ["rollmarket"]):
        info_name = " ".join(path)
        with click.Context(command, info_name=info_name, terminal_width=100, max_content_width=100) as ctx:
            text = command.get_help(ctx)
        parts += [f"## `{info_name}`", "", "```text", text.rstrip(), "```", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
