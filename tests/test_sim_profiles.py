"""The simulated workers' groups, judged as the fault-path demo's trainer judges them.

Each profile's trajectories come from sim/profiles.py with logprobs of the real tiny MoE
(sim/policy.py); the trainer's side is the tiny MoE teacher-forced at fp32 by an engine loaded
here, and the gate runs with the demo's settings. What each profile is meant to exercise is
what the gate decides."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from rollmarket.contracts import DecisionStatus, RolloutJob, SamplingConfig, TaskSpec
from rollmarket.gate import GateConfig, decide
from rollmarket.gate.budget import budget_from_arrays
from rollmarket.sim import profiles
from rollmarket.sim.demo import DemoConfig
from rollmarket.sim.policy import ModelPolicy

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-moe"


@pytest.fixture(scope="module")
def policy():
    return ModelPolicy(MODEL, scores=True)


@pytest.fixture(scope="module")
def trainer():
    from rollmarket.engines import TrainerEngine

    return TrainerEngine.from_path(MODEL, "fp32")


def _grant():
    task = TaskSpec(task_id="t-1", prompt="What is 17 + 25?", verifier="numeric", answer=42)
    job = RolloutJob(job_id="j-1", idempotency_key="j-1", task=task, policy_version=0, group_size=4,
                     sampling_config=SamplingConfig(temperature=1.0, max_tokens=96), max_context_tokens=2048)
    return SimpleNamespace(job=job)  # _trajectory reads the job only


def _decision(trainer, trajectories, lag: int = 0) -> DecisionStatus:
    demo = DemoConfig()
    gate = GateConfig(clamp=demo.clamp, max_clipped_fraction=demo.max_clipped_fraction,
                      max_policy_lag=demo.max_policy_lag, replay_lag=0)  # loop.max_staleness=0
    scored = trainer.score_batch([(t.prompt_token_ids, t.response_token_ids) for t in trajectories])
    rollout = np.concatenate([t.logprobs for t in trajectories])
    mine = np.concatenate([s.logprobs_T for s in scored])
    ids = np.concatenate([np.full(t.num_response_tokens, i) for i, t in enumerate(trajectories)])
    report = budget_from_arrays(rollout, mine, ids, len(trajectories), group_id="g-1", config=gate,
                                policy_lag_steps=lag)
    return decide(report, gate).status


def test_the_prompt_is_the_task_in_the_models_tokenizer(policy):
    from transformers import AutoTokenizer

    ids = policy.encode(_grant().job.task)
    assert AutoTokenizer.from_pretrained(MODEL).decode(ids.tolist()) == "What is 17 + 25?"
    assert policy.vocab_size == 1536 and ids.max() < policy.vocab_size


@pytest.mark.parametrize("kwargs,lag,expected", [
    ({"sigma": 0.003}, 0, DecisionStatus.train),  # honest
    ({"sigma": 0.003}, 1, DecisionStatus.replay),  # stale: one version late
    ({"sigma": 0.003}, 5, DecisionStatus.quarantine),  # stale past max_policy_lag
    ({"sigma": 0.1}, 0, DecisionStatus.train_with_correction),  # noisy
    ({"sigma": 0.05, "spike": True}, 0, DecisionStatus.quarantine),  # noisy with an e^35 token
    ({"sigma": 0.02, "forbidden_share": 0.2}, 0, DecisionStatus.train_with_correction),  # toxic precision
])
def test_each_profile_gets_the_decision_it_is_there_for(policy, trainer, kwargs, lag, expected):
    rng = np.random.default_rng(7)
    trajectories = [profiles._trajectory(rng, _grant(), policy, i, **kwargs) for i in range(4)]
    assert _decision(trainer, trajectories, lag) is expected


def test_a_worker_that_falls_behind_the_pruned_checkpoints_keeps_its_weights(policy, tmp_path):
    prompt, response = np.array([5, 6], np.int32), np.array([7, 8, 9], np.int32)
    before = policy.logprobs(prompt, response)
    policy.load(str(tmp_path / "v0007"))  # pruned by the trainer before the worker got to it
    assert np.array_equal(policy.logprobs(prompt, response), before)
    with pytest.raises(RuntimeError, match="does not score"):
        ModelPolicy(MODEL, scores=False).logprobs(prompt, response)
