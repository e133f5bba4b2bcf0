"""Render the CLI reference (docs/cli.md) from the commands' own --help.

    python -m rollmarket.cli.reference > docs/cli.md
"""

from __future__ import annotations

import click

from .main import main


def _walk(command: click.Command, name: str, parent: click.Context | None = None):
    """(context, command) for `command` and every subcommand, each context a child of its group's
    as when the command runs, so settings such as `-h` reach them as users see them."""
    settings = {**command.context_settings, "terminal_width": 100, "max_content_width": 100}
    ctx = click.Context(command, info_name=name, parent=parent, **settings)
    yield ctx, command
    if isinstance(command, click.Group):
        for sub in sorted(command.list_commands(ctx)):
            yield from _walk(command.get_command(ctx, sub), sub, ctx)


def render() -> str:
    parts = ["# CLI reference", "",
             "Generated from `--help` by `python -m rollmarket.cli.reference > docs/cli.md`; "
             "a test fails when this file and the commands disagree.", "",
             "A mistake (a wrong path, suite, split, key or value, a taken port, an exchange that refuses) "
             "prints one line on stderr, `error: what — how to fix`, and exits with 2 for a usage error, "
             "1 otherwise. `rollmarket --debug ...` or `ROLLMARKET_DEBUG=1` shows the traceback instead; "
             "any other exception is a bug and always shows it. Servers claim their port before they load "
             "anything, so a taken port fails at once. Subcommands load on use: `rollmarket --help` and the "
             "services that need no model (exchange, proxy, verifier, dashboard) never import torch.", ""]
    for ctx, command in _walk(main, "rollmarket"):
        parts += [f"## `{ctx.command_path}`", "", "```text", command.get_help(ctx).rstrip(), "```", ""]
    return "\n".join(parts)


if __name__ == "__main__":
    print(render(), end="")
