"""`rollmarket demo`: train the tiny model through the exchange with real workers of two precisions.

    exchange process (SQLite in the run dir) ◄── rollmarket worker --precision bf16   (process)
                      ▲                      ◄── rollmarket worker --precision fp8    (process)
                      │
    the trainer (this process): publish → jobs → fetch → teacher-force → gate → step → publish …

Each step prints the gate's decisions and the mismatch teacher forcing found per precision; the
run ends with the observatory matrix of the trained policy (its final checkpoint sampled at each
rollout precision, teacher-forced on fp32 and bf16). Everything lands in one run directory:
config.json (the training config: `rollmarket train --resume RUN_DIR --local` goes on from it),
metrics.jsonl, generations.jsonl, checkpoints/, exchange.db, workers/, logs/, matrix.json, reports/
and observe.json (the observatory's settings), summary.json.
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..localhost import free_port, wait_healthy
from ..runs import new_run_dir, write_json


@dataclass
class TrainDemoConfig:
    model: str = "models/tiny-moe"
    precisions: list = field(default_factory=lambda: ["bf16", "fp8"])
    """One real worker process per precision; the step's jobs alternate between them."""
    suite: str = "lookup"
    steps: int = 4
    groups_per_step: int = 8
    group_size: int = 4
    lr: float = 5e-5
    eval_tasks: int = 20
    observe_n: int = 12
    observe_lengths: list = field(default_factory=lambda: [64, 256])
    overrides: list = field(default_factory=list)
    """Extra `rollmarket train` overrides (KEY=VALUE)."""


def _cell(row: dict, precision: str) -> str:
    ess, delta, flip = (row.get(f"mismatch/{precision}/{k}") for k in ("token_ess_mean", "mean_abs_delta",
                                                                       "router_flip_rate"))
    if ess is None:
        return "-"
    color = "green" if ess > 0.99 else "yellow" if ess >= 0.95 else "red"
    return f"[{color}]{ess:.4f}[/] {delta:.0e} {flip:.1%}" if flip is not None else f"[{color}]{ess:.4f}[/] {delta:.0e}"


def run_train_demo(config: TrainDemoConfig, *, runs_dir: Path = Path("runs"), console: Console | None = None) -> dict:
    from ..cli.train import accuracy_line
    from ..observatory.runner import ObserveSettings
    from ..sim.demo import _Processes, observe_with_progress
    from .config import resolve
    from .loop import Trainer

    console = console or Console()
    model = Path(config.model).resolve()
    if not (model / "config.json").exists():
        raise FileNotFoundError(f"demo model {config.model} not found (run from the repository root or pass --model)")
    run_dir = new_run_dir(runs_dir)
    (run_dir / "workers").mkdir()
    port, token = free_port(), secrets.token_urlsafe(24)
    url = f"http://127.0.0.1:{port}"
    cfg = resolve(None, [
        f"model.path='{model}'", f"rollout.suite='{config.suite}'", f"rollout.precisions={config.precisions!r}",
        f"rollout.groups_per_step={config.groups_per_step}", f"rollout.group_size={config.group_size}",
        f"optim.lr={config.lr}", f"loop.steps={config.steps}", f"eval.tasks={config.eval_tasks}", "eval.every=0",
        f"exchange.url='{url}'", f"runs_root='{runs_dir}'", *config.overrides])
    console.print(f"[bold]rollmarket demo[/] → {run_dir}", highlight=False)
    started = time.monotonic()
    procs = _Processes({"ROLLMARKET_TRAINER_TOKEN": token})
    table = Table(title=f"training the tiny MoE on the {config.suite} suite through the exchange",
                  caption="gate t/c/r/q: train / with correction / replay / quarantine. Mismatch: token ESS, "
                          "mean |Δlogp| and router flips of each precision's groups, teacher-forced at fp32.")
    for column in ("step", "correct", "t/c/r/q", *[f"{p}: ESS |Δ| flip" for p in config.precisions], "datums"):
        table.add_column(column, justify="right", no_wrap=True)
    try:
        exchange = procs.start("exchange", [
            sys.executable, "-m", "rollmarket", "exchange", "serve", "--db", str(run_dir / "exchange.db"),
            "--port", str(port), "--lease-ttl-s", "60", "--heartbeat-ttl-s", "10", "--log-level", "warning"],
            run_dir / "logs" / "exchange.log")
        wait_healthy(url, exchange, log=run_dir / "logs" / "exchange.log")
        for precision in config.precisions:
            worker_id = f"tiny-moe-{precision}"
            procs.start(worker_id, [
                sys.executable, "-m", "rollmarket", "worker", "--model", str(model), "--precision", precision,
                "--threads", "1", "--exchange", url, "--worker-id", worker_id, "--heartbeat-s", "1",
                "--lease-wait-s", "1", "--max-steps", str(cfg.agent.max_turns),
                "--events", str(run_dir / "workers" / f"{worker_id}.jsonl"),
                "--rollouts", str(run_dir / "workers" / f"{worker_id}.rollouts.jsonl"),
            ], run_dir / "logs" / f"worker-{worker_id}.log")
        console.print(f"exchange on {url}; workers: {', '.join(config.precisions)} (processes, logs in "
                      f"{run_dir / 'logs'})", highlight=False)

        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            bar = progress.add_task("training", total=config.steps, info="")

            def on_event(kind: str, data: dict) -> None:
                info = {"quorum": f"workers loading policy v{data.get('version')}",
                        "eval": f"held-out evaluation (step {data.get('step')})"}.get(kind, "")
                progress.update(bar, info=info)

            def on_step(row: dict) -> None:
                gate = "/".join(str(row[f"gate/{k}"]) for k in ("train", "train_with_correction", "replay",
                                                                 "quarantine"))
                table.add_row(str(row["step"]), f"{row['correct_rate']:.2f}", gate,
                              *[_cell(row, p) for p in config.precisions], str(row["num_datums"]))
                progress.update(bar, advance=1, info=f"step {row['step']}: correct {row['correct_rate']:.2f}")
                progress.console.print(f"step {row['step']}: gate t/c/r/q {gate}, correct {row['correct_rate']:.2f}",
                                       highlight=False)

            Trainer(cfg, run_dir=run_dir, token=token, on_step=on_step, on_event=on_event).run()
    finally:
        procs.close()
    console.print(table)
    summary = json.loads((run_dir / "summary.json").read_text())
    if line := accuracy_line(summary):
        console.print(line, highlight=False)

    final = run_dir / "checkpoints" / f"v{summary['final_version']:04d}"
    settings = ObserveSettings(model=str(final), suite=config.suite, split="heldout",
                               rollout_engines=["fp32", *config.precisions], trainer_engines=["fp32", "bf16"],
                               n=config.observe_n, lengths=list(config.observe_lengths), length_n=config.observe_n,
                               max_steps=cfg.agent.max_turns, max_tokens=cfg.rollout.max_tokens)
    observe_with_progress(settings, run_dir, console)
    summary.update({"demo": asdict(config), "matrix": str(run_dir / "matrix.json"),
                    "seconds": round(time.monotonic() - started, 1)})
    write_json(run_dir / "summary.json", summary)
    console.print(f"run directory: {run_dir} (metrics.jsonl, generations.jsonl, matrix.json); see it with "
                  f"[bold]rollmarket dashboard --runs {run_dir.parent}[/]", highlight=False)
    return summary
