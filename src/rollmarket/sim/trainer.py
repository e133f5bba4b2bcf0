"""A simulated trainer process: `python -m rollmarket.sim.trainer --url URL --token T`.

Each step it enqueues jobs for the current policy, fetches fresh groups, scores them against
the synthetic model's logprobs (standing in for teacher forcing), lets the gate decide, reports
decisions and feedback, "trains", and publishes the next policy version and waits for its
reload quorum. Every few steps it also draws from the replay tier. One JSON line per step goes
to --metrics.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np

from ..client import ExchangeError, TrainerClient
from ..contracts import DecisionStatus, RolloutJob, SamplingConfig, TaskSpec, Tier
from ..gate import GateConfig, budget_report, decide
from . import synthetic


def trainer_logprobs(group) -> list[np.ndarray]:
    """The synthetic model's logprobs of each trajectory's response, at the group's version."""
    return [
        synthetic.reference_logprobs(t.prompt_token_ids, t.response_token_ids, group.policy_version)
        for t in group.trajectories
    ]


class Scorer:
    """The trainer's view of a group: real teacher forcing for groups a real engine sampled
    (fp32, the trainer's numerics), the synthetic model for the simulated profiles."""

    def __init__(self) -> None:
        self._engine = None

    def is_real(self, group) -> bool:
        return bool(synthetic.MODEL_PATH) and group.engine_name == REAL_ENGINE

    def __call__(self, group) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
        if not self.is_real(group):
            return trainer_logprobs(group), None
        if self._engine is None:
            from ..engines import TrainerEngine

            self._engine = TrainerEngine.from_path(synthetic.MODEL_PATH, "fp32")
        scored = self._engine.score_batch([(t.prompt_token_ids, t.response_token_ids)
                                           for t in group.trajectories])
        experts = [s.routed_experts_TLK for s in scored]
        return [s.logprobs_T for s in scored], (experts if all(e is not None for e in experts) else None)


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


REAL_ENGINE = "rollmarket-hf"
SIM_ENGINES = ["sim-bf16", "sim-fp8"]


def make_jobs(step: int, version: int, count: int, group_size: int) -> list[RolloutJob]:
    """Jobs for the simulated workers (their engines only)."""
    return [
        RolloutJob(
            job_id=f"job-s{step:03d}-{i:02d}", idempotency_key=f"demo-step{step}-job{i}",
            task=TaskSpec(task_id=f"arith-{step}-{i}", prompt=f"What is {step * 7 + i} + {i * 13}?",
                          verifier="numeric", answer=step * 7 + i + i * 13),
            policy_version=version, group_size=group_size, sampling_config=synthetic.demo_sampling(),
            max_context_tokens=2048, allowed_engines=SIM_ENGINES,
        )
        for i in range(count)
    ]


def make_real_jobs(step: int, version: int, tasks: list[TaskSpec], precisions: list[str], per_precision: int,
                   group_size: int) -> list[RolloutJob]:
    """Agent jobs on suite tasks for the real workers, `per_precision` for each precision profile."""
    from ..engines.precision import Precision

    jobs = []
    for precision in precisions:
        for i in range(per_precision):
            task = tasks[(step * per_precision + i) % len(tasks)]
            jobs.append(RolloutJob(
                job_id=f"job-s{step:03d}-{precision}-{i:02d}", idempotency_key=f"demo-step{step}-{precision}-{i}",
                task=task, policy_version=version, group_size=group_size,
                # The same task with the same seed on every precision: the observatory compares the runs.
                sampling_config=SamplingConfig(temperature=1.0, max_tokens=96, seed=step * 1000 + i),
                required_precision=precision, required_quantization=Precision(precision).quantization,
                allowed_engines=[REAL_ENGINE], max_context_tokens=2048, priority=1,
            ))
    return jobs


def publish(trainer: TrainerClient, version: int, checkpoints: Path | None, keep: int = 3) -> None:
    """Publish `version` (writing its checkpoint first) and drop checkpoints `keep` versions old."""
    trainer.publish_policy(synthetic.policy_manifest(version, checkpoints))
    if checkpoints is not None and version >= keep:
        shutil.rmtree(checkpoints / f"v{version - keep:04d}", ignore_errors=True)


def run(url: str, token: str, steps: int, jobs_per_step: int, group_size: int, metrics_path: Path,
        stop_file: Path | None, step_seconds: float, replay_every: int, *, checkpoints: Path | None = None,
        suite: str = "arithmetic", real_precisions: list[str] = (), real_jobs: int = 2) -> int:
    gate = GateConfig()
    trainer = TrainerClient(url, token, trainer_id="sim-trainer", retries=8)
    out = open(metrics_path, "a", buffering=1)
    version = 0
    scorer = Scorer()
    real_precisions = list(real_precisions) if synthetic.MODEL_PATH else []
    tasks = []
    if real_precisions:
        from ..tasks.suites import load_suite

        tasks = load_suite(suite, "train")
    publish(trainer, version, checkpoints)
    trainer.wait_for_quorum(version, timeout=120)
    for step in range(steps):
        started = time.time()
        trainer.enqueue(make_jobs(step, version, jobs_per_step, group_size))
        if real_precisions:
            trainer.enqueue(make_real_jobs(step, version, tasks, real_precisions, real_jobs, group_size))
        decisions: Counter = Counter()
        ess, abs_delta = [], []
        real: dict[str, list[float]] = {"ess": [], "abs_delta": [], "flip": [], "reward": []}
        per_precision: dict[str, dict[str, list[float]]] = {}
        deadline = time.time() + step_seconds

        def judge(fetched) -> None:
            group = fetched.group
            logprobs, experts = scorer(group)
            report = budget_report(group, logprobs, trainer_routed_experts=experts,
                                   policy_lag_steps=fetched.current_lag, config=gate)
            if scorer.is_real(group):
                mine = per_precision.setdefault(group.precision_class,
                                                {"ess": [], "abs_delta": [], "flip": [], "reward": []})
                for bucket in (real, mine):
                    bucket["ess"].append(report.token_ess)
                    bucket["abs_delta"].append(report.mean_abs_delta)
                    if report.router_flip_rate is not None:
                        bucket["flip"].append(report.router_flip_rate)
                    bucket["reward"].extend(t.reward for t in group.trajectories)
            decision = decide(report, gate, decided_by="sim-trainer")
            trainer.report(group.group_id, decision)
            decisions[decision.status.value] += 1
            ess.append(report.token_ess)
            abs_delta.append(report.mean_abs_delta)

        while time.time() < deadline:
            batch = trainer.fetch(tier=Tier.fresh, limit=32)
            for fetched in batch.groups:
                judge(fetched)
            if not batch.groups:
                time.sleep(0.1)
        replay_served = 0
        if replay_every and step % replay_every == replay_every - 1:
            # Replay is served only because it is asked for; the demo counts what comes back and judges
            # it like any group (on a loaded machine the real workers' groups may all arrive stale).
            replayed = trainer.fetch(tier=Tier.replay, limit=8).groups
            replay_served = len(replayed)
            for fetched in replayed:
                judge(fetched)
        previous = version
        version += 1
        publish(trainer, version, checkpoints)
        try:
            pool = trainer.wait_for_quorum(version, timeout=30)
            quorum = f"{pool.acks}/{pool.quorum}"
        except ExchangeError:
            quorum = "timeout"
        line = {
            "step": step, "policy_version": previous, "next_version": version, "quorum": quorum,
            "num_groups": sum(decisions.values()), "replay_served": replay_served,
            **{f"gate/{status.value}": decisions.get(status.value, 0) for status in DecisionStatus
               if status is not DecisionStatus.reject},
            "rollout_corr/token_ess_mean": float(np.mean(ess)) if ess else None,
            "rollout_corr/mean_abs_delta": float(np.mean(abs_delta)) if abs_delta else None,
            "engine/groups": len(real["ess"]),
            "engine/token_ess_mean": _mean(real["ess"]),
            "engine/mean_abs_delta": _mean(real["abs_delta"]),
            "engine/router_flip_rate": _mean(real["flip"]),
            "engine/reward_mean": _mean(real["reward"]),
            **{f"engine/{p}/{key}": value for p, bucket in sorted(per_precision.items())
               for key, value in (("groups", len(bucket["ess"])), ("token_ess_mean", _mean(bucket["ess"])),
                                  ("mean_abs_delta", _mean(bucket["abs_delta"])),
                                  ("router_flip_rate", _mean(bucket["flip"])),
                                  ("reward_mean", _mean(bucket["reward"])))},
            "timing_s/step": round(time.time() - started, 3),
        }
        out.write(json.dumps(line) + "\n")
        if stop_file is not None and stop_file.exists():
            break
    out.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--url", required=True)
    parser.add_argument("--token", default=os.environ.get("ROLLMARKET_TRAINER_TOKEN"),
                        help="Trainer token (default: $ROLLMARKET_TRAINER_TOKEN).")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--jobs-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--metrics", type=Path, required=True)
    parser.add_argument("--stop-file", type=Path, default=None)
    parser.add_argument("--step-seconds", type=float, default=1.5)
    parser.add_argument("--replay-every", type=int, default=3)
    parser.add_argument("--checkpoints", type=Path, default=None,
                        help="Write each version's checkpoint here (real-model demo).")
    parser.add_argument("--suite", default="arithmetic", help="Task suite of the real workers' jobs.")
    parser.add_argument("--real-precisions", default="", help="Comma-separated precisions of real workers.")
    parser.add_argument("--real-jobs", type=int, default=2, help="Agent jobs per step per real precision.")
    args = parser.parse_args(argv)
    if not args.token:
        parser.error("--token or ROLLMARKET_TRAINER_TOKEN is required")
    return run(args.url, args.token, args.steps, args.jobs_per_step, args.group_size, args.metrics,
               args.stop_file, args.step_seconds, args.replay_every, checkpoints=args.checkpoints,
               suite=args.suite, real_precisions=[p for p in args.real_precisions.split(",") if p],
               real_jobs=args.real_jobs)


if __name__ == "__main__":
    raise SystemExit(main())
