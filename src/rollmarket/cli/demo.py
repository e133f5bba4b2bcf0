"""`rollmarket demo`: the main job (train the tiny MoE through a real exchange) and `demo paths`,
the exchange's fault-path demo."""

from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console

from .options import ModelDir, precision_list

console = Console()


@click.group(invoke_without_command=True)
@click.option("--runs-dir", type=click.Path(path_type=Path), default=Path("runs"), show_default=True,
              help="Where the run directory is created.")
@click.option("--steps", default=4, show_default=True, help="Training steps (policy versions).")
@click.option("--model", default="models/tiny-moe", show_default=True, type=ModelDir(),
              help="Model to train (a HF directory).")
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
    from ..tasks.suites import check_suite

    chosen = precision_list(precisions, "--precisions")
    check_suite(suite, "train")
    from ..train.demo import TrainDemoConfig, run_train_demo

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
@click.option("--model", default="models/tiny-moe", show_default=True, type=ModelDir(none_word="none"),
              help="Model the policy is: real workers sample it and the trainer teacher-forces their "
                   "groups at fp32. 'none' for the synthetic model alone (no real workers).")
@click.option("--precisions", default="fp32,bf16,fp8", show_default=True,
              help="Precision profiles of the real workers, one worker each.")
@click.option("--suite", default="arithmetic", show_default=True, help="Task suite of the real workers' jobs.")
def demo_paths(runs_dir: Path, steps: int, min_steps: int, timeout: float, seed: int, simulate: bool,
               model: str | None, precisions: str, suite: str) -> None:
    """The exchange's fault paths: real agent workers on the tiny MoE at several precisions, faulty
    and honest simulated workers and a simulated trainer, as real processes, until every path
    (train, correction, replay, quarantine, reject, lease expiry, abandonment, quorum) fired."""
    from ..tasks.suites import check_suite

    real = [[f"tiny-moe-{p}", p] for p in precision_list(precisions, "--precisions")]
    check_suite(suite, "train")
    from ..sim.demo import DemoConfig, run_demo

    config = DemoConfig(steps=steps, min_steps=min_steps, timeout_s=timeout, seed=seed,
                        model=model, real_workers=real, suite=suite)
    if not simulate:
        if not config.model or not real:
            raise click.UsageError("--no-simulate needs real workers (a --model and --precisions)")
        config.workers = []  # the fault paths come from the simulated profiles: none to wait for
    summary = run_demo(config, runs_dir=runs_dir, console=console)
    sys.exit(0 if summary["ok"] else 1)
