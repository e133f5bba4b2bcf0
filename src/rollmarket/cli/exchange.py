"""`rollmarket exchange`: serve a rollout exchange, show its pool and its audit log."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from .. import __version__
from ..exchange.settings import ExchangeSettings
from ..gate import GateConfig
from .options import pick, settings_options

console = Console()


@click.group()
def exchange() -> None:
    """Run and inspect a rollout exchange."""


@exchange.command("serve")
@settings_options(ExchangeSettings, envvars={"trainer_token": "ROLLMARKET_TRAINER_TOKEN",
                                              "registration_token": "ROLLMARKET_REGISTRATION_TOKEN"})
@settings_options(GateConfig, prefix="gate_")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--access-log/--no-access-log", default=False, show_default=True, help="Log every request.")
def exchange_serve(log_level: str, access_log: bool, **values) -> None:
    """Serve an exchange over HTTP (FastAPI + uvicorn; SQLite in WAL mode, or PostgreSQL).

    `--db` names a SQLite file or a postgresql:// URL; several exchanges can serve one PostgreSQL
    database."""
    from ..exchange.server import serve
    from ..exchange.settings import redact_url
    from ..exchange.stores import check_store
    from ..localhost import check_port

    gate = GateConfig(**pick(values, "gate_"))
    fields = {k: v for k, v in values.items() if not k.startswith("gate_") and v is not None}
    settings = ExchangeSettings(**fields, gate=gate)
    if not settings.trainer_token:
        raise click.UsageError("--trainer-token (or ROLLMARKET_TRAINER_TOKEN) is required")
    check_port(settings.host, settings.port)
    check_store(settings.db)
    console.print(f"[bold]rollmarket exchange[/] {__version__} on http://{settings.host}:{settings.port} "
                  f"(db {redact_url(str(settings.db))}); docs at /docs", highlight=False)
    serve(settings, log_level=log_level, access_log=access_log)
def _trainer(url: str, token: str):
    from ..client import TrainerClient

    return TrainerClient(url, token)


_url = click.option("--url", default="http://127.0.0.1:8470", show_default=True, envvar="ROLLMARKET_URL",
                    help="Exchange base URL.")
_token = click.option("--token", required=True, envvar="ROLLMARKET_TRAINER_TOKEN", help="Trainer token.")


@exchange.command("status")
@_url
@_token
@click.option("--json", "as_json", is_flag=True, help="Print the PoolStatus JSON.")
def exchange_status(url: str, token: str, as_json: bool) -> None:
    """Show the pool: policy versions, quorum, workers, jobs and groups."""
    with _trainer(url, token) as trainer:
        status = trainer.pool()
    if as_json:
        click.echo(status.model_dump_json(indent=2))
        return
    console.print(f"active version [bold]{status.active_version}[/], published {status.published_version}, "
                  f"reload quorum {status.acks}/{status.quorum}")
    console.print(f"jobs {status.jobs}  leases {status.leases}  groups {status.groups}")
    table = Table("worker", "status", "engine", "loaded", "aligned", "leases", "quality", "price")
    for w in status.workers:
        table.add_row(w.worker_id, w.status, w.engine_name, str(w.loaded_version), "yes" if w.aligned else "no",
                      str(w.active_leases), f"{w.quality:.2f}", f"{w.price_hint:g}")
    console.print(table)


@exchange.command("audit")
@_url
@_token
@click.option("--kind", default=None, help="Event kind or prefix ending in '*' (e.g. 'lease.*').")
@click.option("--subject", default=None, help="Only events about this id.")
@click.option("--since", "since_seq", default=0, show_default=True, help="Events after this sequence number.")
@click.option("--limit", default=100, show_default=True)
def exchange_audit(url: str, token: str, kind: str | None, subject: str | None, since_seq: int, limit: int) -> None:
    """Print audit events as JSON lines."""
    with _trainer(url, token) as trainer:
        page = trainer.audit(since_seq=since_seq, kind=kind, subject=subject, limit=limit)
    for event in page.events:
        click.echo(event.model_dump_json())
