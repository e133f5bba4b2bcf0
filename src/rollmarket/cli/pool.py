"""`rollmarket pool`: rollout workers as Ray actors on a Ray cluster, restarted and scaled by a supervisor."""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import asdict
from pathlib import Path

import click
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..worker.runner import WorkerSettings
from .agents import host_options, host_spec, worker_settings
from .options import settings_options, validation_problems

console = Console(stderr=True)

_ray = click.option("--ray", "address", envvar="RAY_ADDRESS", show_envvar=True,
                    help="The Ray cluster: the head's HOST:PORT (as `ray start --head` printed it).")
_name = click.argument("name")


def _need_address(address: str | None) -> str:
    if not address:
        raise click.UsageError("which Ray cluster? pass --ray HOST:PORT or set RAY_ADDRESS")
    return address


def _view(report) -> Group:
    """The pool as a table of slots and its latest events."""
    title = (f"pool {report.name}: {report.running}/{report.target} running, {report.restarts} restarts"
             f"{' (stopping)' if report.stopping else ''} — {report.model} → {report.exchange}")
    table = Table("slot", "worker", "restarts", "state", "pid", "groups")
    for slot in report.slots:
        table.add_row(str(slot.slot), slot.worker_id, str(slot.generation), slot.state,
                      str(slot.pid or "—"), "—" if slot.submitted is None else str(slot.submitted))
    now = time.time()
    lines = [Text(f"{now - e.at:5.0f}s ago  {e.kind:9} slot {e.slot} {e.worker_id} {e.detail}".rstrip())
             for e in report.events[-6:]]
    return Group(Text(title, style="bold"), table, *lines)


def _watch(address: str, name: str, stop: threading.Event) -> None:
    """Redraw the pool every second until `stop` is set."""
    from ..worker.pool import pool_report

    with Live(_view(pool_report(address, name)), console=console, refresh_per_second=2) as live:
        while not stop.wait(1.0):
            live.update(_view(pool_report(address, name)))


def _until_signal() -> threading.Event:
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    return stop


@click.group("pool", invoke_without_command=True)
@_ray
@click.option("--workers", "-n", type=click.IntRange(0, 1024), default=None, help="Worker actors to keep alive.")
@click.option("--name", default="rollmarket", show_default=True,
              help="The pool's name on the cluster (for scale/status/stop) and on the exchange.")
@click.option("--num-cpus", type=click.FloatRange(0, min_open=True), default=1.0, show_default=True,
              help="CPUs each worker actor reserves on the cluster (fractions allowed).")
@click.option("--drain-s", type=click.FloatRange(0), default=30.0, show_default=True,
              help="On stop or scale-down, how long a worker may take to hand back its lease.")
@click.option("--detach", is_flag=True, help="Start the pool and return; it runs until `rollmarket pool stop NAME`.")
@host_options
@settings_options(WorkerSettings, skip=("worker_id", "pool"))
@click.pass_context
def pool(ctx, address, workers, name, num_cpus, drain_s, detach, model_path, model_url, model_dir, precision,
         device, threads, serve_cmd, server_reload, canary_tolerance, **values) -> None:
    """Run rollout workers as Ray actors on an existing Ray cluster, restart those that die, and scale while they run.

    `rollmarket pool --ray HOST:PORT --workers N --model DIR` (or --model-url) starts a detached
    supervisor actor named --name that keeps N `rollmarket worker`s alive as actors and shows them
    live; Ctrl-C drains and stops the pool (with --detach it keeps running). Every worker declares
    the pool in its manifest, so the exchange and the marketplace page show it. Paths must exist
    where the actors run. `rollmarket pool scale|status|stop NAME` act on a running pool.
    """
    if ctx.invoked_subcommand is not None:
        return
    from pydantic import ValidationError

    from ..worker.pool import PoolSettings, start_pool, stop_pool

    address = _need_address(address)
    if workers is None:
        raise click.UsageError("how many workers? pass --workers N")
    spec = host_spec(model_path, model_url, model_dir, precision, device, threads, serve_cmd, server_reload,
                     canary_tolerance, absolute=True)
    for key in ("events", "rollouts"):  # the actors' working directory is not ours
        if values.get(key):
            values[key] = Path(values[key]).resolve()
    try:
        settings = PoolSettings(name=name, workers=workers, host=spec, worker=worker_settings(values),
                                num_cpus=num_cpus, drain_s=drain_s)
    except ValidationError as exc:
        raise click.UsageError(validation_problems(exc)) from None
    with console.status(f"starting pool {name} on Ray at {address}"):
        start_pool(address, settings)
    console.print(f"[bold]rollmarket pool[/] {name}: {workers} workers on {spec.label} → exchange "
                  f"{settings.worker.exchange} (Ray at {address})", highlight=False)
    if detach:
        console.print(f"detached; `rollmarket pool status {name} --ray {address}` shows it, "
                      f"`rollmarket pool scale {name} N` resizes it, `rollmarket pool stop {name}` ends it",
                      highlight=False)
        return
    try:
        _watch(address, name, _until_signal())
    finally:
        with console.status(f"draining pool {name}"):
            report = stop_pool(address, name, drain_s)
        console.print(f"pool {name} stopped after {report.restarts} restarts", highlight=False)


@pool.command("status")
@_name
@_ray
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--watch", is_flag=True, help="Keep the view live until Ctrl-C (the pool keeps running).")
def status(name, address, as_json, watch) -> None:
    """Show a running pool: its target, each worker actor, restarts and recent events."""
    from ..worker.pool import pool_report

    address = _need_address(address)
    if watch:
        _watch(address, name, _until_signal())
        return
    report = pool_report(address, name)
    if as_json:
        click.echo(json.dumps(asdict(report), indent=2))
        return
    console.print(_view(report))


@pool.command("scale")
@_name
@click.argument("workers", type=click.IntRange(0, 1024))
@_ray
def scale(name, workers, address) -> None:
    """Set how many workers a running pool keeps alive (extra ones drain their lease, then stop)."""
    from ..worker.pool import scale_pool

    previous = scale_pool(_need_address(address), name, workers)
    console.print(f"pool {name}: {previous} → {workers} workers", highlight=False)


@pool.command("stop")
@_name
@_ray
@click.option("--drain-s", type=click.FloatRange(0), default=30.0, show_default=True,
              help="How long workers may take to hand back their leases before they are killed.")
def stop(name, address, drain_s) -> None:
    """Drain a running pool's workers and end its supervisor."""
    from ..worker.pool import stop_pool

    report = stop_pool(_need_address(address), name, drain_s)
    console.print(f"pool {name} stopped after {report.restarts} restarts", highlight=False)
