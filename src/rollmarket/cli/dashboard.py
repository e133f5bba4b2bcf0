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
@click.option("--exchange", "exchange_url", default=None, metavar="URL",
              help="A running exchange whose marketplace the /market page shows (needs --trainer-token).")
@click.option("--trainer-token", default=None, envvar="ROLLMARKET_TRAINER_TOKEN", show_envvar=True,
              help="The exchange's trainer token, for --exchange.")
@click.option("--exchange-db", type=click.Path(path_type=Path, dir_okay=False, exists=True), default=None,
              help="An exchange database file (opened read-only) whose marketplace the /market page shows; "
                   "--static exports that page too.")
@click.option("--log-level", default="warning", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]), help="The server's log level.")
def dashboard(runs_dir: Path, host: str, port: int, static_dir: Path | None, exchange_url: str | None,
              trainer_token: str | None, exchange_db: Path | None, log_level: str) -> None:
    """The dashboard: every run, training curves and rollouts, campaigns, the observatory, the
    marketplace and the open questions. A training run's curves follow it live; the observatory
    shows mismatch matrices, router matrix, worst token, length scaling, agent divergence and a
    trajectory viewer; --exchange or --exchange-db adds the marketplace. Every page has a .json
    twin (same path + .json)."""
    if exchange_url and exchange_db:
        raise click.UsageError("give --exchange or --exchange-db, not both")
    if exchange_url and not trainer_token:
        raise click.UsageError("--exchange needs --trainer-token (or ROLLMARKET_TRAINER_TOKEN)")
    if static_dir is not None:
        from ..dashboard import export_static

        if exchange_url:
            raise click.UsageError("--static exports a marketplace from --exchange-db, not from a running exchange")
        with console.status(f"exporting {runs_dir} to {static_dir}"):
            summary = export_static(runs_dir, static_dir, exchange_db=exchange_db)
        console.print(f"wrote {summary.pages} pages ({summary.training} training runs, {summary.runs} observatory runs, "
                      f"{summary.campaigns} campaigns, {summary.trajectories} trajectory pages, "
                      f"{summary.rollout_pages} rollouts pages) "
                      f"to [bold]{static_dir}[/]; open {(static_dir / 'index.html').resolve().as_uri()}",
                      highlight=False)
        if exchange_db is not None:
            console.print(f"marketplace: {(static_dir / 'market.html').resolve().as_uri()}", highlight=False)
        return
    from ..localhost import claim_port

    sock = claim_port(host, port)
    import uvicorn

    from ..dashboard import create_dashboard_app
    from ..dashboard.market import MarketSource

    market = MarketSource(exchange_url=exchange_url, trainer_token=trainer_token, exchange_db=exchange_db)
    app = create_dashboard_app(runs_dir, market)
    console.print(f"[bold]rollmarket dashboard[/] for {runs_dir} on http://{host}:{port}/", highlight=False)
    uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)).run(
        sockets=[sock])
