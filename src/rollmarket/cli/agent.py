"""`rollmarket agent`: the agent loop as an HTTP service (POST /run)."""

from __future__ import annotations

import click
from rich.console import Console

from .. import __version__
from ..agents.server import AgentServerSettings
from .options import settings_options, validation_problems

console = Console(stderr=True)


@click.group("agent")
def agent() -> None:
    """Serve the agent loop over HTTP."""


@agent.command("serve")
@click.option("--model-url", required=True, help="OpenAI-compatible model server, e.g. http://127.0.0.1:8000/v1.")
@click.option("--resources-url", required=True,
              help="Resources server (`rollmarket verifier serve`) for tools and /verify.")
@click.option("--loop", type=click.Choice(["tool", "single"]), default="tool", show_default=True,
              help="tool: the tool-calling loop; single: one model call without tools, then /verify.")
@settings_options(AgentServerSettings, skip=("model_url", "resources_url", "loop"))
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--access-log/--no-access-log", default=False, show_default=True, help="Log every request.")
def agent_serve(log_level: str, access_log: bool, **values) -> None:
    """Serve POST /run: run one task on the agent loop against a model server and a resources server.

    Each run opens its own resources session, so concurrent runs never share files or tool calls.
    The body is rollmarket's ({"task", "sampling", "sample_index"}) or NeMo Gym's
    ({"responses_create_params", <task fields>}); the answer has the request's shape unless
    ?shape=gym or ?shape=rollmarket asks for the other (docs/gym.md).
    """
    from pydantic import ValidationError

    from ..agents.server import serve
    from ..localhost import check_port

    try:
        settings = AgentServerSettings(**{k: v for k, v in values.items() if v is not None})
    except ValidationError as exc:
        raise click.UsageError(validation_problems(exc)) from None
    check_port(settings.host, settings.port)
    console.print(f"[bold]rollmarket agent[/] {__version__} on http://{settings.host}:{settings.port}: the "
                  f"{settings.loop} loop, model {settings.model_url}, resources {settings.resources_url}",
                  highlight=False)
    serve(settings, log_level=log_level, access_log=access_log)
