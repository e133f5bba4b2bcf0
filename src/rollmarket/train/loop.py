"""The closed loop: `rollmarket train CONFIG.toml`, a GRPO-family trainer fed by the exchange.

    publish v ─► enqueue the step's jobs ─► fetch groups ─► teacher-force (π_old) ─► BudgetReport
      ─► gate: train | train_with_correction | replay | quarantine (kept in the step, not yet reported)
      ─► advantages, IS correction where asked ─► optimizer step ─► checkpoint v+1 (+digest, + the step's
         decisions, metrics row and generations) ─► report the decisions + feedback ─► publish v+1
      ─► sync: wait for the reload quorum | async: go on, take groups ≤ max_staleness old
      ─► evaluate (when due) ─► generations.jsonl, then the metrics row

The run directory is the record:

    runs/<UTC timestamp>-<id>/
        config.json        resolved settings (file + overrides + defaults), code version
        start.json         the base policy version this run published first (written before publishing it)
        metrics.jsonl      one row per step (docs/metrics.md, "Training"); a step's row is written last
        generations.jsonl  every trajectory judged: step, prompt, response, reward, tokens, decision
        evals.jsonl        held-out evaluation per task and step (greedy and sampled passes)
        summary.json       held-out accuracy before/after, steps, timings
        checkpoints/vNNNN  the newest checkpoints (safetensors + config + tokenizer; trainer/ holds the
                           optimizer state and counters (state.json) and the step's outbox (step.json):
                           its decisions, metrics row and generations rows)
        exchange.db        --local only: the in-process exchange's database
        workers/           --local only: each worker's events and agent runs

Crash safety. The checkpoint is the step's commit: written to a partial directory, fsynced and
renamed. The exchange learns a step's decisions only after that rename, so a kill -9 anywhere
before it leaves the step's groups undecided at the exchange (served, not consumed): the resumed
trainer fetches them again (`include_served`) and judges them with the same π_old (the previous
checkpoint). A kill after the rename is finished from the checkpoint's outbox: its decisions are
reported in one all-or-nothing request unless the exchange's audit log shows them, the version is
published if it
is not, the quorum is awaited, and the metrics and generations rows are written. Those files are
repaired on resume (torn lines and rows of uncommitted steps dropped), so every step has one
metrics row and every judged trajectory one generations row. `failpoints` kills the process at
each of these points in the tests; docs/training.md, "Crashes and resume", lists what holds where.
"""

from __future__ import annotations

import dataclasses
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

from ..client import Conflict, ExchangeError, TrainerClient
from ..contracts.seeds import task_seed
from ..contracts import (DecisionStatus, GroupDecision, PolicyManifest, RolloutJob, SampleGroup, SamplingConfig, Tier,
                         TaskSpec, Trajectory)
from ..engines.precision import Precision
from ..engines.provenance import checkpoint_digest
from ..engines.teacher import TeacherForced
from ..gate import budget_report, decide
from ..gate.budget import valid_token_mask
from ..observatory.offpolicy import FIGURE_NAMES
from ..runs import atomic_write_text, code_version, new_run_dir, read_step_rows, record_process, write_json
from ..tasks.curriculum import SAVED_CURRICULUM, CurriculumChanged, curriculum_digest, file_digest, read_curriculum
from ..tasks.suites import load_suite
from . import failpoints
from .advantages import compute_advantages
from .batch import Datum
from .config import TrainConfig, TrainConfigError, resolve, validate
from .failpoints import Failpoint
from .reward_shuffle import changed_fraction, shuffle_batch_rewards, shuffle_seed
from .reward_stats import reward_tie_stats

CORRECT_REWARD = 1.0
"""A run counts as correct when its reward reaches this (the verifiers' pass value)."""

NO_UPDATE: dict[str, float | None] = {key: None for key in (
    "loss", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl", "actor/kl_ref",
    "exec_entropy_mean", "exec_entropy_var", "plan_entropy_mean", "plan_entropy_var", "plan_token_fraction",
    "rollout_corr/mean_abs_delta", "rollout_corr/max_abs_delta", "rollout_corr/corrected_fraction",
    *(f"rollout_corr/{key}" for key in (*FIGURE_NAMES, "token_ess")))}
"""A step without a group worth training on (every group tied or was held back) logs null for what
did not happen: there was no update to measure (nor datums for verl's mismatch figures)."""

USABLE = {DecisionStatus.train, DecisionStatus.train_with_correction, DecisionStatus.replay}

TRAINER_LOGPROBS = "_trainer_logprobs"
"""A generations row's in-memory key for the trainer's teacher-forced logprob of each response token
(None where the token is not trained on: tool output); `_write` moves it to token_logprobs.jsonl."""


class TrainingError(RuntimeError):
    """The loop cannot go on (no groups in time, a quorum that never forms, a resume that does not fit)."""


@dataclasses.dataclass
class StepGroups:
    """What one step collected: datums to train on, its decisions, and the numbers about every group it judged."""

    data: list[Datum] = dataclasses.field(default_factory=list)
    decisions: Counter = dataclasses.field(default_factory=Counter)
    outbox: list[GroupDecision] = dataclasses.field(default_factory=list)
    """The step's decisions, reported to the exchange once the step's checkpoint is written."""
    judged: set[str] = dataclasses.field(default_factory=set)
    rewards: list[float] = dataclasses.field(default_factory=list)
    lengths: list[int] = dataclasses.field(default_factory=list)
    truncated: int = 0
    groups: int = 0
    group_rewards: list[list[float]] = dataclasses.field(default_factory=list)
    """Each judged group's rewards (reward_tie_stats)."""
    advantages: list[float] = dataclasses.field(default_factory=list)
    lags: list[int] = dataclasses.field(default_factory=list)
    mismatch: dict = dataclasses.field(default_factory=lambda: defaultdict(lambda: defaultdict(list)))
    generations: list[dict] = dataclasses.field(default_factory=list)
    tokens_used: int = 0
    judged_groups: list["JudgedGroup"] = dataclasses.field(default_factory=list)
    """Every judged group with its scores and decision, until the step's advantages are taken."""
    shuffle_changed: float | None = None
    """reward.shuffle: share of the runs trained with a reward other than their own (None: no shuffle)."""


@dataclasses.dataclass(frozen=True)
class JudgedGroup:
    """One group the gate decided: its trajectories' π_old scores, and whether and how it trains."""

    group: SampleGroup
    runs: list[tuple[Trajectory, TeacherForced]]
    """Each trajectory with the trainer's teacher-forced π_old scores of it, by sample index."""
    status: DecisionStatus
    use: bool
    """Trained on: a usable decision (replay only with loop.replay)."""
    corrected: bool
    """Trained with the IS correction."""
    lag: int
    """The group's policy lag when fetched."""


@dataclasses.dataclass
class StepOutbox:
    """What a committed step still owes the exchange and the run's files (its checkpoint's trainer/step.json)."""

    step: int
    row: dict
    decisions: list[GroupDecision]
    generations: list[dict]
    tokens_used: int

    FILE = "step.json"

    def dumps(self) -> str:
        return json.dumps({"step": self.step, "row": self.row, "tokens_used": self.tokens_used,
                           "decisions": [d.model_dump(mode="json") for d in self.decisions],
                           "generations": self.generations})

    @classmethod
    def read(cls, checkpoint: Path) -> "StepOutbox":
        from .learner import TRAINER_STATE

        data = json.loads((checkpoint / TRAINER_STATE / cls.FILE).read_text())
        return cls(step=data["step"], row=data["row"], tokens_used=data["tokens_used"],
                   decisions=[GroupDecision.model_validate(d) for d in data["decisions"]],
                   generations=data["generations"])


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


def _append_jsonl(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with path.open("a") as out:
        out.writelines(json.dumps(r) + "\n" for r in rows)
        out.flush()
        os.fsync(out.fileno())


def _keep_rows(path: Path, keep: Callable[[dict], bool], key: Callable[[dict], tuple]) -> list[dict]:
    """Rewrite a JSONL file (atomically) with only the rows `keep` accepts, the first of each `key`."""
    rows, clean = read_step_rows(path)
    seen, kept = set(), []
    for row in rows:
        k = key(row)
        if keep(row) and k not in seen:
            seen.add(k)
            kept.append(row)
    if len(kept) != len(rows) or not clean:
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))
    return kept


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
        self.gate = config.gate
        if config.loop.mode == "async":  # groups older than max_staleness go to replay, by the gate's own rule
            self.gate = config.gate.model_copy(
                update={"replay_lag": min(config.gate.replay_lag, config.loop.max_staleness)})
        self.train_tasks = load_suite(config.rollout.suite, "train")
        random.Random(config.rollout.seed).shuffle(self.train_tasks)
        self.curriculum = None
        if config.rollout.curriculum is not None:  # validate() has checked it against the suite
            # Kept by content: the config records the digest, and _run_dir saves the copy a resume uses.
            self.curriculum, self.curriculum_content = read_curriculum(config.rollout.curriculum,
                                                                       config.rollout.curriculum_digest)
            self.config = config = config.model_copy(update={"rollout": config.rollout.model_copy(
                update={"curriculum_digest": curriculum_digest(self.curriculum_content)})})
            self.train_tasks = self.curriculum.select(self.train_tasks)
        self.eval_tasks = load_suite(config.rollout.suite, "heldout")[:config.eval.tasks]
        # Set up by run():
        self.run_dir: Path | None = None
        self.run_id = ""
        self.trainer_id = config.exchange.trainer_id or ""
        self.base_version = 0
        self.client: TrainerClient | None = None
        self.learner = None
        self.trackers: list = []
        self.history: dict[str, dict] = {}
        """Evaluation metrics: "before" (step 0) and "last" (the newest evaluation)."""
        self.timing: Counter = Counter()
        self.enqueued: set[int] = set()
        self.first_fetch = False
        self.write_generations = False

    # -- setup ------------------------------------------------------------------------------------

    def _run_dir(self) -> Path:
        if self.resume is not None:
            if not (self.resume / "config.json").exists():
                raise TrainConfigError(f"{self.resume} is not a training run directory (no config.json)")
            if "config" not in json.loads((self.resume / "config.json").read_text()):
                raise TrainConfigError(f"{self.resume}/config.json is not a training config")
            record_process(self.resume)  # the dashboard tells running from crashed by this process's liveness
            return self.resume
        run_dir = self.given_run_dir or new_run_dir(self.config.runs_root)
        record_process(run_dir)  # a given directory was made by another process (or none)
        if self.curriculum is not None:  # before config.json, which records its digest
            atomic_write_text(run_dir / SAVED_CURRICULUM, self.curriculum_content.decode("utf-8"))
        write_json(run_dir / "config.json", {"config": self.config.model_dump(mode="json"), "local": self.local,
                                             "code": code_version()})
        return run_dir

    def _client(self, stack: ExitStack, run_dir: Path) -> TrainerClient:
        cfg = self.config
        if self.local:
            from .cluster import LocalCluster, arrival_gate

            # This trainer judges every group; the exchange's arrival triage must not hide any from it.
            cluster = stack.enter_context(LocalCluster(
                run_dir, cfg.model.path, cfg.local.specs, max_turns=cfg.agent.max_turns,
                lease_ttl_s=cfg.local.lease_ttl_s, gate=arrival_gate(cfg.loop.steps + 1)))
            url, token = cluster.url, cluster.token
        else:
            url = cfg.exchange.url
            token = self.token or os.environ.get(cfg.exchange.token_env, "")
            if not url:
                raise TrainConfigError("exchange.url is not set: pass exchange.url=http://HOST:PORT or --local")
            if not token:
                raise TrainConfigError(f"set ${cfg.exchange.token_env} to the exchange's trainer token")
        client = TrainerClient(url, token, trainer_id=self.trainer_id, retries=8)
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
            quantization_class=Precision(self.config.rollout.precisions[0]).quantization,
            require_signatures=self.config.exchange.require_signatures)

    def _publish(self, version: int, path: Path, digest: str) -> None:
        """Publish `version`. The exchange takes the same content again as a no-op (a crash after the
        publish reached it); other content under the version, or a newer version already published,
        means another trainer publishes to this exchange: that is refused rather than trained over.
        """
        try:
            pool = self.client.publish_policy(self._manifest(version, path, digest), quorum=self.config.loop.quorum)
        except Conflict as exc:
            raise TrainingError(f"the exchange refused this run's v{version} ({exc.message}): another trainer "
                                f"is using it") from None
        if pool.published_version is not None and pool.published_version > version:
            raise TrainingError(f"the exchange has version {pool.published_version} published, newer than this "
                                f"run's v{version}: another trainer is using it")

    # -- jobs ---------------------------------------------------------------------------------------

    def _job_version(self, step: int) -> int:
        """The policy version a step's jobs carry: the version current when they were first enqueued.

        Sync enqueues step k at its start (version base + k − 1); async enqueues step k one step early.
        A rule rather than the loop's variable, so that a resumed trainer re-enqueues the same jobs.
        """
        lead = 1 if self.config.loop.mode == "async" else 0
        return self.base_version + max(step - 1 - lead, 0)

    def train_task(self, index: int) -> TaskSpec:
        """The `index`-th task the run trains on (over all steps): the shuffled training tasks in turn,
        or the curriculum's pick (rollout.curriculum). A function of the index alone, so a resumed run
        enqueues the same jobs."""
        if self.curriculum is not None:
            return self.curriculum.pick(self.train_tasks, index, self.config.rollout.seed)
        return self.train_tasks[index % len(self.train_tasks)]

    def _jobs(self, step: int) -> list[RolloutJob]:
        r = self.config.rollout
        version = self._job_version(step)
        jobs = []
        for i in range(r.groups_per_step):
            index = (step - 1) * r.groups_per_step + i
            task = self.train_task(index)
            precision = r.precisions[i % len(r.precisions)]
            seed = task_seed(r.sampling, task.task_id, draw=index)
            key = f"{self.run_id}-s{step:05d}-{i:03d}"
            jobs.append(RolloutJob(
                job_id=key, idempotency_key=key, task=task, policy_version=version, group_size=r.group_size,
                sampling_config=SamplingConfig(temperature=r.temperature, max_tokens=r.max_tokens, seed=seed),
                required_precision=precision, required_quantization=Precision(precision).quantization,
                max_context_tokens=self.learner.loaded.info.max_context_tokens,
                requires_routed_experts=self.config.trainer.router_replay))
        return jobs

    def _enqueue(self, step: int) -> None:
        if step <= self.config.loop.steps and step not in self.enqueued:
            self.client.enqueue(self._jobs(step))  # idempotent: a resumed run enqueues the same jobs again
            self.enqueued.add(step)

    # -- one group ----------------------------------------------------------------------------------

    def _replay_input(self, trajectory: Trajectory) -> np.ndarray | None:
        """What router replay routes this trajectory through (trainer.router_replay)."""
        return self.learner.replay_input(trajectory.routed_experts, valid_token_mask(trajectory))

    def _judge(self, fetched, step: int, out: StepGroups) -> None:
        """Teacher-force a group, let the gate decide, and keep the decision in the step's outbox."""
        cfg = self.config
        group = fetched.group
        trajectories = group.trajectories
        t0 = time.perf_counter()
        replay = [self._replay_input(t) for t in trajectories] if cfg.trainer.router_replay else None
        scored = self.learner.score([(t.prompt_token_ids, t.response_token_ids) for t in trajectories],
                                    cfg.rollout.temperature, replayed_experts=replay)
        self.timing["score"] += time.perf_counter() - t0
        experts = [s.routed_experts_TLK for s in scored]
        use_experts = all(e is not None for e in experts) and all(t.routed_experts is not None for t in trajectories)
        report = budget_report(group, [s.logprobs_T for s in scored],
                               trainer_routed_experts=experts if use_experts else None,
                               policy_lag_steps=fetched.current_lag, config=self.gate)
        decision = decide(report, self.gate, decided_by=self.trainer_id)
        out.outbox.append(decision)
        out.judged.add(group.group_id)
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

        use = status in USABLE and (status is not DecisionStatus.replay or cfg.loop.replay)
        corrected = {"always": True, "never": False}.get(
            cfg.correction.when, status in (DecisionStatus.train_with_correction, DecisionStatus.replay))
        for t in trajectories:
            out.rewards.append(t.reward)
            out.lengths.append(t.num_response_tokens)
            out.truncated += int(t.finish_reason.value == "length")
        runs = sorted(zip(trajectories, scored), key=lambda pair: pair[0].sample_index)
        out.judged_groups.append(JudgedGroup(group, runs, status, use, corrected, fetched.current_lag))

    def _train_data(self, step: int, out: StepGroups) -> None:
        """The step's advantages, datums and generations rows, once every group is judged.

        Advantages wait for the whole batch because the shuffled-reward control (reward.shuffle)
        permutes rewards across the step's groups; groups go in job-id order and each group's runs
        by sample index, so the permutation does not depend on the order the groups arrived in."""
        cfg = self.config
        judged = sorted(out.judged_groups, key=lambda j: j.group.job_id)
        own = [[t.reward for t, _ in j.runs] for j in judged]
        trained = shuffle_batch_rewards(own, mode=cfg.reward.shuffle,
                                        seed=shuffle_seed(cfg.rollout.sampling, step))
        if cfg.reward.shuffle != "none":
            out.shuffle_changed = changed_fraction(own, trained)
        tok = self.learner.loaded.tokenizer
        for j, rewards in zip(judged, trained):
            group = j.group
            advantages_G = compute_advantages(torch.tensor(rewards, dtype=torch.float32), cfg.algorithm.advantage)
            out.group_rewards.append(rewards)
            for (t, s), reward, adv in zip(j.runs, rewards, advantages_G.tolist()):
                mask_T = valid_token_mask(t)
                if self.write_generations:
                    delta_T = np.asarray(s.logprobs_T, dtype=np.float64) - np.asarray(t.logprobs, dtype=np.float64)
                    out.generations.append({
                        "step": step, "group_id": group.group_id, "task_id": group.task_id,
                        "sample_index": t.sample_index, "policy_version": group.policy_version,
                        "policy_lag": j.lag, "worker_id": group.worker_id,
                        "precision": group.precision_class, "decision": j.status.value,
                        "used": j.use and adv != 0.0, "reward": t.reward, "trained_reward": reward,
                        "advantage": adv, "tokens": t.num_response_tokens,
                        # the gate's clipped_fraction counts these: valid tokens with |Δ| past its clamp
                        "clipped_tokens": int((np.abs(delta_T[mask_T]) > self.gate.clamp).sum()),
                        "prompt": tok.decode(t.prompt_token_ids), "response": tok.decode(t.response_token_ids)})
                    if cfg.logging.token_logprobs:  # written to token_logprobs.jsonl beside this row (_write)
                        out.generations[-1][TRAINER_LOGPROBS] = [
                            round(float(x), 5) if ok else None for x, ok in zip(s.logprobs_T, mask_T)]
                if not j.use or adv == 0.0:
                    continue  # a run that ties its group carries no policy-gradient signal
                if not mask_T.any():
                    continue
                out.data.append(Datum(t.prompt_token_ids, t.response_token_ids, t.logprobs,
                                      mask_T.astype(np.float32), advantage=adv, corrected=j.corrected,
                                      old_logprobs_T=s.logprobs_T,
                                      routed_experts_TLK=self._replay_input(t) if cfg.trainer.router_replay else None))
                out.advantages.append(adv)
                out.tokens_used += int(mask_T.sum())

    def _collect(self, step: int, version: int) -> StepGroups:
        cfg = self.config
        out = StepGroups()
        deadline = time.monotonic() + cfg.loop.fetch_timeout_s
        sync = cfg.loop.mode == "sync"
        # After a resume, groups the killed process fetched but never decided are still marked served to
        # this trainer: the first fetch asks for them too.
        include_served = self.first_fetch
        self.first_fetch = False
        failpoints.reach(Failpoint.before_fetch)
        while out.groups < cfg.rollout.groups_per_step:
            if time.monotonic() > deadline:
                raise TrainingError(f"step {step}: {out.groups}/{cfg.rollout.groups_per_step} groups after "
                                    f"{cfg.loop.fetch_timeout_s:.0f}s; are workers running for precisions "
                                    f"{cfg.rollout.precisions}? (`rollmarket worker --precision P`)")
            batch = self.client.fetch(tier=Tier.fresh, policy_version=version if sync else None,
                                      limit=cfg.rollout.groups_per_step - out.groups, include_served=include_served)
            include_served = False
            # Undecided groups are redelivered after the exchange's redeliver_after_s: one judged in
            # this step (its decision waits for the checkpoint) may come again.
            ours = [f for f in batch.groups
                    if f.group.job_id.startswith(self.run_id) and f.group.group_id not in out.judged]
            for fetched in ours[:cfg.rollout.groups_per_step - out.groups]:
                self._judge(fetched, step, out)
                if out.groups == 1 and cfg.rollout.groups_per_step > 1:
                    failpoints.reach(Failpoint.between_decisions)
            if not ours:
                time.sleep(0.2)
        self._train_data(step, out)
        return out

    # -- after the checkpoint -----------------------------------------------------------------------

    def _decided(self, group_id: str) -> bool:
        """Whether the exchange recorded this trainer's decision on the group (its audit log)."""
        page = self.client.audit(kind="group.decided", subject=group_id, limit=50)
        return any(e.actor == self.trainer_id for e in page.events)

    def _report(self, decisions: list[GroupDecision], *, resumed: bool) -> None:
        """Report a committed step's decisions (and feedback on their workers) in one request, which
        the exchange records all or none; after a resume, only when it lacks them: the batch is
        atomic, so its first group's record answers for every group."""
        failpoints.reach(Failpoint.before_reports)
        if not decisions or (resumed and self._decided(decisions[0].group_id)):
            return
        self.client.report_many((d.group_id, d, True) for d in decisions)

    def _finish(self, outbox: StepOutbox, version: int, checkpoint: Path, *, resumed: bool = False) -> None:
        """Everything after a step's checkpoint: report, publish, quorum, evaluation, the step's rows.

        Idempotent, so that a resumed trainer runs it again for a checkpoint whose metrics row is missing.
        """
        cfg = self.config
        step, row = outbox.step, dict(outbox.row)
        t0 = time.perf_counter()
        self._report(outbox.decisions, resumed=resumed)
        failpoints.reach(Failpoint.after_checkpoint_before_publish)
        self._publish(version, checkpoint, checkpoint_digest(checkpoint))
        if cfg.loop.mode == "sync":
            failpoints.reach(Failpoint.waiting_for_quorum)
            self.on_event("quorum", {"version": version})
            try:
                pool = self.client.wait_for_quorum(version, timeout=cfg.loop.quorum_timeout_s)
            except ExchangeError as exc:
                raise TrainingError(f"step {step}: {exc}") from None
            row["reload_quorum"] = f"{pool.acks}/{pool.quorum}"
        row["timing_s/publish"] = time.perf_counter() - t0
        if self.eval_tasks and ((cfg.eval.every and step % cfg.eval.every == 0) or step == cfg.loop.steps):
            t1 = time.perf_counter()
            self.on_event("eval", {"step": step})
            self.history["last"] = self._evaluate(step, checkpoint)
            row.update(self.history["last"])
            row["timing_s/eval"] = time.perf_counter() - t1
        # The step's time is its work before the checkpoint (saved in the row) plus this tail.
        row["timing_s/step"] = row.get("timing_s/step", 0.0) + time.perf_counter() - t0
        row["perf/throughput"] = outbox.tokens_used / row["timing_s/step"] if row["timing_s/step"] else 0.0
        self._write(row, outbox.generations)
        self._prune(version)
        self.on_step(row)

    # -- the run ------------------------------------------------------------------------------------

    def run(self) -> Path:
        from .learner import read_state
        from .ranks import learner_ranks

        cfg = self.config
        validate(cfg, local=self.local, token=self.token)  # before the run directory exists
        failpoints.arm_from_environment()
        run_dir = self.run_dir = self._run_dir()
        self.run_id = run_dir.name
        # One trainer id per run: served-ness is per trainer id, so two runs sharing one would hide
        # each other's groups; a resumed run derives the same id from its directory.
        self.trainer_id = cfg.exchange.trainer_id or f"trainer-{self.run_id}"
        resumed = self.resume is not None
        checkpoint = None
        if resumed:
            for partial in (run_dir / "checkpoints").glob(".v*.partial"):  # a checkpoint the crash cut short
                shutil.rmtree(partial, ignore_errors=True)
            checkpoint = latest_checkpoint(run_dir)
        state = read_state(checkpoint) if checkpoint else {}
        # The newest step whose checkpoint exists (0: none) and whether its rows were written.
        written = self._repair_files(state.get("step", 0)) if resumed else False
        self.first_fetch = resumed
        with ExitStack() as stack:
            self.on_event("setup", {"run_dir": str(run_dir), "local": self.local})
            self.client = self._client(stack, run_dir)
            self.trackers = self._trackers(stack, run_dir)
            self.learner = stack.enter_context(learner_ranks(cfg, resume_from=checkpoint))
            if checkpoint is None:
                version, step0, seen, solved = self._start(resumed, evaluated=written), 1, 0, 0
            else:
                self.base_version, version = state["base_version"], state["version"]
                step0, seen, solved = state["step"] + 1, state["seen"], state["solved"]
                if not written:  # the crash came after the checkpoint: finish that step
                    failpoints.enter_step(state["step"])
                    self._finish(StepOutbox.read(checkpoint), version, checkpoint, resumed=True)
                elif cfg.loop.mode == "sync":
                    self.on_event("quorum", {"version": version})
                    self.client.wait_for_quorum(version, timeout=cfg.loop.quorum_timeout_s)
            started = time.perf_counter()
            for step in range(step0, cfg.loop.steps + 1):
                failpoints.enter_step(step)
                self.write_generations = bool(cfg.logging.generations_every) and step % cfg.logging.generations_every == 0
                t_step = time.perf_counter()
                self.timing = Counter()
                self._enqueue(step)
                if cfg.loop.mode == "async":
                    self._enqueue(step + 1)  # keep workers busy while this step trains
                t0 = time.perf_counter()
                groups = self._collect(step, version)
                gen_s = time.perf_counter() - t0 - self.timing["score"]
                t0 = time.perf_counter()
                metrics = (self.learner.step(groups.data, cfg.rollout.temperature) if groups.data
                           else {**NO_UPDATE, **self.learner.sepa_metrics()})
                update_s = time.perf_counter() - t0
                seen += len(groups.rewards)
                solved += sum(r >= CORRECT_REWARD for r in groups.rewards)
                correct_rate = sum(r >= CORRECT_REWARD for r in groups.rewards) / max(1, len(groups.rewards))
                self.learner.sepa.observe_correct_rate(correct_rate)

                t0 = time.perf_counter()
                previous, version = version, version + 1
                row = self._row(step, previous, groups, metrics, correct_rate, seen, solved)
                row.update({"timing_s/gen": gen_s, "timing_s/score": self.timing["score"], "timing_s/update": update_s,
                            "perf/total_num_tokens": sum(groups.lengths)})
                row["timing_s/step"] = time.perf_counter() - t_step
                outbox = StepOutbox(step=step, row=row, decisions=groups.outbox, generations=groups.generations,
                                    tokens_used=groups.tokens_used)
                target = run_dir / "checkpoints" / f"v{version:04d}"
                self.learner.save(target, version=version, save_optimizer=cfg.loop.save_optimizer,
                                  extra_state={"step": step, "seen": seen, "solved": solved,
                                               "base_version": self.base_version},
                                  extra_files={StepOutbox.FILE: outbox.dumps()})
                outbox.row["timing_s/save"] = time.perf_counter() - t0
                outbox.row["timing_s/step"] += outbox.row["timing_s/save"]
                self._finish(outbox, version, target)
            minutes = (time.perf_counter() - started) / 60
        summary = {
            "run_dir": str(run_dir), "steps": cfg.loop.steps, "final_version": version,
            "eval_before": self.history.get("before"), "eval_after": self.history.get("last"),
            "minutes": round(minutes, 2), "running_correct_rate": solved / seen if seen else None,
            "trackers": [t.where() for t in self.trackers],
            **self._labels(),
        }
        write_json(run_dir / "summary.json", summary)
        return run_dir

    def _start(self, resumed: bool, *, evaluated: bool) -> int:
        """Publish the base policy (once, whatever crashes), wait for its quorum, evaluate it as step 0."""
        cfg = self.config
        start = self.run_dir / "start.json"
        if resumed and start.exists():
            self.base_version = json.loads(start.read_text())["base_version"]
        else:  # written before publishing, so that a resumed run knows which version it published
            published = self.client.pool().published_version
            self.base_version = 0 if published is None else published + 1
            write_json(start, {"base_version": self.base_version, "trainer_id": self.trainer_id})
        self._publish(self.base_version, Path(cfg.model.path), checkpoint_digest(cfg.model.path))
        self.on_event("quorum", {"version": self.base_version})
        try:
            self.client.wait_for_quorum(self.base_version, timeout=cfg.loop.quorum_timeout_s)
        except ExchangeError as exc:
            raise TrainingError(f"the base policy v{self.base_version}: {exc}") from None
        if self.eval_tasks and not evaluated:
            self.on_event("eval", {"step": 0})
            t0 = time.perf_counter()
            self.history["before"] = self._evaluate(0, Path(cfg.model.path))
            self.on_event("evaluated", {"step": 0, "seconds": time.perf_counter() - t0})
            self._write({"step": 0, "policy_version": self.base_version, **self.history["before"]}, [])
        return self.base_version

    def _evaluate(self, step: int, weights: Path) -> dict:
        """Held-out evaluation of the current weights (those `weights` holds): its eval/* metrics; one
        evals.jsonl row per task."""
        from .evaluate import evaluate_policy

        e = self.config.eval
        metrics, per_task = evaluate_policy(
            self.learner.evaluation_policy(weights), self.eval_tasks, samples=e.samples, temperature=e.temperature,
            max_tokens=self.config.rollout.max_tokens, max_turns=e.max_turns, seed=self.config.rollout.sampling)
        _append_jsonl(self.run_dir / "evals.jsonl", [{"step": step, **row} for row in per_task])  # paired statistics
        return metrics

    def _row(self, step, version, g: StepGroups, metrics, correct_rate, seen, solved) -> dict:
        rewards = g.rewards
        row = {
            "step": step, "policy_version": version,
            "correct_rate": correct_rate,
            "running_correct_rate": solved / seen if seen else 0.0,
            "mean_reward": _mean(rewards) or 0.0,
            "num_datums": len(g.data),
            "num_groups": g.groups,
            **reward_tie_stats(g.group_rewards),
            "reward_shuffle/changed_fraction": g.shuffle_changed,
            "max_token_hit_rate": g.truncated / max(1, len(rewards)),
            "critic/rewards/mean": _mean(rewards) or 0.0,
            "critic/advantages/mean": _mean(g.advantages),  # null when no datum: nothing was trained on
            "critic/advantages/max": max(g.advantages, default=None),
            "critic/advantages/min": min(g.advantages, default=None),
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
        """Mirrors of metrics.jsonl and the rollouts (W&B offline, TensorBoard); the files stay the record.
        Unless logging.trackers names them, every installed tracker mirrors the run."""
        from .trackers import installed_trackers, make_trackers

        lg = self.config.logging
        names = installed_trackers(lg.wandb_mode) if lg.trackers is None else list(lg.trackers)
        if not names:
            return []
        trackers = make_trackers(names, run_dir, run_name=run_dir.name, config=self.config.model_dump(mode="json"),
                                 wandb_project=lg.wandb_project, wandb_mode=lg.wandb_mode)
        for tracker in trackers:
            stack.callback(tracker.close)
        return trackers

    def _labels(self) -> dict:
        """`condition` and `seed` (labels.*, None outside a campaign): every metrics row and the summary carry them."""
        return self.config.labels.model_dump()

    def _write(self, row: dict, generations: list[dict]) -> None:
        """A step's rows: generations (and their token logprobs) first, the metrics row last (it marks
        the step as written)."""
        tokens = [{"step": g["step"], "group_id": g["group_id"], "sample_index": g["sample_index"],
                   "trainer_logprobs": g[TRAINER_LOGPROBS]} for g in generations if TRAINER_LOGPROBS in g]
        generations = [{k: v for k, v in g.items() if k != TRAINER_LOGPROBS} for g in generations]
        if tokens:
            _append_jsonl(self.run_dir / "token_logprobs.jsonl", tokens)
        _append_jsonl(self.run_dir / "generations.jsonl", generations)
        labels = self._labels()
        _append_jsonl(self.run_dir / "metrics.jsonl", [{**row, **labels}])
        numeric = {k: v for k, v in row.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in labels}
        for tracker in self.trackers:
            tracker.log_rollouts(generations, step=row["step"])
            tracker.log(numeric, step=row["step"])

    def _repair_files(self, step: int) -> bool:
        """Make the run's files agree with its newest checkpoint (at `step`; 0: none) after a crash.

        Returns whether `step`'s metrics row exists (the step's rows were all written). Rows of steps
        without a metrics row are dropped from every file, since that step is finished (or redone)
        again, and so are rows a crash tore and duplicates; the evaluation history comes back from
        the metrics rows.
        """
        metrics = _keep_rows(self.run_dir / "metrics.jsonl", lambda r: r["step"] <= step, lambda r: (r["step"],))
        written = {r["step"] for r in metrics}
        for name in ("generations.jsonl", "token_logprobs.jsonl"):  # row i of one is row i of the other
            _keep_rows(self.run_dir / name, lambda r: r["step"] in written,
                       lambda r: (r["step"], r.get("group_id"), r.get("sample_index")))
        _keep_rows(self.run_dir / "evals.jsonl", lambda r: r["step"] in written, lambda r: (r["step"], r.get("task_id")))
        for row in metrics:
            evaluated = {k: v for k, v in row.items() if k.startswith("eval/")}
            if evaluated:
                self.history["before" if row["step"] == 0 else "last"] = evaluated
        return step in written

    def _prune(self, version: int) -> None:
        for old in (self.run_dir / "checkpoints").glob("v[0-9]*"):
            if int(old.name[1:]) <= version - self.config.loop.keep_checkpoints:
                shutil.rmtree(old, ignore_errors=True)


def train(config: TrainConfig, **kw) -> Path:
    return Trainer(config, **kw).run()


def resume_config(run_dir: Path, overrides: list[str] = ()) -> tuple[TrainConfig, list[CurriculumChanged]]:
    """The saved config of a run, with overrides (e.g. loop.steps=40 to go further), and warnings.

    A run that saved its curriculum goes on with that copy, whatever rollout.curriculum names now:
    its task picks are a function of the step alone, and a curriculum rebuilt for the next run
    must not change this one's. A named file with other content (or none) is a CurriculumChanged
    warning, not an error: the run is still exactly what it was, and a crashed run stays resumable."""
    saved = json.loads((run_dir / "config.json").read_text())
    config = resolve(None, list(overrides), base=saved["config"])
    copy = run_dir / SAVED_CURRICULUM
    if not copy.is_file():
        return config, []
    began = saved["config"]["rollout"].get("curriculum_digest")
    named = config.rollout.curriculum
    found = None if named is None else file_digest(named)
    warnings = [] if found is not None and found == began else [
        CurriculumChanged(path=named, saved=str(copy), digest=began, found=found)]
    return config.model_copy(update={"rollout": config.rollout.model_copy(
        update={"curriculum": str(copy), "curriculum_digest": began})}), warnings
