"""`rollmarket demo`: the main job (train the starting model through a real exchange) and `demo paths`,
the exchange's fault-path demo."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console

from .options import ModelDir, Refused, precision_list

# The demo's defaults, written out so that `rollmarket demo --help` loads no torch (train/ does);
# tests/test_train_demo.py checks they are TrainDemoConfig's.
DEFAULTS = {"model": "models/tiny-start", "steps": 8, "groups": 6, "group_size": 4, "lr": 1e-4,
            "precisions": "bf16,fp8", "drift": "fp16@lag3", "suite": "arithmetic", "eval_tasks": 64,
            "eval_samples": 4, "observe": False}

console = Console()


@click.group(invoke_without_command=True)
@click.option("--runs-dir", type=click.Path(path_type=Path), default=Path("runs"), show_default=True,
              help="Where the run directory is created.")
@click.option("--model", default=None, type=ModelDir(),
              help=f"Model to train (a HF directory).  [default: {DEFAULTS['model']}]")
@click.option("--steps", default=DEFAULTS["steps"], show_default=True, help="Training steps (policy versions).")
@click.option("--groups", default=DEFAULTS["groups"], show_default=True, help="Groups (tasks) per step.")
@click.option("--group-size", default=DEFAULTS["group_size"], show_default=True, help="Runs per group.")
@click.option("--lr", default=DEFAULTS["lr"], show_default=True, help="AdamW learning rate.")
@click.option("--precisions", default=DEFAULTS["precisions"], show_default=True,
              help="Rollout precisions, one real worker process each.")
@click.option("--drift", default=DEFAULTS["drift"], show_default=True,
              help="The drifting worker, PRECISION@lagK (it reloads the policy only when the published one is "
                   "more than K versions newer); 'none' for no drift.")
@click.option("--suite", default=DEFAULTS["suite"], show_default=True, help="Task suite (train split: jobs; heldout: eval).")
@click.option("--eval-tasks", default=DEFAULTS["eval_tasks"], show_default=True,
              help="Held-out tasks evaluated before and after.")
@click.option("--eval-samples", default=DEFAULTS["eval_samples"], show_default=True,
              help="Samples per held-out task at temperature 1 (pass@1 before and after).")
@click.option("--observe/--no-observe", default=DEFAULTS["observe"], show_default=True,
              help="End with the observatory matrix of the trained policy (about a minute more).")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Any `rollmarket train` setting, applied last (repeatable), e.g. --set gate.clamp=2.")
@click.pass_context
def demo(ctx: click.Context, runs_dir: Path, model: str, steps: int, groups: int, group_size: int, lr: float,
         precisions: str, drift: str, suite: str, eval_tasks: int, eval_samples: int, observe: bool,
         overrides: tuple[str, ...]) -> None:
    """Run the main job: train the starting model through a real exchange with real worker processes
    at several precisions, one of them a slow host whose rollouts drift (it lags behind the policy),
    printing a line per step (ETA, reward, the gate's decisions and what each did, each worker's
    mismatch) and held-out pass@1 before and after with 95% intervals. `rollmarket demo paths` runs
    the exchange's fault-path demo instead."""
    if ctx.invoked_subcommand is not None:
        return
    from ..tasks.suites import check_suite
    from ..train.config import TrainConfigError, WorkerSpec

    check_suite(suite, "train")
    # The default is checked here, not by click, so that `demo paths` never depends on it.
    model = model or ModelDir().convert(DEFAULTS["model"], next(p for p in ctx.command.params if p.name == "model"),
                                        ctx)

    chosen = precision_list(precisions, "--precisions")
    drift_spec = None if drift.lower() == "none" else drift
    if drift_spec is not None:
        try:
            spec = WorkerSpec.parse(drift_spec)
        except TrainConfigError as exc:
            raise Refused(str(exc).replace("local.workers entry", "--drift"), fix=exc.fix or "",
                          param_hint="--drift") from None
        precision_list(spec.precision, "--drift")
    from ..train.demo import TrainDemoConfig, run_train_demo

    config = TrainDemoConfig(model=model, steps=steps, groups_per_step=groups, group_size=group_size, lr=lr,
                             precisions=chosen, drift=drift_spec, suite=suite, eval_tasks=eval_tasks,
                             eval_samples=eval_samples, observe=observe, overrides=list(overrides))
    run_train_demo(config, runs_dir=runs_dir, console=console)


@demo.command("paths")
@click.option("--runs-dir", type=click.Path(path_type=Path), default=Path("runs"), show_default=True,
              help="Where the run directory is created.")
@click.option("--steps", default=12, show_default=True, help="Most trainer steps (policy versions).")
@click.option("--min-steps", default=6, show_default=True, help="Steps to run before stopping once every path fired.")
@click.option("--timeout", default=240.0, show_default=True, help="Give up after this many seconds.")
@click.option("--seed", default=0, show_default=True, help="Seed of the simulated workers.")
@click.option("--simulate/--no-simulate", default=True, show_default=True,
              help="Run the simulated faulty and honest profiles beside the real workers.")
@click.option("--model", default="models/tiny-moe", show_default=True, type=ModelDir(),
              help="Model `rollmarket train` trains: real workers sample it, simulated ones score with it.")
@click.option("--precisions", default="fp32,bf16,fp8", show_default=True,
              help="Precision profiles of the real workers, one worker each.")
@click.option("--suite", default="arithmetic", show_default=True, help="Task suite of the real workers' jobs.")
def demo_paths(runs_dir: Path, steps: int, min_steps: int, timeout: float, seed: int, simulate: bool,
               model: str, precisions: str, suite: str) -> None:
    """The exchange's fault paths: real agent workers on the tiny MoE at several precisions, faulty
    and honest simulated workers and `rollmarket train`, as real processes, until every path
    (train, correction, replay, quarantine, reject, lease expiry, abandonment, quorum) fired."""
    from ..tasks.suites import check_suite

    real = [[f"tiny-moe-{p}", p] for p in precision_list(precisions, "--precisions")]
    check_suite(suite, "train")
    from ..sim.demo import DemoConfig, run_demo

    config = DemoConfig(steps=steps, min_steps=min_steps, timeout_s=timeout, seed=seed,
                        model=model, real_workers=real, suite=suite)
    if not simulate:
        if not real:
            raise click.UsageError("--no-simulate needs real workers (--precisions)")
        config.workers = []  # the fault paths come from the simulated profiles: none to wait for
    summary = run_demo(config, runs_dir=runs_dir, console=console)
    sys.exit(0 if summary["ok"] else 1)
