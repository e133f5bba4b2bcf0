"""The `rollmarket` command. The library stays quiet; this is where output happens."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from .. import __version__
from ..gate import GateConfig
from .options import pick, settings_options

console = Console()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="rollmarket")
def main() -> None:
    """rollmarket: a rollout exchange, an off-policy gate and a mismatch observatory for RL of LLMs."""


@main.command()
@click.option("--out", "out_dir", type=click.Path(path_type=Path), required=True,
              help="Directory to write <Contract>.schema.json files into.")
def schema(out_dir: Path) -> None:
    """Write the JSON Schema of every contract."""
    from ..contracts.schema import write_schemas

    written = write_schemas(out_dir)
    console.print(f"wrote {len(written)} schema files to [bold]{out_dir}[/]")


@main.group()
def exchange() -> None:
    """Run and inspect a rollout exchange."""


from ..exchange.settings import ExchangeSettings  # noqa: E402  (after the group, for click order)


@exchange.command("serve")
@settings_options(ExchangeSettings, envvars={"trainer_token": "ROLLMARKET_TRAINER_TOKEN",
                                              "registration_token": "ROLLMARKET_REGISTRATION_TOKEN"})
@settings_options(GateConfig, prefix="gate_")
@click.option("--log-level", default="info", show_default=True,
              type=click.Choice(["debug", "info", "warning", "error"]))
@click.option("--access-log/--no-access-log", default=False, show_default=True, help="Log every request.")
def exchange_serve(log_level: str, access_log: bool, **values) -> None:
    """Serve an exchange over HTTP (FastAPI + uvicorn, SQLite in WAL mode)."""
    from ..exchange.server import serve

    gate = GateConfig(**pick(values, "gate_"))
    fields = {k: v for k, v in values.items() if not k.startswith("gate_") and v is not None}
    settings = ExchangeSettings(**fields, gate=gate)
    if not settings.trainer_token:
        raise click.UsageError("--trainer-token (or ROLLMARKET_TRAINER_TOKEN) is required")
    console.print(f"[bold]rollmarket exchange[/] {__version__} on http://{settings.host}:{settings.port} "
                  f"(db {settings.db}); docs at /docs", highlight=False)
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


@main.group(invoke_without_command=True)
@click.option("--runs-dir", type=click.Path(path_type=Path), default=Path("runs"), show_default=True,
              help="Where the run directory is created.")
@click.option("--steps", default=4, show_default=True, help="Training steps (policy versions).")
@click.option("--model", default="models/tiny-moe", show_default=True, help="Model to train (a HF directory).")
@click.option("--precisions", default="bf16,fp8", show_default=True,
              help="Rollout precisions, one real worker process each.")
@click.option("--suite", default="lookup", show_default=True, help="Task suite (train split: jobs; heldout: eval).")
@click.option("--eval-tasks", default=20, show_default=True, help="Held-out tasks evaluated before and after.")
@click.pass_context
def demo(ctx: click.Context, runs_dir: Path, steps: int, model: str, precisions: str, suite: str,
         eval_tasks: int) -> None:
    """Run the main job: train the tiny MoE for a few steps through a real exchange with real workers
    at two precisions, showing the gate's decisions and the mismatch per step, and end with the
    observatory matrix. `rollmarket demo paths` runs the exchange's fault-path demo instead."""
    if ctx.invoked_subcommand is not None:
        return
    from ..train.demo import TrainDemoConfig, run_train_demo

    chosen = [p for p in precisions.split(",") if p]
    unknown = [p for p in chosen if p not in ("fp32", "bf16", "fp16", "fp8")]
    if unknown:
        raise click.UsageError(f"--precisions: unknown {unknown}; choose from fp32, bf16, fp16, fp8")
    if not (Path(model) / "config.json").exists():
        raise click.UsageError(f"--model {model}: no such model directory (run from the repository root)")
    run_train_demo(TrainDemoConfig(model=model, precisions=chosen, suite=suite, steps=steps, eval_tasks=eval_tasks),
                   runs_dir=runs_dir, console=console)


@demo.command("paths")
@click.option("--runs-dir", type=click.Path(path_type=Path), default=Path("runs"), show_default=True,
              help="Where the run directory is created.")
@click.option("--steps", default=12, show_default=True, help="Most trainer steps (policy versions).")
@click.option("--min-steps", default=6, show_default=True, help="Steps to run before stopping once every path fired.")
@click.option("--timeout", default=240.0, show_default=True, help="Give up after this many seconds.")
@click.option("--seed", default=0, show_default=True, help="Seed of the simulated workers.")
@click.option("--simulate/--no-simulate", default=True, show_default=True,
              help="Run the simulated faulty and honest profiles beside the real workers.")
@click.option("--model", default="models/tiny-moe", show_default=True,
              help="Model the policy is: real workers sample it and the trainer teacher-forces their "
                   "groups at fp32. 'none' for the synthetic model alone (no real workers).")
@click.option("--precisions", default="fp32,bf16,fp8", show_default=True,
              help="Precision profiles of the real workers, one worker each.")
@click.option("--suite", default="arithmetic", show_default=True, help="Task suite of the real workers' jobs.")
def demo_paths(runs_dir: Path, steps: int, min_steps: int, timeout: float, seed: int, simulate: bool,
               model: str, precisions: str, suite: str) -> None:
    """The exchange's fault paths: real agent workers on the tiny MoE at several precisions, faulty
    and honest simulated workers and a simulated trainer, as real processes, until every path
    (train, correction, replay, quarantine, reject, lease expiry, abandonment, quorum) fired."""
    from ..sim.demo import DemoConfig, run_demo

    real = [[f"tiny-moe-{p}", p] for p in precisions.split(",") if p]
    unknown = [p for _, p in real if p not in ("fp32", "bf16", "fp16", "fp8")]
    if unknown:
        raise click.UsageError(f"--precisions: unknown {unknown}; choose from fp32, bf16, fp16, fp8")
    config = DemoConfig(steps=steps, min_steps=min_steps, timeout_s=timeout, seed=seed,
                        model=None if model.lower() == "none" else model, real_workers=real, suite=suite)
    if not simulate:
        if not config.model or not real:
            raise click.UsageError("--no-simulate needs real workers (a --model and --precisions)")
        config.workers = []  # the fault paths come from the simulated profiles: none to wait for
    if config.model and not (Path(config.model) / "config.json").exists():
        raise click.UsageError(f"--model {config.model}: no such model directory (run from the "
                               "repository root or pass --model none)")
    summary = run_demo(config, runs_dir=runs_dir, console=console)
    sys.exit(0 if summary["ok"] else 1)


from .serve import serve_model  # noqa: E402

main.add_command(serve_model)

from .models import models  # noqa: E402

main.add_command(models)

from .proxy import captures, proxy  # noqa: E402

main.add_command(proxy)
main.add_command(captures)

from .agents import collect_command, worker_command  # noqa: E402

main.add_command(collect_command)
main.add_command(worker_command)

from .suites import suites  # noqa: E402

main.add_command(suites)

from .verifier import verifier  # noqa: E402

main.add_command(verifier)

from .profile import profile  # noqa: E402

main.add_command(profile)

from .observe import observe  # noqa: E402

main.add_command(observe)

from .dashboard import dashboard  # noqa: E402

main.add_command(dashboard)


if __name__ == "__main__":
    main()

from .train import train_command  # noqa: E402

main.add_command(train_command)
