"""`rollmarket demo` (the main job), shrunk: a real exchange process, real workers at bf16 and fp8 as
processes, one training step through them, then the observatory matrix of the trained checkpoint;
then `rollmarket train --resume` of the demo's run goes one step further."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

from rich.console import Console

from rollmarket.engines.provenance import checkpoint_digest
from rollmarket.train.demo import TrainDemoConfig, run_train_demo

ROOT = Path(__file__).resolve().parent.parent


def test_demo_trains_through_the_exchange_and_ends_with_the_matrix(tmp_path):
    config = TrainDemoConfig(model=str(ROOT / "models" / "tiny-moe"), suite="arithmetic", steps=1, groups_per_step=2,
                             group_size=2, eval_tasks=2, observe_n=2, observe_lengths=[16],
                             overrides=["rollout.max_tokens=48", "eval.samples=2"])
    console = Console(record=True, width=160)
    summary = run_train_demo(config, runs_dir=tmp_path, console=console)
    run_dir = Path(summary["run_dir"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[1]["mismatch/bf16/groups"] == 1 and rows[1]["mismatch/fp8/groups"] == 1
    matrix = json.loads((run_dir / "matrix.json").read_text())
    assert {c["rollout_engine"] for c in matrix["cells"]} == {"fp32", "bf16", "fp8"}
    assert matrix["model"].endswith("v0001")  # the trained checkpoint, not the shipped weights
    text = console.export_text()
    assert "gate" in text and "token ESS" in text
    assert (run_dir / "logs" / "worker-tiny-moe-fp8.log").exists()

    # The run directory stays a training run: config.json is the training config (the observatory's
    # settings went to observe.json), so `rollmarket train --resume` goes on from it.
    assert json.loads((run_dir / "config.json").read_text())["config"]["loop"]["steps"] == 1
    assert json.loads((run_dir / "observe.json").read_text())["observe"]["model"].endswith("v0001")
    from click.testing import CliRunner

    from rollmarket.cli.main import main

    resumed = CliRunner().invoke(main, ["train", "--resume", str(run_dir), "--local", "loop.steps=2", "eval.tasks=0",
                                        "rollout.precisions=['bf16']", "local.workers=['bf16']"])
    assert resumed.exit_code == 0, (resumed.output, resumed.exception)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    with sqlite3.connect(run_dir / "exchange.db") as db:
        digest = db.execute("SELECT digest FROM policies WHERE version=2").fetchone()[0]
    assert digest == checkpoint_digest(run_dir / "checkpoints" / "v0002")
