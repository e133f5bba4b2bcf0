"""The shuffled-reward control (`reward.shuffle = "batch"`, issue 14 §3a): rewards permuted across
a step's groups before the advantages, reproducibly from the run's sampling seed and the step.

The unit tests check the permutation's properties by hand-chosen batches; the loop test runs one
real step (real exchange, real worker, the tiny MoE) and recounts from generations.jsonl that the
step trained with a permutation of its own rewards and GRPO advantages of the permuted ones."""

from __future__ import annotations

import hashlib
import json
import sqlite3
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from rollmarket.train.config import TrainConfigError, resolve
from rollmarket.train.loop import Trainer
from rollmarket.train.reward_shuffle import (RewardShuffleError, changed_fraction, shuffle_batch_rewards,
                                             shuffle_seed)

ROOT = Path(__file__).resolve().parent.parent

# Five distinct rewards in groups of 2 and 3: any permutation other than the identity moves one.
BATCH = [[0.1, 0.2], [0.3, 0.4, 0.5]]


def test_the_seed_is_the_documented_hash_of_the_sampling_seed_and_step():
    # sha256("shuffle:7:3"), first 8 hex digits, as an integer (docs/training.md).
    expected = int(hashlib.sha256(b"shuffle:7:3").hexdigest()[:8], 16)
    assert shuffle_seed(7, 3) == expected
    assert 0 <= expected < 16 ** 8
    assert len({shuffle_seed(seed, step) for seed in range(4) for step in range(1, 5)}) == 16


def test_a_batch_shuffle_keeps_the_multiset_and_group_sizes_and_moves_rewards():
    seen = set()
    for step in range(1, 9):
        trained = shuffle_batch_rewards(BATCH, mode="batch", seed=shuffle_seed(0, step))
        assert [len(g) for g in trained] == [2, 3]
        assert sorted(r for g in trained for r in g) == [0.1, 0.2, 0.3, 0.4, 0.5]
        seen.add(tuple(r for g in trained for r in g))
    # 8 steps of a 5-element permutation (120 possible): they differ from step to step and most
    # move rewards across groups (the identity has probability 1/120 per step).
    assert len(seen) >= 6
    assert sum(t != (0.1, 0.2, 0.3, 0.4, 0.5) for t in seen) >= 6
    assert any(set(t[:2]) != {0.1, 0.2} for t in seen), "no reward ever crossed into another group"


def test_the_same_seed_gives_the_same_permutation_and_none_keeps_every_reward():
    a = shuffle_batch_rewards(BATCH, mode="batch", seed=12345)
    b = shuffle_batch_rewards(BATCH, mode="batch", seed=12345)
    assert a == b and a is not b
    assert shuffle_batch_rewards(BATCH, mode="none", seed=12345) == BATCH
    # Binary rewards: 2 of 5 are 1; the shuffled batch still has exactly 2.
    binary = [[1.0, 0.0], [0.0, 1.0, 0.0]]
    for seed in range(10):
        trained = shuffle_batch_rewards(binary, mode="batch", seed=seed)
        assert Counter(r for g in trained for r in g) == Counter({0.0: 3, 1.0: 2})


def test_changed_fraction_counts_runs_with_another_reward():
    # 4 runs: the first two swapped values (both changed), the last two kept theirs.
    assert changed_fraction([[1.0, 0.0], [0.0, 0.0]], [[0.0, 1.0], [0.0, 0.0]]) == 0.5
    assert changed_fraction([], []) is None


def test_bad_modes_and_empty_groups_are_typed_errors():
    with pytest.raises(RewardShuffleError, match="unknown reward shuffle mode 'groups'"):
        shuffle_batch_rewards(BATCH, mode="groups", seed=0)
    with pytest.raises(RewardShuffleError, match="without rewards"):
        shuffle_batch_rewards([[1.0], []], mode="batch", seed=0)
    with pytest.raises(TrainConfigError, match=r"reward\.shuffle"):
        resolve(None, ["reward.shuffle=groups"])
    with pytest.raises(TrainConfigError, match=r"reward\.shufle.*did you mean reward\.shuffle"):
        resolve(None, ["reward.shufle=batch"])
    assert resolve(None, ["reward.shuffle=batch"]).reward.shuffle == "batch"
    assert resolve(None, []).reward.shuffle == "none"


def test_a_shuffled_step_trains_on_a_permutation_of_its_own_rewards(tmp_path):
    """One real step of 4 groups × 2 runs with reward.shuffle = "batch", on tiny-start (held-out
    pass@1 ≈ 0.3, so a step's 8 rewards rarely all tie; the sampling is seeded per sequence, so the
    seed below keeps giving a mixed step until the sampler itself changes)."""
    cfg = resolve(None, [
        f"model.path={json.dumps(str(ROOT / 'models' / 'tiny-start'))}", "rollout.suite=arithmetic",
        "rollout.groups_per_step=4", "rollout.group_size=2", "rollout.temperature=1.0", "rollout.max_tokens=48",
        "agent.max_turns=3", "eval.tasks=0", "local.lease_ttl_s=8", "rollout.precisions=['bf16']",
        "local.workers=['bf16']", "loop.steps=1", "reward.shuffle=batch", "rollout.seed=1",
        f"runs_root={json.dumps(str(tmp_path))}"])
    run_dir = Trainer(cfg, local=True).run()
    row = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][-1]
    gens = [json.loads(line) for line in (run_dir / "generations.jsonl").read_text().splitlines()]
    assert len(gens) == 8
    own, trained = [g["reward"] for g in gens], [g["trained_reward"] for g in gens]
    assert len(set(own)) > 1, "the step's rewards all tie: the shuffle cannot be seen (pick another seed)"
    assert Counter(own) == Counter(trained)  # the batch's rewards, reassigned
    assert row["reward_shuffle/changed_fraction"] == sum(a != b for a, b in zip(own, trained)) / 8
    # The permutation is the documented one: groups in job-id order (from the exchange's database),
    # runs by sample index, permuted with step 1's seed from rollout.sampling_seed (= rollout.seed 1).
    with sqlite3.connect(run_dir / "exchange.db") as db:
        job_of = dict(db.execute("SELECT group_id, job_id FROM groups").fetchall())
    by_group: dict[str, list[dict]] = {}
    for g in gens:
        by_group.setdefault(g["group_id"], []).append(g)
    groups = [sorted(rows, key=lambda g: g["sample_index"])
              for _, rows in sorted(by_group.items(), key=lambda item: job_of[item[0]])]
    assert len(groups) == 4
    expected = shuffle_batch_rewards([[g["reward"] for g in rows] for rows in groups], mode="batch",
                                     seed=shuffle_seed(1, 1))
    assert [[g["trained_reward"] for g in rows] for rows in groups] == expected
    # GRPO advantages of the trained rewards (population std; G = 2 with two values gives ±1).
    for rows in groups:
        r_G = np.array([g["trained_reward"] for g in rows])
        expected_G = np.zeros(2) if r_G[0] == r_G[1] else np.where(r_G > r_G.mean(), 1.0, -1.0)
        np.testing.assert_allclose([g["advantage"] for g in rows], expected_G, atol=1e-5)
    assert row["num_datums"] == sum(g["advantage"] != 0 for g in gens if g["decision"] == "train")


def test_the_experiment_campaign_files_resolve_and_keep_their_declared_design():
    """configs/exp-a-campaign.toml and exp-c-campaign.toml (issue 14 §3): every run resolves and
    validates as `rollmarket campaign` would check it, and the design the docs state holds."""
    from rollmarket.research.campaign import load_campaign
    from rollmarket.research.stats import StatsSettings

    # Before models/tiny-start is built, the files are checked against the tiny MoE (same architecture).
    model = [] if (ROOT / "models" / "tiny-start" / "config.json").is_file() else [
        f"model.path={json.dumps(str(ROOT / 'models' / 'tiny-moe'))}"]
    a = load_campaign(ROOT / "configs" / "exp-a-campaign.toml", model)
    assert [c.name for c in a.conditions] == ["grpo", "shuffled"] and len(a.seeds) >= 8
    shuffle = {r.condition: r.config.reward.shuffle for r in a.runs}
    assert shuffle == {"grpo": "none", "shuffled": "batch"}
    for run in a.runs:
        assert run.config.eval.samples >= 16 and run.config.eval.every == 0 and run.config.eval.tasks >= 32
    assert a.stats["metrics"] == ["eval/pass@1@final"] and a.stats["baseline"] == "shuffled"
    StatsSettings.from_table(a.stats)  # `rollmarket stats` accepts the table

    c = load_campaign(ROOT / "configs" / "exp-c-campaign.toml", model)
    assert len(c.seeds) >= 6 and c.stats["baseline"] == "default" and c.stats["metrics"] == ["eval/pass@1@final"]
    StatsSettings.from_table(c.stats)
    gates = {r.condition: (r.config.gate.min_ess, r.config.gate.max_policy_lag) for r in c.runs}
    assert gates == {"default": (0.3, 8), "lag2": (0.3, 2), "lag1": (0.3, 1), "lag0": (0.3, 0),
                     "ess99": (0.99, 8), "ess999": (0.999, 8)}
    for run in c.runs:  # a drifting worker in async mode, replay on: only the thresholds differ
        assert run.config.loop.mode == "async" and run.config.loop.replay
        assert any(spec.reload_lag > 0 for spec in run.config.local.specs)
    assert len(c.seeds) >= 8 and len(c.runs) == 48  # the committed result (experiments/results/exp-c) ran these
