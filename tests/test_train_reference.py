"""The reference loop (src/rollmarket/train/reference.py) end to end on the tiny MoE: real agent
runs through the in-process server, stitched, scored and trained on, in a few seconds."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from rollmarket.train import reference

ROOT = Path(__file__).resolve().parent.parent

KEYS = ["step", "correct_rate", "running_correct_rate", "mean_reward", "loss", "num_datums",
        "reward_tie_group_rate", "critic/rewards/mean", "critic/advantages/mean", "response_length/mean",
        "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac",
        "rollout_corr/mean_abs_delta", "timing_s/step", "timing_s/sample", "timing_s/update"]


def test_reference_loop_trains_the_sampling_model(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    checksums = []
    original = reference.load_model

    def load_and_remember(*args, **kwargs):
        loaded = original(*args, **kwargs)
        checksums.append((loaded.model, sum(float(p.detach().double().sum()) for p in loaded.model.parameters())))
        return loaded

    monkeypatch.setattr(reference, "load_model", load_and_remember)
    # Temperature 2 gives groups with mixed rewards (at T=1 the tiny model solves nearly every
    # training task, so every group ties and nothing is trained). Which steps train is the seed's
    # luck (the sampler's draws, and since session 26 the seed rule of contracts/seeds.py): the
    # test needs one step that trains, and checks a step that did not for nulls.
    cfg = reference.Config(model=str(ROOT / "models" / "tiny-moe"), steps=2, groups=2, group_size=2,
                           max_tokens=64, temperature=2.0, seed=3, eval_every=1, eval_tasks=4,
                           runs_root=str(tmp_path))
    run_dir = reference.train(cfg, quiet=True)

    assert json.loads((run_dir / "config.json").read_text())["config"]["group_size"] == 2
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        for key in KEYS + ["eval/accuracy/mean"]:
            assert key in row, key
            if row["num_datums"] == 0 and key in reference.NO_UPDATE + ("critic/advantages/mean",):
                assert row[key] is None, (key, row[key])  # no update happened: null, never 0
                continue
            assert math.isfinite(row[key]), (key, row[key])
        # G = 2: a group ties when its two rewards are equal; every group is eligible.
        assert row["reward_tie_eligible_groups"] == 2
        assert row["reward_tie_pair_rate"] == row["reward_tie_group_rate"] == row["reward_uniform_group_rate"]
        assert row["actor/kl_ref"] is None and row["plan_entropy_mean"] is None
        assert 0.0 <= row["eval/accuracy/mean"] <= 1.0
        # Sampler and trainer are the same fp32 weights: only kernel numerics separate them
        # (a step whose groups all tied scores nothing).
        if row["num_datums"]:
            assert row["rollout_corr/mean_abs_delta"] < 1e-3
    assert sum(r["num_datums"] for r in rows) > 0
    (model, before), = checksums
    after = sum(float(p.detach().double().sum()) for p in model.parameters())
    assert after != before, "the optimizer step did not change the model that samples"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 2
