"""`rollmarket train`: the closed loop through a real exchange with real workers (in-process, --local).

Each run here is a real exchange on loopback with its SQLite file, real `AgentWorker`s sampling the
tiny MoE at bf16/fp8, the trainer teacher-forcing every group, the gate deciding, AdamW stepping,
checkpoints published and reloaded. Temperature 2 makes groups with mixed rewards, so steps train.
"""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path

import numpy as np
import pytest
from pydantic import BaseModel
from safetensors.torch import load_file

from rollmarket.engines.provenance import checkpoint_digest
from rollmarket.train.config import TrainConfig, TrainConfigError, parse_override, resolve
from rollmarket.train.loop import Trainer

ROOT = Path(__file__).resolve().parent.parent
MODEL = str(ROOT / "models" / "tiny-moe")

QUICK = [
    f"model.path={json.dumps(MODEL)}", "rollout.suite=arithmetic", "rollout.groups_per_step=2",
    "rollout.group_size=2", "rollout.temperature=2.0", "rollout.max_tokens=48", "agent.max_turns=3",
    "eval.tasks=3", "eval.samples=2", "eval.max_turns=3", "optim.lr=1e-4", "local.lease_ttl_s=8",
]

REQUIRED = [
    "step", "policy_version", "correct_rate", "running_correct_rate", "mean_reward", "loss", "num_datums",
    "reward_tie_group_rate", "reward_uniform_group_rate", "reward_tie_pair_rate", "reward_unique_fraction_mean",
    "reward_tie_eligible_groups", "max_token_hit_rate", "exec_entropy_mean",
    "exec_entropy_var", "plan_entropy_mean", "plan_entropy_var", "plan_token_fraction", "sepa_lambda",
    "sepa_gate_open", "actor/kl_ref",
    "critic/rewards/mean", "critic/advantages/mean", "response_length/mean", "actor/pg_loss", "actor/entropy",
    "actor/grad_norm", "actor/pg_clipfrac", "rollout_corr/mean_abs_delta", "timing_s/gen", "timing_s/update",
    "timing_s/step", "perf/throughput", "gate/train", "gate/train_with_correction", "gate/replay",
    "gate/quarantine", "mismatch/token_ess_mean", "mismatch/bf16/token_ess_mean",
]


def config(tmp_path: Path, *overrides: str) -> TrainConfig:
    return resolve(None, [*QUICK, f"runs_root={json.dumps(str(tmp_path))}", *overrides])


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def audit_counts(run_dir: Path) -> dict[str, int]:
    with sqlite3.connect(run_dir / "exchange.db") as db:
        return dict(db.execute("SELECT kind, count(*) FROM audit GROUP BY kind").fetchall())


def worker_events(run_dir: Path, event: str) -> list[dict]:
    out = []
    for path in (run_dir / "workers").glob("*.jsonl"):
        if not path.name.endswith(".rollouts.jsonl"):
            out += [e for e in map(json.loads, path.read_text().splitlines()) if e["event"] == event]
    return out


# -- settings ------------------------------------------------------------------------------------


def test_toml_file_with_overrides_resolves_and_bad_settings_are_typed_errors(tmp_path):
    path = tmp_path / "t.toml"
    path.write_text('[loop]\nsteps = 7\n[optim]\nlr = 3e-5\n[rollout]\nprecisions = ["fp8"]\n')
    cfg = resolve(path, ["optim.lr=1e-4", "loop.mode=async", "gate.min_ess=0.5", "local.workers=['fp8','bf16']"])
    assert (cfg.loop.steps, cfg.optim.lr, cfg.loop.mode, cfg.gate.min_ess) == (7, 1e-4, "async", 0.5)
    assert cfg.rollout.precisions == ["fp8"] and cfg.local.workers == ["fp8", "bf16"]
    assert TrainConfig() == resolve(None, [])  # defaults need no file
    assert parse_override("a.b=hello") == (["a", "b"], "hello")

    for bad, needle in [(["optim.lrr=1"], "optim.lrr"), (["optim.lr=-1"], "optim.lr"),
                        (["loop.mode=sideways"], "loop.mode"), (["lr"], "KEY=VALUE"),
                        (["optim.lr=1", "optim.lr.x=2"], "not a section")]:
        with pytest.raises(TrainConfigError, match=needle.replace(".", r"\.")):
            resolve(path, bad)
    with pytest.raises(TrainConfigError, match="masked_is needs"):  # TOML has no null: a saved config can
        resolve(None, [], base={"correction": {"kind": "masked_is", "geo_mean_bounds": None}})
    (tmp_path / "broken.toml").write_text("[loop\nsteps=")
    doc = (ROOT / "docs" / "training.md").read_text()
    keys = [f"{section}.{name}" if isinstance(getattr(TrainConfig(), section), BaseModel) else section
            for section in TrainConfig.model_fields
            for name in (type(getattr(TrainConfig(), section)).model_fields
                         if isinstance(getattr(TrainConfig(), section), BaseModel) else [None])]
    assert not [k for k in keys if f"`{k}`" not in doc], "settings missing from docs/training.md"
    with pytest.raises(TrainConfigError, match="not valid TOML"):
        resolve(tmp_path / "broken.toml")
    with pytest.raises(TrainConfigError, match="cannot read"):
        resolve(tmp_path / "missing.toml")


def test_cli_prints_the_resolved_config_and_refuses_a_bad_key(tmp_path):
    from click.testing import CliRunner

    from rollmarket.cli.main import main

    good = CliRunner().invoke(main, ["train", str(ROOT / "configs" / "train-lookup.toml"), "loop.steps=3",
                                     "--print-config"])
    assert good.exit_code == 0, good.output
    assert json.loads(good.output)["loop"]["steps"] == 3
    assert json.loads(good.output)["rollout"]["suite"] == "lookup"  # from the file
    bad = CliRunner().invoke(main, ["train", "loop.stepz=3", "--print-config"])
    assert bad.exit_code == 2 and "loop.stepz" in bad.output


def test_without_an_exchange_or_token_the_trainer_says_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.delenv("ROLLMARKET_TRAINER_TOKEN", raising=False)
    with pytest.raises(TrainConfigError, match="exchange.url"):
        Trainer(config(tmp_path)).run()
    with pytest.raises(TrainConfigError, match="ROLLMARKET_TRAINER_TOKEN"):
        Trainer(config(tmp_path, "exchange.url='http://127.0.0.1:9'")).run()


# -- the closed loop -------------------------------------------------------------------------------


def test_local_closed_loop_trains_publishes_and_workers_reload(tmp_path):
    cfg = config(tmp_path, "loop.steps=2", "rollout.precisions=['bf16','fp8']", "local.workers=['bf16','fp8']",
                 "eval.every=1")
    seen = []
    run_dir = Trainer(cfg, local=True, on_step=seen.append).run()

    metrics = rows(run_dir)
    assert [r["step"] for r in metrics] == [0, 1, 2]
    assert "eval/accuracy/mean" in metrics[0] and "eval/pass@2" in metrics[0]
    for row in metrics[1:]:
        missing = [k for k in REQUIRED if k not in row]
        assert not missing, missing
        assert sum(row[f"gate/{s}"] for s in ("train", "train_with_correction", "replay", "quarantine")) == 2
        assert row["mismatch/bf16/groups"] == 1 and row["mismatch/fp8/groups"] == 1  # one job per precision
        assert 0 < row["mismatch/fp8/token_ess_mean"] <= 1 and row["mismatch/fp8/mean_abs_delta"] > 0
        assert "eval/accuracy/mean" in row
    assert [r["step"] for r in seen] == [1, 2]
    doc = (ROOT / "docs" / "metrics.md").read_text()
    undocumented = set()
    for row in metrics:
        for key in row:
            generic = re.sub(r"^mismatch/(fp32|bf16|fp16|fp8)/", "mismatch/<precision>/", key)
            generic = re.sub(r"^rollout_corr/(rollout_is|rollout_rs)_.*", r"rollout_corr/\1_*", generic)
            generic = re.sub(r"^eval/pass@\d+$", "eval/pass@1", generic)
            if f"`{generic}`" not in doc:
                undocumented.add(key)
    assert not undocumented, f"metrics missing from docs/metrics.md: {sorted(undocumented)}"
    assert sum(r["num_datums"] for r in metrics[1:]) > 0, "no step had a group with mixed rewards"

    # Every group was decided and got feedback; each version was published and activated.
    counts = audit_counts(run_dir)
    assert counts["group.decided"] == counts["feedback.recorded"] == counts["group.accepted"] == 4
    assert counts["policy.published"] == 3 and counts["policy.activated"] == 3
    # Both workers loaded both trained checkpoints (the host checks the digest before acking).
    acked = {(e["worker_id"].rsplit("-", 1)[0], e["version"]) for e in worker_events(run_dir, "reload_acked")}
    assert {(w, v) for w, v in acked if v >= 1} == {(w, v) for w in ("local-bf16-0", "local-fp8-1") for v in (1, 2)}

    # The published checkpoint is loadable weights that moved, with the base model's key layout.
    ckpt = run_dir / "checkpoints" / "v0002"
    trained, base = load_file(str(ckpt / "model.safetensors")), load_file(str(Path(MODEL) / "model.safetensors"))
    assert trained.keys() == base.keys()
    assert any(not (trained[k] == base[k]).all() for k in base)
    assert checkpoint_digest(ckpt) != checkpoint_digest(MODEL)
    with sqlite3.connect(run_dir / "exchange.db") as db:
        digest = db.execute("SELECT digest FROM policies WHERE version=2").fetchone()[0]
    assert digest == checkpoint_digest(ckpt)

    generations = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert len(generations) == 2 * 2 * 2
    # Beside each generations row, in the same order, the trainer's teacher-forced logprob of each of
    # its response tokens (None on tool output): aligned with the tokens the exchange stored, so Δ
    # against the worker's own logprobs is small (a shift by one token would make it large).
    saved = [json.loads(line) for line in (run_dir / "token_logprobs.jsonl").read_text().splitlines()]
    assert [(t["step"], t["group_id"], t["sample_index"]) for t in saved] == [
        (g["step"], g["group_id"], g["sample_index"]) for g in generations]
    from rollmarket.contracts.sample import SampleGroup
    from rollmarket.contracts.wire import unpackb

    deltas = []
    with sqlite3.connect(run_dir / "exchange.db") as db:
        for t, g in zip(saved, generations):
            group = SampleGroup.model_validate(unpackb(db.execute(
                "SELECT payload FROM groups WHERE group_id=?", (t["group_id"],)).fetchone()[0]))
            traj = next(x for x in group.trajectories if x.sample_index == t["sample_index"])
            assert len(t["trainer_logprobs"]) == g["tokens"] == len(traj.response_token_ids)
            tool = traj.tool_output_mask if traj.tool_output_mask is not None else np.zeros(g["tokens"], np.uint8)
            for lp, behaviour, is_tool in zip(t["trainer_logprobs"], traj.logprobs, tool):
                assert (lp is None) == bool(is_tool) or (lp is None and not np.isfinite(behaviour))
                if lp is not None:
                    assert lp <= 0.0
                    deltas.append(abs(lp - float(behaviour)))
    assert deltas and float(np.mean(deltas)) < 0.05
    # The reward-tie figures are those of the step's groups (recounted here from generations.jsonl,
    # G = 2: a group ties when its two rewards are equal, and then it is uniform too).
    for row in metrics[1:]:
        groups = {}
        for g in generations:
            if g["step"] == row["step"]:
                groups.setdefault(g["group_id"], []).append(g["reward"])
        ties = [len(set(r)) == 1 for r in groups.values()]
        assert row["reward_tie_eligible_groups"] == len(groups) == 2
        assert row["reward_tie_group_rate"] == row["reward_uniform_group_rate"] == sum(ties) / 2
        assert row["reward_tie_pair_rate"] == sum(ties) / 2  # one pair per group
        assert row["reward_unique_fraction_mean"] == sum(1 / 2 if t else 1.0 for t in ties) / 2
        # Defaults: no planning detector, transform none, no reference: those figures are null.
        assert row["plan_entropy_mean"] is None and row["plan_token_fraction"] is None
        assert row["sepa_lambda"] is None and row["actor/kl_ref"] is None
        assert row["reward_shuffle/changed_fraction"] is None  # no shuffle: the figure does not apply
    assert all(g["trained_reward"] == g["reward"] for g in generations)
    assert {"step", "prompt", "response", "reward", "tokens", "decision"} <= generations[0].keys()
    assert all(g["tokens"] > 0 and g["response"] for g in generations)
    saved = json.loads((run_dir / "config.json").read_text())["config"]
    assert saved["loop"]["steps"] == 2 and saved["rollout"]["temperature"] == 2.0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_version"] == 2 and summary["eval_before"]["eval/tasks"] == 3


def test_gate_quarantine_is_skipped_and_correction_applies_where_the_gate_says(tmp_path):
    # A veto threshold below every bf16 |Δ| quarantines every group: nothing trains, weights stay.
    quarantined = Trainer(config(tmp_path, "loop.steps=1", "rollout.precisions=['bf16']", "local.workers=['bf16']",
                                 "eval.tasks=0", "gate.veto_abs_delta=1e-9"), local=True).run()
    row = rows(quarantined)[-1]
    assert (row["gate/quarantine"], row["num_datums"]) == (2, 0)
    trained = load_file(str(quarantined / "checkpoints" / "v0001" / "model.safetensors"))
    base = load_file(str(Path(MODEL) / "model.safetensors"))
    assert all((trained[k] == base[k]).all() for k in base)

    # A clamp below every |Δ| clips every token: the gate asks for correction and gets it.
    corrected = Trainer(config(tmp_path, "loop.steps=1", "rollout.precisions=['bf16']", "local.workers=['bf16']",
                               "eval.tasks=0", "gate.clamp=1e-9", "rollout.seed=3"), local=True).run()
    row = rows(corrected)[-1]
    assert row["gate/train_with_correction"] == 2
    if row["num_datums"]:
        assert row["rollout_corr/corrected_fraction"] == 1.0


def test_replay_is_used_only_when_enabled(tmp_path):
    common = ["loop.steps=1", "rollout.precisions=['fp8']", "local.workers=['fp8']", "eval.tasks=0",
              "gate.replay_ess=1.0", "rollout.seed=5"]
    off = rows(Trainer(config(tmp_path, *common), local=True).run())[-1]
    on = rows(Trainer(config(tmp_path, *common, "loop.replay=true"), local=True).run())[-1]
    assert off["gate/replay"] == on["gate/replay"] == 2
    assert off["num_datums"] == 0
    assert on["num_datums"] > 0 and on["rollout_corr/corrected_fraction"] == 1.0


def test_router_replay_step_routes_through_the_workers_experts(tmp_path):
    """trainer.router_replay: the jobs ask for routed experts, the gate judges the replayed forward
    (0 router flips against the fp8 workers; this run without replay flips 2.1% of top-1 experts),
    the step trains, and the setting is saved with the run. The forward
    itself is checked module by module in test_router_replay.py."""
    run_dir = Trainer(config(tmp_path, "loop.steps=1", "rollout.precisions=['fp8']", "local.workers=['fp8']",
                             "eval.tasks=0", "trainer.router_replay=true", "gate.veto_abs_delta=100",
                             "rollout.seed=5"), local=True).run()
    row = rows(run_dir)[-1]
    with sqlite3.connect(run_dir / "exchange.db") as db:
        needs = [n for (n,) in db.execute("SELECT needs_experts FROM jobs")]
    assert needs and all(needs)
    assert row["mismatch/router_flip_rate"] == 0.0
    assert row["num_datums"] > 0
    saved = json.loads((run_dir / "config.json").read_text())["config"]
    assert saved["trainer"]["router_replay"] is True


def test_async_mode_trains_on_groups_up_to_max_staleness(tmp_path):
    run_dir = Trainer(config(tmp_path, "loop.steps=3", "loop.mode=async", "loop.max_staleness=1",
                             "rollout.precisions=['bf16']", "local.workers=['bf16']", "eval.tasks=0"),
                      local=True).run()
    metrics = rows(run_dir)
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert all(0 <= r["policy_lag/mean"] for r in metrics)
    assert "reload_quorum" not in metrics[-1]  # async does not wait for the quorum
    assert audit_counts(run_dir)["policy.published"] == 4
    # No logging.trackers: every installed tracker mirrors the run (W&B is off under test: conftest).
    tracked = json.loads((run_dir / "summary.json").read_text())["trackers"]
    assert [t["tracker"] for t in tracked] == ["tensorboard"] and (run_dir / "tensorboard").is_dir()


def test_tensorboard_mirrors_the_metrics_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    run_dir = Trainer(config(tmp_path, "loop.steps=1", "rollout.precisions=['bf16']", "local.workers=['bf16']",
                             "eval.tasks=2", "logging.trackers=['tensorboard']"), local=True).run()
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    last = rows(run_dir)[-1]
    correct = events.Scalars("correct_rate")
    assert [e.step for e in correct] == [1] and correct[0].value == pytest.approx(last["correct_rate"])
    assert [e.step for e in events.Scalars("eval/accuracy/mean")] == [0, 1]
    # The step's rollouts as one text table: a header, a rule and a line per generations.jsonl row.
    generations = (run_dir / "generations.jsonl").read_text().splitlines()
    (tag,) = [t for t in events.Tags()["tensors"] if t.startswith("rollouts")]
    (text,) = events.Tensors(tag)
    assert text.step == 1 and generations
    assert len(tensor_util.make_ndarray(text.tensor_proto).item().decode().split("\n")) == 2 + len(generations)
    board = run_dir / "tensorboard"
    assert json.loads((run_dir / "summary.json").read_text())["trackers"] == [
        {"tracker": "tensorboard", "path": str(board), "open": f"tensorboard --logdir {board}"}]


def test_lora_run_publishes_merged_weights_that_workers_load(tmp_path):
    run_dir = Trainer(config(tmp_path, "loop.steps=2", "rollout.precisions=['bf16']", "local.workers=['bf16']",
                             "eval.tasks=0", "lora.enabled=true", "lora.r=4", "optim.lr=5e-3"), local=True).run()
    metrics = rows(run_dir)
    assert sum(r["num_datums"] for r in metrics) > 0
    trained = load_file(str(run_dir / "checkpoints" / "v0002" / "model.safetensors"))
    base = load_file(str(Path(MODEL) / "model.safetensors"))
    assert trained.keys() == base.keys()
    moved = {k for k in base if not (trained[k] == base[k]).all()}
    assert moved and all(any(p in k for p in ("q_proj", "k_proj", "v_proj", "o_proj")) for k in moved)
    assert (run_dir / "checkpoints" / "v0002" / "trainer" / "adapters.safetensors").exists()
    acked = {e["version"] for e in worker_events(run_dir, "reload_acked")}
    assert {1, 2} <= acked
