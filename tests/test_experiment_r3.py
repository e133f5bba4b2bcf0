"""Experiment (d), router replay per rollout precision (issue 17 §2): the campaign file keeps the
design docs/experiments.md states, and its [stats] table is one `rollmarket stats` accepts."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_router_replay_campaign_file_keeps_its_declared_design():
    from rollmarket.research.campaign import load_campaign
    from rollmarket.research.stats import Metric, StatsSettings

    # Before models/tiny-start is built, the file is checked against the tiny MoE (same architecture).
    model = [] if (ROOT / "models" / "tiny-start" / "config.json").is_file() else [
        f"model.path={json.dumps(str(ROOT / 'models' / 'tiny-moe'))}"]
    c = load_campaign(ROOT / "configs" / "exp-r3-campaign.toml", model)
    names = [x.name for x in c.conditions]
    assert names == ["fp16", "fp16-r3", "bf16", "bf16-r3", "fp8", "fp8-r3"]
    assert list(c.seeds) == list(range(8)) and len(c.runs) == 48
    by = {(r.condition, r.seed): r.config for r in c.runs}
    for (name, seed), config in by.items():
        precision = name.removesuffix("-r3")
        assert config.rollout.precisions == [precision]
        assert [s.precision for s in config.local.specs] == [precision]
        assert all(s.reload_lag == 0 for s in config.local.specs)
        assert config.trainer.router_replay is name.endswith("-r3")
        # (a)'s recipe: 16 steps of 8 × 4, 32 held-out tasks × 16 samples before and after.
        assert (config.loop.steps, config.rollout.groups_per_step, config.rollout.group_size) == (16, 8, 4)
        assert (config.eval.tasks, config.eval.samples, config.eval.every) == (32, 16, 0)
        # With replay and without, a seed's runs differ in nothing but trainer.router_replay.
        if name.endswith("-r3"):
            replay, none = by[name, seed].model_dump(), by[precision, seed].model_dump()
            replay["trainer"].pop("router_replay"), none["trainer"].pop("router_replay")
            replay.get("labels", {}).pop("condition", None), none.get("labels", {}).pop("condition", None)
            assert replay == none
    settings = StatsSettings.from_table(c.stats)
    assert c.stats["metrics"] == ["eval/pass@1@final", "mismatch/token_ess_mean@auc"]
    assert settings.margin_for(Metric.parse("eval/pass@1@final")) == 0.05
    assert settings.margin_for(Metric.parse("mismatch/token_ess_mean@auc")) is None
    assert c.stats["baseline"] in names
