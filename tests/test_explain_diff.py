"""`rollmarket explain` (a dry run: counts worked out by hand, nothing written) and `rollmarket diff`
(two hand-written run directories whose differences and best/final values are known)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rollmarket.research.campaign import CampaignError
from rollmarket.research.explain import _rate_at, explain, run_seconds
from rollmarket.research.rundiff import RunDirError, diff_runs
from rollmarket.train.config import TrainConfig, TrainConfigError

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "models" / "tiny-moe")

CAMPAIGN = textwrap.dedent(f"""\
    runs_root = "made-by-nobody"
    [model]
    path = {json.dumps(MODEL)}
    [rollout]
    suite = "arithmetic"
    groups_per_step = 3
    group_size = 4
    max_tokens = 32
    precisions = ["bf16"]
    [agent]
    max_turns = 2
    [loop]
    steps = 25
    [eval]
    every = 10
    tasks = 5
    samples = 4
    max_turns = 3
    [local]
    workers = ["bf16"]

    [campaign]
    name = "lr"
    seeds = [1, 2, 3]
    parallel = 2

    [[campaign.conditions]]
    name = "slow"
    optim.lr = 1e-5

    [[campaign.conditions]]
    name = "fast"
    optim.lr = 1e-4
    """)


def test_explain_counts_a_campaign_by_hand_and_writes_nothing(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(CAMPAIGN)
    before = sorted(p.name for p in tmp_path.iterdir())
    plan = explain(path)
    # 25 steps × 3 groups × 4 runs = 300 trajectories; ≤ 300 × 32 tokens × 2 turns = 19,200 tokens.
    # Evaluations: before training, at steps 10 and 20, and after step 25 = 4; each 5 tasks × (1 greedy
    # + 4 samples) = 25 runs → 100 runs, ≤ 100 × 32 × 3 turns = 9,600 tokens.
    assert [(r["condition"], r["seed"]) for r in plan["runs"]] == [
        ("slow", 1), ("slow", 2), ("slow", 3), ("fast", 1), ("fast", 2), ("fast", 3)]
    for r in plan["runs"]:
        assert (r["steps"], r["groups"], r["trajectories"], r["tokens_max"]) == (25, 75, 300, 19_200)
        assert (r["evaluations"], r["eval_runs"], r["eval_tokens_max"]) == (4, 100, 9_600)
    assert plan["totals"] == {"runs": 6, "groups": 450, "trajectories": 1_800, "tokens_max": 115_200,
                              "eval_runs": 600, "eval_tokens_max": 57_600}
    assert plan["settings"]["conditions"] == {"slow": {"optim.lr": 1e-5}, "fast": {"optim.lr": 1e-4}}
    common = plan["settings"]["common"]
    assert common["rollout.groups_per_step"] == 3 and common["eval.tasks"] == 5 and "optim.lr" not in common
    assert "rollout.group_size" not in common  # 4 is the default
    assert "rollout.seed" not in common and "labels.condition" not in common
    estimate = plan["estimate"]  # the shipped model has benchmark rates
    assert estimate["waves"] == 3 and estimate["parallel"] == 2  # 6 runs, 2 at once
    assert estimate["wall_s"] >= 3 * estimate["per_run_s"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written
    assert not (ROOT / "made-by-nobody").exists()


def test_the_time_estimate_follows_its_stated_rates():
    # Log-linear between batch 1 (100 tok/s) and 16 (1,600 tok/s): batch 4 is log 4 / log 16 = 1/2 of the
    # way in log space, so the rate is 100 × (1600/100)^(1/2) = 400 tok/s.
    assert _rate_at(4, {1: 100.0, 16: 1600.0}) == pytest.approx(400.0)
    assert _rate_at(64, {1: 100.0, 16: 1600.0}) == 1600.0  # beyond the measured batches: the last one
    cfg = TrainConfig.model_validate({"rollout": {"group_size": 4, "max_tokens": 10, "groups_per_step": 1},
                                      "agent": {"max_turns": 1}, "loop": {"steps": 10},
                                      "eval": {"tasks": 2, "samples": 1, "max_turns": 1, "every": 0}})
    cost = {"tokens_max": 400, "eval_tokens_max": 80}
    seconds = run_seconds(cfg, cost, {"decode_tokens_per_s": {1: 100.0, 16: 1600.0}, "forward_tokens_per_s": 800.0})
    # generation 400 / 400 = 1 s; training 400 × 4 forwards / 800 = 2 s; evaluation at batch 2:
    # 100 × 16^(log 2 / log 16) = 200 tok/s → 80 / 200 = 0.4 s; plus 15 s start-up.
    assert seconds["generation_s"] == pytest.approx(1.0)
    assert seconds["training_s"] == pytest.approx(2.0)
    assert seconds["evaluation_s"] == pytest.approx(0.4)
    assert seconds["total_s"] == pytest.approx(18.4)
    assert math.isclose(_rate_at(2, {1: 100.0, 16: 1600.0}), 200.0)


def test_explain_a_train_config_and_its_errors(tmp_path):
    plan = explain(ROOT / "configs" / "train-lookup.toml", ["loop.steps=4", "eval.every=0"])
    assert plan["kind"] == "train" and len(plan["runs"]) == 1
    assert plan["runs"][0]["evaluations"] == 2  # before and after
    assert plan["settings"]["common"] == {"loop.steps": 4, "eval.every": 0}
    with pytest.raises(TrainConfigError, match="did you mean loop.steps"):
        explain(ROOT / "configs" / "train-lookup.toml", ["loop.step=4"])
    bad = tmp_path / "bad.toml"
    bad.write_text(CAMPAIGN.replace('name = "fast"', 'name = "slow"'))
    with pytest.raises(CampaignError, match="two conditions"):
        explain(bad)


def test_explain_command_prints_and_writes_nothing(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(CAMPAIGN)
    done = subprocess.run([sys.executable, "-m", "rollmarket", "explain", str(path), "--json"], capture_output=True,
                          text=True, cwd=tmp_path, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["totals"]["trajectories"] == 1_800
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.toml"]


# -- diff ---------------------------------------------------------------------------------------------

def _run(path: Path, config: dict, rows: list[dict], summary: dict | None) -> Path:
    path.mkdir(parents=True)
    full = TrainConfig.model_validate(config).model_dump(mode="json") | {"runs_root": str(path.parent)}
    (path / "config.json").write_text(json.dumps({"config": full, "local": True}))
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9, "torn')
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_diff_shows_only_differing_settings_and_final_and_best(tmp_path):
    a = _run(tmp_path / "a", {"optim": {"lr": 1e-4}, "loop": {"steps": 3}},
             [{"step": 0, "eval/pass@1": 0.5},
              {"step": 1, "correct_rate": 0.25, "loss": 0.3, "timing_s/step": 2.0},
              {"step": 2, "correct_rate": 0.75, "loss": None, "timing_s/step": 1.0},
              {"step": 3, "correct_rate": 0.5, "loss": 0.1, "timing_s/step": 3.0, "eval/pass@1": 0.625}],
             {"eval_before": {"eval/pass@1": 0.5}, "eval_after": {"eval/pass@1": 0.625}})
    b = _run(tmp_path / "b", {"optim": {"lr": 5e-5}, "loop": {"steps": 3}, "algorithm": {"advantage": "rloo"}},
             [{"step": 0, "eval/pass@1": 0.5}, {"step": 1, "correct_rate": 0.5, "timing_s/step": 4.0}], None)
    result = diff_runs(a, b)
    assert result["settings"] == [{"key": "algorithm.advantage", "a": "grpo", "b": "rloo"},
                                  {"key": "optim.lr", "a": 1e-4, "b": 5e-5}]  # runs_root differs, ignored
    metrics = {m["key"]: m for m in result["metrics"]}
    assert metrics["correct_rate"]["a"] == {"final": 0.5, "best": 0.75, "best_step": 2}
    assert metrics["correct_rate"]["b"] == {"final": 0.5, "best": 0.5, "best_step": 1}
    assert metrics["timing_s/step"]["a"] == {"final": 3.0, "best": 1.0, "best_step": 2}  # lower is better
    assert metrics["loss"]["a"] == {"final": 0.1, "best": None, "best_step": None}  # the null row skipped
    assert metrics["loss"]["b"]["final"] is None
    assert metrics["eval/pass@1"]["a"] == {"final": 0.625, "best": 0.625, "best_step": 3}
    assert "mean_reward" not in metrics  # in neither run
    assert result["evaluation"] == [{"key": "eval/pass@1", "a_before": 0.5, "a_after": 0.625,
                                     "b_before": 0.5, "b_after": None}]  # b: not finished, evaluated at 0 only
    assert (result["a"]["finished"], result["b"]["finished"], result["b"]["steps"]) == (True, False, 1)
    with pytest.raises(RunDirError, match="not a training run directory"):
        diff_runs(a, tmp_path)


def test_diff_command_table_and_json(tmp_path):
    a = _run(tmp_path / "a", {"optim": {"lr": 1e-4}}, [{"step": 1, "correct_rate": 0.25}], None)
    b = _run(tmp_path / "b", {}, [{"step": 1, "correct_rate": 0.5}], None)
    done = subprocess.run([sys.executable, "-m", "rollmarket", "diff", str(a), str(b), "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["settings"] == [{"key": "optim.lr", "a": 1e-4, "b": 5e-5}]
    done = subprocess.run([sys.executable, "-m", "rollmarket", "diff", str(a), str(b)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0 and "optim.lr" in done.stdout and "correct_rate" in done.stdout, done.stderr
    done = subprocess.run([sys.executable, "-m", "rollmarket", "diff", str(a), str(tmp_path)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: ") and len(done.stderr.splitlines()) == 1


def test_the_shipped_example_campaign_is_what_the_docs_say(monkeypatch):
    """configs/campaign-example.toml (README, docs/campaigns.md): 2 conditions × 2 seeds, 2 at once,
    a [stats] table in the shared layout; its estimate is a few minutes on two cores."""
    monkeypatch.chdir(ROOT)
    plan = explain(ROOT / "configs" / "campaign-example.toml", parallel=2)
    assert [(r["condition"], r["seed"]) for r in plan["runs"]] == [("grpo", 1), ("grpo", 2), ("rloo", 1), ("rloo", 2)]
    assert plan["settings"]["conditions"] == {"grpo": {}, "rloo": {"algorithm.advantage": "rloo"}}
    assert 60 < plan["estimate"]["wall_s"] < 6 * 60
    from rollmarket.research.campaign import load_campaign

    stats = load_campaign(ROOT / "configs" / "campaign-example.toml").stats
    assert stats == {"metrics": ["eval/pass@1@final"], "baseline": "grpo", "equivalence_margin": 0.05, "alpha": 0.05}
