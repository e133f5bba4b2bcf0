"""One seed rule (contracts/seeds.py): the same task under the same base seed gets the same draws in
`collect` and in a training run's eval, whatever the order or subset of tasks around it.

Each agent run is recorded as it returns (a spy that calls through to the real `Agent.run`), and
the sampled tokens of a task's runs are compared between the two, on the tiny model served on
loopback. Before the rule, eval seeded a task by its position in the list.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from rollmarket.agents import Agent, AgentSettings, ChatModel, LocalToolbox, Sampling
from rollmarket.agents.collect import collect
from rollmarket.engines import RolloutEngine
from rollmarket.engines.loading import load_model
from rollmarket.tasks.suites import load_suite
from rollmarket.train.evaluate import evaluate_policy
from rollmarket.train.reference import serve_in_process
from rollmarket.verifiers import verify_trajectory

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-dense"
BASE, TEMPERATURE, MAX_TOKENS = 5, 3.0, 12  # hot: the tiny model is confident


def _spy(monkeypatch) -> dict:
    """(task id, sample index) → the sampled token ids of each sampled (temperature > 0) run."""
    runs: dict = {}
    real = Agent.run

    def run(self, task, sampling, **kw):
        trajectory = real(self, task, sampling, **kw)
        if sampling.temperature > 0:
            tokens = tuple(t for step in trajectory.steps for t in step.response_token_ids)
            runs.setdefault((task.task_id, kw.get("sample_index", 0)), []).append(tokens)
        return trajectory

    monkeypatch.setattr(Agent, "run", run)
    return runs


def test_collect_and_eval_draw_a_task_alike_in_any_order(tmp_path, monkeypatch):
    loaded = load_model(MODEL, "fp32")
    tasks = load_suite("arithmetic", "heldout")[:3]
    runs = _spy(monkeypatch)

    learner = SimpleNamespace(loaded=loaded, model=loaded.model)
    evaluate_policy(learner, tasks, samples=2, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, max_turns=1, seed=BASE)
    evaluated = dict(runs)
    runs.clear()
    # The last task alone, first in its list: before the rule its seed followed its position.
    evaluate_policy(learner, tasks[-1:], samples=2, temperature=TEMPERATURE, max_tokens=MAX_TOKENS, max_turns=1,
                    seed=BASE)
    alone = dict(runs)
    runs.clear()
    with serve_in_process(RolloutEngine(loaded)) as url:
        agent = Agent(ChatModel(url), LocalToolbox(), AgentSettings(max_steps=1), verify=verify_trajectory)
        collect(agent, list(reversed(tasks)), repeats=2, out=tmp_path / "rollouts.jsonl",
                failures=tmp_path / "failures.jsonl", concurrency=2,
                sampling=Sampling(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, seed=BASE))
    collected = dict(runs)

    last = tasks[-1].task_id
    assert alone == {k: v for k, v in evaluated.items() if k[0] == last}
    assert collected == evaluated and len(collected) == 6
    # Different tasks and different samples of one task draw differently.
    assert len({v[0] for v in collected.values()}) > 1
