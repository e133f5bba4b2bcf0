"""`rollmarket dashboard`: serve the dashboard of a runs directory, or export it as static files."""

from __future__ import annotations

from pathlib import Path

import click
from rich.console import Console

console = Console(stderr=True)


@click.command("dashboard")
@click.option("--runs", "runs_dir", type=click.Path(path_type=Path, file_okay=False), default=Path("runs"),
              show_default=True, help="Directory whose runs are shown: training runs, demos, campaigns, observatory runs and "
                   "collections, found up to four levels deep.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to serve on.")
@click.option("--port", default=8080, show_default=True, help="Port to serve on.")
@click.option("--static", "static_dir", type=click.Path(path_type=Path, file_okay=False), default=None,
              help="Write the whole dashboard into this directory as files (opens from file://, no network) "
                   "instead of serving it.")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), help="The server's log level.")
def dashboard(runs_dir: Path, host: str, port: int, static_dir: Path | None, log_level: str) -> None:
    """The dashboard: every run with its status; a training run's curves (live while it runs); the
    observatory's mismatch matrices, router matrix, worst token, length scaling, agent divergence
    and trajectory viewer. Every page has a .json twin (same path + .json)."""
    if static_dir is not None:
        from ..dashboard import export_static

        with console.status(f"exporting {runs_dir} to {static_dir}"):
            summary = export_static(runs_dir, static_dir)
        console.print(f"wrote {summary.pages} pages ({summary.training} training runs, {summary.runs} observatory runs, "
                      f"{summary.campaigns} campaigns, {summary.trajectories} trajectory pages, "
                      f"{summary.rollout_pages} rollouts pages) "
                      f"to [bold]{static_dir}[/]; open {(static_dir / 'index.html').resolve().as_uri()}",
                      highlight=False)
        return
    from ..localhost import claim_port

    sock = claim_port(host, port)
    import uvicorn

    from ..dashboard import create_dashboard_app

    app = create_dashboard_app(runs_dir)
    console.print(f"[bold]rollmarket dashboard[/] for {runs_dir} on http://{host}:{port}/", highlight=False)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)).run(
        sockets=[sock])
