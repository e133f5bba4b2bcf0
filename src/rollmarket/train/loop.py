"""The closed loop: `rollmarket train CONFIG.toml`, a GRPO-family trainer fed by the exchange.

    publish v ─► enqueue the step's jobs ─► fetch groups ─► teacher-force (π_old) ─► BudgetReport
      ─► gate: train | train_with_correction | replay | quarantine ─► report decision + feedback
      ─► advantages, IS correction where asked ─► optimizer step ─► checkpoint v+1 (+digest)
      ─► publish v+1 ─► sync: wait for the reload quorum | async: go on, take groups ≤ max_staleness old

The run directory is the record:

    runs/<UTC timestamp>-<id>/
        config.json        resolved settings (file + overrides + defaults), code version
        metrics.jsonl      one row per step (docs/metrics.md, "Training")
        generations.jsonl  every trajectory used or judged: step, prompt, response, reward, tokens
        evals.jsonl        held-out evaluation per task and step (greedy and sampled passes)
        summary.json       held-out accuracy before/after, steps, timings
        checkpoints/vNNNN  the newest checkpoints (safetensors + config + tokenizer; trainer/ holds
                           optimizer state and counters for resume)
        exchange.db        --local only: the in-process exchange's database
        workers/           --local only: each worker's events and agent runs

Resume (`rollmarket train --resume RUN_DIR`) restarts from the newest complete checkpoint: the
exchange still holds the jobs (idempotency keys make re-enqueueing a no-op) and the groups
(undecided ones are fetched again).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import torch

from ..client import ExchangeError, TrainerClient
from ..contracts import DecisionStatus, PolicyManifest, RolloutJob, SamplingConfig, Tier
from ..engines.precision import Precision
from ..engines.provenance import checkpoint_digest
from ..gate import budget_report, decide
from ..gate.budget import valid_token_mask
from ..runs import code_version, new_run_dir, write_json
from ..tasks.suites import load_suite
from .advantages import compute_advantages
from .batch import Datum
from .config import TrainConfig, TrainConfigError, resolve

CORRECT_REWARD = 1.0
"""A run counts as correct when its reward reaches this (the verifiers' pass value)."""

NO_UPDATE = {key: 0.0 for key in (
    "loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl",
    "exec_entropy_mean", "exec_entropy_var", "plan_entropy_mean", "plan_entropy_var",
    "rollout_corr/mean_abs_delta", "rollout_corr/max_abs_delta", "rollout_corr/corrected_fraction")}
"""A step without a group worth training on (every group tied or was held back) logs zeros."""

USABLE = {DecisionStatus.train, DecisionStatus.train_with_correction, DecisionStatus.replay}


class TrainingError(RuntimeError):
    """The loop cannot go on (no groups in time, a quorum that never forms, a resume that does not fit)."""


@dataclasses.dataclass
class StepGroups:
    """What one step collected: datums to train on and the numbers about every group it judged."""

    data: list[Datum] = dataclasses.field(default_factory=list)
    decisions: Counter = dataclasses.field(default_factory=Counter)
    rewards: list[float] = dataclasses.field(default_factory=list)
    lengths: list[int] = dataclasses.field(default_factory=list)
    truncated: int = 0
    groups: int = 0
    tie_groups: int = 0
    uniform_groups: int = 0
    advantages: list[float] = dataclasses.field(default_factory=list)
    lags: list[int] = dataclasses.field(default_factory=list)
    mismatch: dict = dataclasses.field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    generations: list[dict] = dataclasses.field(default_factory=list)
    tokens_used: int = 0


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.mean(values)) if values else None


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint (its trainer state written) under run_dir/checkpoints."""
    root = run_dir / "checkpoints"
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("v[0-9]*") if (p / "trainer" / "state.json").exists())
    return done[-1] if done else None


class Trainer:
    """One training run. `run()` returns the run directory; `on_step(row)` sees each metrics row."""

    def __init__(self, config: TrainConfig, *, local: bool = False, resume: Path | None = None,
                 on_step: Callable[[dict], None] | None = None,
                 on_event: Callable[[str, dict], None] | None = None, run_dir: Path | None = None,
                 token: str | None = None):
        self.config = config
        self.given_run_dir = run_dir
        self.token = token
        self.local = local
        self.resume = resume
        self.on_step = on_step or (lambda row: None)
        self.on_event = on_event or (lambda kind, data: None)

    # -- setup ------------------------------------------------------------------------------------

    def _run_dir(self) -> Path:
        if self.resume is not None:
            if not (self.resume / "config.json").exists():
                raise TrainConfigError(f"{self.resume} is not a training run directory (no config.json)")
            return self.resume
        run_dir = self.given_run_dir or new_run_dir(self.config.runs_root)
        write_json(run_dir / "config.json", {"config": self.config.model_dump(mode="json"), "local": self.local,
                                             "code": code_version()})
        return run_dir

    def _client(self, stack: ExitStack, run_dir: Path) -> TrainerClient:
        cfg = self.config
        if self.local:
            from .cluster import LocalCluster

            cluster = stack.enter_context(LocalCluster(
                run_dir, cfg.model.path, cfg.local.workers, max_turns=cfg.agent.max_turns,
                lease_ttl_s=cfg.local.lease_ttl_s))
            url, token = cluster.url, cluster.token
        else:
            url = cfg.exchange.url
            token = self.token or os.environ.get(cfg.exchange.token_env, "")
            if not url:
                raise TrainConfigError("exchange.url is not set: pass exchange.url=http://HOST:PORT or --local")
            if not token:
                raise TrainConfigError(f"set ${cfg.exchange.token_env} to the exchange's trainer token")
        client = TrainerClient(url, token, trainer_id=cfg.exchange.trainer_id, retries=8)
        stack.callback(client.close)
        if not self.local:  # a remote exchange may not be up yet: wait for it, saying so
            client.http.wait_for_exchange(cfg.exchange.wait_s)
        return client

    def _manifest(self, version: int, path: Path, digest: str) -> PolicyManifest:
        info = self.learner.loaded.info
        return PolicyManifest(
            policy_version=version, parent_version=None if version == self.base_version else version - 1,
            checkpoint_digest=digest, checkpoint_uri=str(path.resolve()), tokenizer_hash=info.tokenizer_hash,
            model_config_hash=info.model_config_hash, vocab_size=info.vocab_size,
            precision_class=self.config.rollout.precisions[0],
            quantization_class=Precision(self.config.rollout.precisions[0]).quantization)

    # -- jobs ---------------------------------------------------------------------------------------

    def _jobs(self, step: int, version: int) -> list[RolloutJob]:
        r = self.config.rollout
        jobs = []
        for i in range(r.groups_per_step):
            task = self.train_tasks[((step - 1) * r.groups_per_step + i) % len(self.train_tasks)]
            precision = r.precisions[i % len(r.precisions)]
            seed = int(hashlib.sha256(f"{r.seed}:{step}:{i}".encode()).hexdigest()[:8], 16)
            key = f"{self.run_id}-s{step:05d}-{i:03d}"
            jobs.append(RolloutJob(
                job_id=key, idempotency_key=key, task=task, policy_version=version, group_size=r.group_size,
                sampling_config=SamplingConfig(temperature=r.temperature, max_tokens=r.max_tokens, seed=seed),
                required_precision=precision, required_quantization=Precision(precision).quantization,
                max_context_tokens=self.learner.loaded.info.max_context_tokens))
        return jobs

    def _enqueue(self, step: int, version: int) -> None:
        if step <= self.config.loop.steps and step not in self.enqueued:
            self.client.enqueue(self._jobs(step, version))
            self.enqueued.add(step)

    # -- one group ----------------------------------------------------------------------------------

    def _judge(self, fetched, step: int, out: StepGroups) -> None:
        cfg = self.config
        group = fetched.group
        trajectories = group.trajectories
        t0 = time.perf_counter()
        scored = self.learner.score([(t.prompt_token_ids, t.response_token_ids) for t in trajectories],
                                    cfg.rollout.temperature)
        self.timing["score"] += time.perf_counter() - t0
        experts = [s.routed_experts_TLK for s in scored]
        use_experts = all(e is not None for e in experts) and all(t.routed_experts is not None for t in trajectories)
        report = budget_report(group, [s.logprobs_T for s in scored],
                               trainer_routed_experts=experts if use_experts else None,
                               policy_lag_steps=fetched.current_lag, config=self.gate)
        decision = decide(report, self.gate, decided_by=cfg.exchange.trainer_id)
        self.client.report(group.group_id, decision)  # the decision, and feedback on the worker
        status = decision.status
        out.decisions[status.value] += 1
        out.groups += 1
        out.lags.append(fetched.current_lag)
        bucket = out.mismatch[group.precision_class]
        bucket["token_ess"].append(report.token_ess)
        bucket["mean_abs_delta"].append(report.mean_abs_delta)
        bucket["kl_k3"].append(report.kl_k3)
        if report.router_flip_rate is not None:
            bucket["router_flip_rate"].append(report.router_flip_rate)

        rewards_G = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
        advantages_G = compute_advantages(rewards_G, cfg.algorithm.advantage)
        distinct = len(set(rewards_G.tolist()))
        out.uniform_groups += int(distinct == 1)
        out.tie_groups += int(distinct < len(trajectories))
        use = status in USABLE and (status is not DecisionStatus.replay or cfg.loop.replay)
        corrected = {"always": True, "never": False}.get(
            cfg.correction.when, status in (DecisionStatus.train_with_correction, DecisionStatus.replay))
        for t, s, adv in zip(trajectories, scored, advantages_G.tolist()):
            out.rewards.append(t.reward)
            out.lengths.append(t.num_response_tokens)
            out.truncated += int(t.finish_reason.value == "length")
            if self.write_generations:
                tok = self.learner.loaded.tokenizer
                out.generations.append({
                    "step": step, "group_id": group.group_id, "task_id": group.task_id,
                    "sample_index": t.sample_index, "policy_version": group.policy_version,
                    "precision": group.precision_class, "decision": status.value, "used": use and adv != 0.0,
                    "reward": t.reward, "advantage": adv, "tokens": t.num_response_tokens,
                    "prompt": tok.decode(t.prompt_token_ids), "response": tok.decode(t.response_token_ids)})
            if not use or adv == 0.0:
                continue  # a run that ties its group carries no policy-gradient signal
            mask_T = valid_token_mask(t)
            if not mask_T.any():
                continue
            out.data.append(Datum(t.prompt_token_ids, t.response_token_ids, t.logprobs, mask_T.astype(np.float32),
                                  advantage=adv, corrected=corrected, old_logprobs_T=s.logprobs_T))
            out.advantages.append(adv)
            out.tokens_used += int(mask_T.sum())

    def _collect(self, step: int, version: int) -> StepGroups:
        cfg = self.config
        out = StepGroups()
        deadline = time.monotonic() + cfg.loop.fetch_timeout_s
        sync = cfg.loop.mode == "sync"
        include_served = self.first_fetch
        self.first_fetch = False
        while out.groups < cfg.rollout.groups_per_step:
            if time.monotonic() > deadline:
                raise TrainingError(f"step {step}: {out.groups}/{cfg.rollout.groups_per_step} groups after "
                                    f"{cfg.loop.fetch_timeout_s:.0f}s; are workers running for precisions "
                                    f"{cfg.rollout.precisions}? (`rollmarket worker --precision P`)")
            batch = self.client.fetch(tier=Tier.fresh, policy_version=version if sync else None,
                                      limit=cfg.rollout.groups_per_step - out.groups, include_served=include_served)
            ours = [f for f in batch.groups if f.group.job_id.startswith(self.run_id)]
            for fetched in ours:
                self._judge(fetched, step, out)
            if not ours:
                time.sleep(0.2)
        return out

    # -- the run ------------------------------------------------------------------------------------

    def run(self) -> Path:
        from .learner import Learner, read_state

        cfg = self.config
        run_dir = self._run_dir()
        self.run_dir = run_dir
        self.run_id = run_dir.name
        checkpoints = run_dir / "checkpoints"
        resume_ckpt = latest_checkpoint(run_dir) if self.resume is not None else None
        state = read_state(resume_ckpt) if resume_ckpt else {}
        self.gate = cfg.gate
        if cfg.loop.mode == "async":  # groups older than max_staleness go to replay, by the gate's own rule
            self.gate = cfg.gate.model_copy(update={"replay_lag": min(cfg.gate.replay_lag, cfg.loop.max_staleness)})
        self.train_tasks = load_suite(cfg.rollout.suite, "train")
        random.Random(cfg.rollout.seed).shuffle(self.train_tasks)
        eval_tasks = load_suite(cfg.rollout.suite, "heldout")[:cfg.eval.tasks]
        self.timing: Counter = Counter()
        self.enqueued: set[int] = set()
        self.first_fetch = resume_ckpt is not None
        self.write_generations = False
        with ExitStack() as stack:
            self.on_event("setup", {"run_dir": str(run_dir), "local": self.local})
            self.client = self._client(stack, run_dir)
            self.trackers = self._trackers(stack, run_dir)
            self.learner = Learner(cfg, resume_from=resume_ckpt)
            published = self.client.pool().published_version
            if resume_ckpt is None:
                self.base_version = 0 if published is None else published + 1
                version = self.base_version
                digest = checkpoint_digest(cfg.model.path)
                self.client.publish_policy(self._manifest(version, Path(cfg.model.path), digest), quorum=cfg.loop.quorum)
                step0, seen, solved, history = 1, 0, 0, {}
            else:
                self.base_version = state["base_version"]
                version = state["version"]
                if published is None or published < version:  # crashed between saving and publishing
                    self.client.publish_policy(self._manifest(version, resume_ckpt, checkpoint_digest(resume_ckpt)),
                                               quorum=cfg.loop.quorum)
                elif published > version:
                    raise TrainingError(f"the exchange has version {published} published, newer than this run's "
                                        f"last checkpoint v{version}: another trainer is using it")
                step0, seen, solved, history = state["step"] + 1, state["seen"], state["solved"], state["history"]
                self._restore_metrics(run_dir, state)
            self.on_event("quorum", {"version": version})
            self.client.wait_for_quorum(version, timeout=cfg.loop.quorum_timeout_s)
            evaluate = self._evaluator(eval_tasks)
            if resume_ckpt is None and eval_tasks:
                self.on_event("eval", {"step": 0})
                history["before"] = evaluate(0)
                with (run_dir / "metrics.jsonl").open("a") as log:
                    log.write(json.dumps({"step": 0, "policy_version": version, **history["before"]}) + "\n")
                for tracker in self.trackers:
                    tracker.log(history["before"], step=0)
            started = time.perf_counter()
            for step in range(step0, cfg.loop.steps + 1):
                self.write_generations = bool(cfg.logging.generations_every) and step % cfg.logging.generations_every == 0
                t_step = time.perf_counter()
                self.timing = Counter()
                self._enqueue(step, version)
                if cfg.loop.mode == "async":
                    self._enqueue(step + 1, version)  # keep workers busy while this step trains
                t0 = time.perf_counter()
                groups = self._collect(step, version)
                gen_s = time.perf_counter() - t0 - self.timing["score"]
                t0 = time.perf_counter()
                metrics = (self.learner.step(groups.data, cfg.rollout.temperature) if groups.data
                           else {**NO_UPDATE, **self.learner.sepa.metrics(self.learner.steps_done)})
                update_s = time.perf_counter() - t0
                seen += len(groups.rewards)
                solved += sum(r >= CORRECT_REWARD for r in groups.rewards)
                correct_rate = sum(r >= CORRECT_REWARD for r in groups.rewards) / max(1, len(groups.rewards))
                self.learner.sepa.observe_correct_rate(correct_rate)

                t0 = time.perf_counter()
                previous, version = version, version + 1
                row = self._row(step, previous, groups, metrics, correct_rate, seen, solved)
                row.update({"timing_s/gen": gen_s, "timing_s/score": self.timing["score"], "timing_s/update": update_s})
                target = checkpoints / f"v{version:04d}"
                digest = self.learner.save(target, version=version, save_optimizer=cfg.loop.save_optimizer, extra_state={
                    "step": step, "seen": seen, "solved": solved, "history": history, "row": row,
                    "base_version": self.base_version})
                row["timing_s/save"] = time.perf_counter() - t0
                t0 = time.perf_counter()
                self.client.publish_policy(self._manifest(version, target, digest), quorum=cfg.loop.quorum)
                self._prune(checkpoints, version)
                if cfg.loop.mode == "sync":
                    try:
                        pool = self.client.wait_for_quorum(version, timeout=cfg.loop.quorum_timeout_s)
                    except ExchangeError as exc:
                        raise TrainingError(f"step {step}: {exc}") from None
                    row["reload_quorum"] = f"{pool.acks}/{pool.quorum}"
                row["timing_s/publish"] = time.perf_counter() - t0
                if eval_tasks and ((cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.loop.steps):
                    t0 = time.perf_counter()
                    self.on_event("eval", {"step": step})
                    history["last"] = evaluate(step)
                    row.update(history["last"])
                    row["timing_s/eval"] = time.perf_counter() - t0
                row["timing_s/step"] = time.perf_counter() - t_step
                row["perf/throughput"] = groups.tokens_used / row["timing_s/step"] if row["timing_s/step"] else 0.0
                row["perf/total_num_tokens"] = sum(groups.lengths)
                self._write(run_dir, row, groups.generations)
                self.on_step(row)
            minutes = (time.perf_counter() - started) / 60
        summary = {
            "run_dir": str(run_dir), "steps": cfg.loop.steps, "final_version": version,
            "eval_before": history.get("before"), "eval_after": history.get("last"),
            "minutes": round(minutes, 2), "running_correct_rate": solved / seen if seen else None,
        }
        write_json(run_dir / "summary.json", summary)
        return run_dir

    def _evaluator(self, eval_tasks):
        from .evaluate import evaluate_policy

        e = self.config.eval

        def evaluate(step: int) -> dict:
            metrics, per_task = evaluate_policy(
                self.learner, eval_tasks, samples=e.samples, temperature=e.temperature,
                max_tokens=self.config.rollout.max_tokens, max_turns=e.max_turns, seed=self.config.rollout.seed)
            with (self.run_dir / "evals.jsonl").open("a") as out:  # per task, for paired statistics
                out.writelines(json.dumps({"step": step, **row}) + "\n" for row in per_task)
            return metrics
        return evaluate

    def _row(self, step, version, g: StepGroups, metrics, correct_rate, seen, solved) -> dict:
        rewards = g.rewards
        row = {
            "step": step, "policy_version": version,
            "correct_rate": correct_rate,
            "running_correct_rate": solved / seen if seen else 0.0,
            "mean_reward": _mean(rewards) or 0.0,
            "num_datums": len(g.data),
            "num_groups": g.groups,
            "reward_tie_group_rate": g.tie_groups / max(1, g.groups),
            "reward_uniform_group_rate": g.uniform_groups / max(1, g.groups),
            "max_token_hit_rate": g.truncated / max(1, len(rewards)),
            "critic/rewards/mean": _mean(rewards) or 0.0,
            "critic/advantages/mean": _mean(g.advantages) or 0.0,
            "critic/advantages/max": max(g.advantages, default=0.0),
            "critic/advantages/min": min(g.advantages, default=0.0),
            "response_length/mean": _mean(g.lengths) or 0.0,
            "response_length/max": max(g.lengths, default=0),
            "response_length/clip_ratio": g.truncated / max(1, len(rewards)),
            "policy_lag/mean": _mean(g.lags) or 0.0,
            **{f"gate/{s.value}": g.decisions.get(s.value, 0) for s in DecisionStatus if s is not DecisionStatus.reject},
            **metrics,
        }
        every = [v for bucket in g.mismatch.values() for v in bucket["token_ess"]]
        row["mismatch/token_ess_mean"] = _mean(every)
        row["mismatch/mean_abs_delta"] = _mean([v for b in g.mismatch.values() for v in b["mean_abs_delta"]])
        row["mismatch/router_flip_rate"] = _mean([v for b in g.mismatch.values() for v in b["router_flip_rate"]])
        for precision, bucket in sorted(g.mismatch.items()):
            row[f"mismatch/{precision}/groups"] = len(bucket["token_ess"])
            for key in ("token_ess", "mean_abs_delta", "kl_k3", "router_flip_rate"):
                row[f"mismatch/{precision}/{key}" + ("_mean" if key == "token_ess" else "")] = _mean(bucket[key])
        return row

    def _trackers(self, stack: ExitStack, run_dir: Path) -> list:
        """Optional mirrors of metrics.jsonl (W&B offline, TensorBoard); the files stay the record."""
        names = list(self.config.logging.trackers)
        if not names:
            return []
        from .trackers import make_trackers

        lg = self.config.logging
        trackers = make_trackers(names, run_dir, run_name=run_dir.name, config=self.config.model_dump(mode="json"),
                                 wandb_project=lg.wandb_project, wandb_mode=lg.wandb_mode)
        for tracker in trackers:
            stack.callback(tracker.close)
        return trackers

    def _write(self, run_dir: Path, row: dict, generations: list[dict]) -> None:
        with (run_dir / "metrics.jsonl").open("a") as log:
            log.write(json.dumps(row) + "\n")
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for tracker in self.trackers:
            tracker.log(numeric, step=row["step"])
        if generations:
            with (run_dir / "generations.jsonl").open("a") as out:
                out.writelines(json.dumps(g) + "\n" for g in generations)

    def _restore_metrics(self, run_dir: Path, state: dict) -> None:
        """A crash after the checkpoint and before its metrics row: write the row from the checkpoint."""
        path = run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        kept = [r for r in rows if r["step"] <= state["step"]]  # rows past the checkpoint are redone
        if not any(r["step"] == state["step"] for r in kept):
            kept.append(state["row"])
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))

    def _prune(self, checkpoints: Path, version: int) -> None:
        for old in checkpoints.glob("v[0-9]*"):
            if int(old.name[1:]) <= version - self.config.loop.keep_checkpoints:
                shutil.rmtree(old, ignore_errors=True)


def train(config: TrainConfig, **kw) -> Path:
    return Trainer(config, **kw).run()


def resume_config(run_dir: Path, overrides: list[str] = ()) -> TrainConfig:
    """The saved config of a run, with overrides (e.g. loop.steps=40 to go further)."""
    saved = json.loads((run_dir / "config.json").read_text())
    return resolve(None, list(overrides), base=saved["config"])
