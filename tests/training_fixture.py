"""Training run directories written in code, for the dashboard's tests and benchmark.

The files have the shape `rollmarket train` writes (config.json, metrics.jsonl with one row per step
and step 0 the evaluation before training, evals.jsonl per held-out task per evaluation,
generations.jsonl, summary.json when finished), with numbers from one seeded generator, so a test
can recompute what a page should show from the files alone. `extra_keys` widens each row to the
size of a real run's (about a hundred keys) for the benchmark.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PRECISIONS = ("bf16", "fp8")
GATE = ("gate/train", "gate/train_with_correction", "gate/replay", "gate/quarantine")


def metrics_row(step: int, rng: random.Random, *, precisions=PRECISIONS, extra_keys: int = 0) -> dict:
    """One step's metrics row (step > 0) with the keys the dashboard's default charts draw."""
    reward = min(1.0, 0.2 + 0.02 * step + rng.uniform(-0.1, 0.1))
    row = {"step": step, "policy_version": step - 1, "correct_rate": reward, "running_correct_rate": reward * 0.9,
           "mean_reward": reward, "critic/rewards/mean": reward, "actor/entropy": 1.5 - 0.01 * step,
           "actor/ppo_kl": rng.uniform(0, 0.01), "actor/kl_ref": None, "actor/grad_norm": rng.uniform(0.5, 2.0),
           "actor/pg_clipfrac": rng.uniform(0, 0.2), "response_length/mean": rng.uniform(40, 80),
           "response_length/max": 128, "response_length/clip_ratio": rng.uniform(0, 0.1),
           "timing_s/gen": rng.uniform(1, 2), "timing_s/update": rng.uniform(0.5, 1),
           "timing_s/step": rng.uniform(2, 4), "perf/throughput": rng.uniform(100, 200),
           "perf/total_num_tokens": rng.randint(500, 1000), "condition": "base", "seed": 1}
    decisions = [rng.randint(0, 8) for _ in GATE]
    row.update(zip(GATE, decisions))
    for p in precisions:
        row.update({f"mismatch/{p}/token_ess_mean": rng.uniform(0.9, 1.0), f"mismatch/{p}/mean_abs_delta":
                    rng.uniform(0, 0.05), f"mismatch/{p}/router_flip_rate": rng.uniform(0, 0.1)})
    for i in range(extra_keys):
        row[f"extra/k{i:03d}"] = rng.random()
    return row


def eval_rows(step: int, rng: random.Random, tasks: int, samples: int) -> list[dict]:
    """evals.jsonl rows of one evaluation: a greedy pass and `samples` sampled passes per task."""
    return [{"step": step, "task_id": f"task-{t:02d}", "greedy_passed": rng.random() < 0.5,
             "sampled_passed": [rng.random() < 0.4 + 0.1 * t / tasks for _ in range(samples)],
             "sampled_rewards": [rng.random() for _ in range(samples)]} for t in range(tasks)]


def eval_summary(rows: list[dict]) -> dict:
    """What the loop puts in the metrics row: greedy accuracy and pass@1 over the tasks."""
    return {"eval/accuracy/mean": sum(r["greedy_passed"] for r in rows) / len(rows),
            "eval/pass@1": sum(sum(r["sampled_passed"]) / len(r["sampled_passed"]) for r in rows) / len(rows),
            "eval/tasks": len(rows)}


def write_training_run(path: Path, steps: int, *, planned: int | None = None, finished: bool = True,
                       eval_every: int = 2, tasks: int = 5, samples: int = 4, seed: int = 0, demo: bool = False,
                       extra_keys: int = 0, generations: bool = True) -> Path:
    """A training run at `path` with `steps` steps done (of `planned`); summary.json when `finished`."""
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    planned = steps if planned is None else planned
    config = {"config": {"loop": {"steps": planned}, "model": {"path": "models/tiny-start"},
                         "eval": {"every": eval_every, "samples": samples}}, "local": True, "code": {}}
    (path / "config.json").write_text(json.dumps(config))
    metrics, evals, gens = [], [], []
    for step in range(steps + 1):
        row = {"step": 0, "policy_version": 0} if step == 0 else metrics_row(step, rng, extra_keys=extra_keys)
        if step % eval_every == 0 or step == planned:
            rows = eval_rows(step, rng, tasks, samples)
            evals += rows
            row.update(eval_summary(rows))
        metrics.append(row)
        if step and generations:
            gens += [{"step": step, "group_id": f"g{step}", "task_id": "task-00", "sample_index": i,
                      "reward": float(i % 2), "prompt": "2+2?", "response": "4"} for i in range(2)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    (path / "evals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    if generations:
        (path / "generations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in gens))
    if finished:
        summary = {"steps": planned, "final_version": steps}
        if demo:
            summary["demo"] = {"suite": "calc"}
        (path / "summary.json").write_text(json.dumps(summary))
    return path
