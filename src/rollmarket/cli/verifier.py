"""`rollmarket verifier`: the verifiers as a resources server (tools and /verify over HTTP)."""

from __future__ import annotations

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
