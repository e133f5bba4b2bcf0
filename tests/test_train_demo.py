"""`rollmarket demo` (the main job), shrunk: a real exchange process, real workers at bf16 and fp8 and
a drifting fp16 worker (it reloads only every other version) as processes, three async training
steps through them with a line per step, pass@1 before and after with intervals, then the
observatory matrix of the trained checkpoint; then `rollmarket train --resume` of the demo's run goes
one step further."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import numpy as np
from click.testing import CliRunner
from rich.console import Console
from scipy import stats

from rollmarket.cli.main import main
from rollmarket.engines.provenance import checkpoint_digest
from rollmarket.train.demo import TrainDemoConfig, run_train_demo

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "models" / "tiny-moe")


def test_demo_trains_through_the_exchange_with_a_drifting_worker_and_says_what_it_learned(tmp_path):
    config = TrainDemoConfig(model=MODEL, steps=3, groups_per_step=3, group_size=2, eval_tasks=4, eval_samples=2,
                             drift="fp16@lag1", observe=True, observe_n=2, observe_lengths=[16],
                             overrides=["rollout.max_tokens=48", "agent.max_turns=2", "eval.max_turns=2"])
    console = Console(record=True, width=400)
    summary = run_train_demo(config, runs_dir=tmp_path, console=console)
    run_dir = Path(summary["run_dir"])
    text = console.export_text()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for step in (1, 2, 3):
        line = next(x for x in text.splitlines() if x.startswith(f"step {step}/3 "))
        assert "ETA" in line and "reward" in line and "gate" in line
        row = rows[step]
        assert f"{row['gate/train']} train · {row['gate/train_with_correction']} correction" in line
        for precision in ("bf16", "fp8", "fp16"):
            if row.get(f"mismatch/{precision}/token_ess_mean") is not None:
                assert f"ESS {row[f'mismatch/{precision}/token_ess_mean']:.4f}" in line
    assert "fp16@lag1 ESS" in text  # the drifting worker's mismatch has its own column

    # pass@1 before and after with t intervals over tasks and the paired gain, recomputed here from
    # evals.jsonl with scipy alone.
    evals = [json.loads(line) for line in (run_dir / "evals.jsonl").read_text().splitlines()]
    per = {s: {e["task_id"]: np.mean(e["sampled_passed"]) for e in evals if e["step"] == s} for s in (0, 3)}
    tasks = sorted(per[0])
    assert len(tasks) == 4 and all(len(e["sampled_passed"]) == 2 for e in evals)
    before, after = (np.array([per[s][t] for t in tasks]) for s in (0, 3))
    for name, x in (("before", before), ("after", after), ("gain", after - before)):
        got = summary["pass1"][name]
        assert np.isclose(got["mean"], np.mean(x))
        if np.std(x) > 0:
            lo, hi = stats.t.interval(0.95, len(x) - 1, loc=np.mean(x), scale=stats.sem(x))
            assert np.isclose(got["lo"], lo) and np.isclose(got["hi"], hi)
        else:  # every task the same: the interval is the point
            assert got["lo"] == got["hi"] == np.mean(x)
    assert f"before {np.mean(before):.3f}" in text and "held-out sampled pass@1 (4 tasks × 2 samples" in text
    assert f"rollmarket dashboard --runs {tmp_path}" in text
    board = run_dir / "tensorboard"  # mirrored by default (W&B is off under test: conftest)
    assert f"tensorboard: tensorboard --logdir {board}" in text and board.is_dir()

    # What that command shows: the run in the index as a finished demo, and its page's held-out band
    # the same pass@1 and interval as the demo printed (the dashboard computes it without research/).
    from fastapi.testclient import TestClient

    from rollmarket.dashboard import create_dashboard_app

    client = TestClient(create_dashboard_app(tmp_path))
    entry = next(e for e in client.get("/index.json").json()["entries"] if e["run_id"] == run_dir.name)
    assert (entry["kind"], entry["status"], entry["steps_done"]) == ("demo", "finished", 3)
    band = {p["step"]: p for p in client.get(f"/train/{run_dir.name}.json").json()["metrics"]["evals"]
            if p["metric"] == "eval/pass@1"}
    for step, name in ((0, "before"), (3, "after")):
        got = summary["pass1"][name]
        assert np.allclose([band[step][k] for k in ("mean", "lo", "hi")], [got[k] for k in ("mean", "lo", "hi")])

    # Real worker processes, one per precision and the drifting one, which told the exchange its lag.
    with sqlite3.connect(run_dir / "exchange.db") as db:
        lags = {w: json.loads(m).get("max_reload_lag") for w, m in db.execute("SELECT worker_id, manifest FROM workers")}
    assert lags == {"tiny-moe-bf16": 0, "tiny-moe-fp8": 0, "tiny-moe-fp16-lag1": 1}
    assert (run_dir / "logs" / "worker-tiny-moe-fp16-lag1.log").exists()
    matrix = json.loads((run_dir / "matrix.json").read_text())
    assert {c["rollout_engine"] for c in matrix["cells"]} == {"fp32", "bf16", "fp8"}
    assert matrix["model"].endswith("v0003")  # the trained checkpoint, not the shipped weights

    # The run directory stays a training run: config.json is the training config (the observatory's
    # settings went to observe.json), so `rollmarket train --resume` goes on from it.
    assert json.loads((run_dir / "config.json").read_text())["config"]["loop"]["steps"] == 3
    assert json.loads((run_dir / "observe.json").read_text())["observe"]["model"].endswith("v0003")
    resumed = CliRunner().invoke(main, ["train", "--resume", str(run_dir), "--local", "loop.steps=4", "eval.tasks=0",
                                        "rollout.precisions=['bf16']", "local.workers=['bf16']"])
    assert resumed.exit_code == 0, (resumed.output, resumed.exception)
    assert f"tensorboard: tensorboard --logdir {board}" in resumed.output.replace("\n", "")  # the CLI says where
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    with sqlite3.connect(run_dir / "exchange.db") as db:
        digest = db.execute("SELECT digest FROM policies WHERE version=4").fetchone()[0]
    assert digest == checkpoint_digest(run_dir / "checkpoints" / "v0004")


def test_the_cli_defaults_are_the_demos_and_bad_input_makes_nothing(tmp_path):
    from rollmarket.cli.demo import DEFAULTS

    config = TrainDemoConfig()
    assert DEFAULTS == {"model": config.model, "steps": config.steps, "groups": config.groups_per_step,
                        "group_size": config.group_size, "lr": config.lr, "precisions": ",".join(config.precisions),
                        "drift": config.drift, "suite": config.suite, "eval_tasks": config.eval_tasks,
                        "eval_samples": config.eval_samples, "observe": config.observe}
    runs = tmp_path / "runs"
    for args, needle in [(["--drift", "fp16@slow2"], "unknown option"), (["--drift", "fp9@lag2"], "fp9"),
                         (["--set", "optim.lrr=1"], "optim.lrr"), (["--set", "gate.clamp=-1"], "gate.clamp")]:
        result = CliRunner().invoke(main, ["demo", "--model", MODEL, "--runs-dir", str(runs), *args])
        assert result.exit_code in (1, 2) and needle in result.output, result.output
        assert not runs.exists() or not any(runs.iterdir())
