"""`rollmarket demo paths`: the exchange, real and simulated workers and the real trainer, as real processes.

The orchestrator starts `rollmarket exchange serve` on a free loopback port with its database in
the run directory; real workers (`rollmarket worker` on the shipped tiny MoE model at several
precision profiles, running the agent on a task suite with tools and verifiers); one process per
simulated worker profile (honest and faulty, all offering fp16: sim/worker.py); and `rollmarket
train` itself (train/loop.py, async) on the same model, whose jobs go round robin over the real
workers' precisions and the simulated workers' fp16. The trainer teacher-forces every group it
fetches, its gate decides, it trains and publishes each version's checkpoint; the simulated workers
load the checkpoints they ack and take their logprobs from them (sim/policy.py), then spoil them
as their profile says. Before the trainer's jobs, the demo enqueues one task on every real
precision with the same seed, so that the observatory compares the precisions' runs of it. The
demo follows the audit log until every path has fired, every real worker has delivered and the
trainer has made `min_steps` steps; stops everything; and writes the run directory:

    runs/<UTC timestamp>-<id>/
        demo.json        demo and exchange settings, code version
        config.json      the trainer's resolved settings (`rollmarket train`'s run directory)
        summary.json     paths fired, per-worker outcomes, decisions, rejections
        metrics.jsonl    one line per trainer step (and generations.jsonl, token_logprobs.jsonl)
        audit.jsonl      the exchange's audit log
        exchange.db      the exchange's SQLite database
        workers/*.jsonl  what each worker saw (real workers: also *.rollouts.jsonl, every agent run)
        checkpoints/     the trainer's newest checkpoints
        logs/*.log       process output
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..client import ExchangeError, TrainerClient
from ..contracts import RolloutJob, SamplingConfig
from ..localhost import free_port, wait_healthy
from ..runs import code_version, new_run_dir, read_step_rows, write_json
from .profiles import DESCRIPTIONS, Profile
from .worker import PRECISION as SIM_PRECISION

PATHS = {
    "train": "a group the gate passed as on-policy",
    "train_with_correction": "a group used with importance-sampling correction",
    "replay": "a group held in the replay tier",
    "quarantine": "a group held for inspection",
    "reject": "a submission refused at the door",
    "lease_expiry": "a lease that ran out and was re-queued",
    "worker_abandonment": "a dead worker's lease abandoned and re-queued",
    "reload_quorum": "a policy version activated by its k-of-n reload quorum",
}

DEFAULT_WORKERS = (
    ("honest-a", Profile.honest, 1.0), ("honest-b", Profile.honest, 1.5), ("noisy", Profile.noisy, 0.8),
    ("stale", Profile.stale, 1.0), ("toxic-tokenizer", Profile.toxic_tokenizer, 0.5),
    ("toxic-precision", Profile.toxic_precision, 0.6), ("no-logprobs", Profile.no_logprobs, 0.7),
    ("version-drift", Profile.version_drift, 0.9), ("crashing", Profile.crashing, 1.0),
)


DEFAULT_REAL_WORKERS = (("tiny-moe-fp32", "fp32"), ("tiny-moe-bf16", "bf16"), ("tiny-moe-fp8", "fp8"))


@dataclass
class DemoConfig:
    """Settings of one demo run (saved as config.json)."""

    steps: int = 12
    min_steps: int = 6
    timeout_s: float = 240.0
    seed: int = 0
    sim_jobs_per_step: int = 6
    """Jobs per trainer step for the simulated workers (fp16); each real precision gets one."""
    group_size: int = 4
    lr: float = 1e-7
    """The trainer's learning rate: small enough that the weights' drift over a few versions stays
    below the precision mismatch the engines table compares (bf16 and fp8 move a token's logprob by
    about 1e-4 nat on the tiny MoE); the demo is about the paths, `rollmarket demo` about learning."""
    clamp: float = 0.1
    """The gate's clamp in nats, as `rollmarket demo`'s: the default 20 never fires on a tiny model."""
    max_clipped_fraction: float = 0.065
    max_policy_lag: int = 4
    lease_ttl_s: float = 6.0
    heartbeat_ttl_s: float = 2.5
    reaper_interval_s: float = 0.25
    preference_hold_s: float = 0.5
    max_attempts: int = 32
    """Leases of one job before it fails for good: the faulty profiles refuse or lose many, and every job
    the trainer enqueued is one its step waits for."""
    model: str = "models/tiny-moe"
    """The model `rollmarket train` trains; real workers sample it, simulated ones score with it."""
    workers: list = field(default_factory=lambda: [list(w) for w in DEFAULT_WORKERS])
    real_workers: list = field(default_factory=lambda: [list(w) for w in DEFAULT_REAL_WORKERS])
    """[worker id, precision profile] of each real worker."""
    suite: str = "arithmetic"
    """Task suite (train split) of the real workers' jobs."""
    observe_tasks: int = 1
    """Tasks the demo enqueues once on every real precision, same seed, for the observatory to compare."""
    agent_max_steps: int = 4
    observe_trainers: list = field(default_factory=lambda: ["fp32", "bf16"])
    """Trainer engines the observatory teacher-forces the real workers' runs on at the end."""
    observe_lengths: list = field(default_factory=lambda: [64, 256])
    """Length probes of the observatory (responses sampled to exactly these lengths)."""
    observe_length_n: int = 8


class ChildProcesses:
    """Child processes with their output in log files; the token travels in the environment."""

    def __init__(self, env: dict[str, str]) -> None:
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list = []
        self._env = {**os.environ, "PYTHONUNBUFFERED": "1", **env}

    def start(self, name: str, cmd: list[str], log: Path) -> subprocess.Popen:
        handle = open(log, "ab")
        self._logs.append(handle)
        proc = subprocess.Popen(cmd, stdout=handle, stderr=subprocess.STDOUT, env=self._env)
        self.procs[name] = proc
        return proc

    def stop(self, names: list[str] | None = None, timeout: float = 10.0) -> None:
        chosen = [n for n in (names or list(self.procs)) if self.procs[n].poll() is None]
        for name in chosen:
            self.procs[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for name in chosen:
            try:
                self.procs[name].wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.procs[name].kill()
                self.procs[name].wait()

    def close(self) -> None:
        self.stop()
        for handle in self._logs:
            handle.close()


class _AuditFollower:
    """Reads the audit log incrementally and keeps the counts the demo reports."""

    def __init__(self, trainer: TrainerClient, sink: Path):
        self.trainer = trainer
        self.since = 0
        self.sink = open(sink, "a")
        self.kinds: Counter = Counter()
        self.decisions: Counter = Counter()
        self.rejections: Counter = Counter()
        self.activations: list[int] = []
        self.group_worker: dict[str, str] = {}
        self.per_worker: dict[str, Counter] = defaultdict(Counter)
        self.arrival_tiers: Counter = Counter()

    def poll(self) -> None:
        while True:
            page = self.trainer.audit(since_seq=self.since, limit=2000)
            for event in page.events:
                self._take(event)
                self.sink.write(event.model_dump_json() + "\n")
            self.since = page.next_seq
            if len(page.events) < 2000:
                break
        self.sink.flush()

    def _take(self, event) -> None:
        kind, data = event.kind, event.data
        self.kinds[kind] += 1
        if kind == "lease.issued":
            self.per_worker[data["worker_id"]]["leases"] += 1
        elif kind == "group.accepted":
            self.group_worker[event.subject] = event.actor
            self.per_worker[event.actor]["accepted"] += 1
            self.arrival_tiers[data["tier"]] += 1
            self.per_worker[event.actor][f"arrival:{data['tier']}"] += 1
        elif kind == "submission.rejected":
            self.per_worker[event.actor]["rejected"] += 1
            for reason in data["reasons"]:
                self.rejections[reason] += 1
                self.per_worker[event.actor][f"reason:{reason}"] += 1
        elif kind == "group.decided":
            self.decisions[data["status"]] += 1
            worker = self.group_worker.get(event.subject)
            if worker:
                self.per_worker[worker][f"decision:{data['status']}"] += 1
        elif kind in ("lease.expired", "lease.abandoned"):
            self.per_worker[data["worker_id"]][kind.split(".")[1]] += 1
        elif kind == "policy.activated":
            self.activations.append(data["version"])
        elif kind == "reload.violation":
            self.per_worker[data["worker_id"]]["reload_violations"] += 1

    def paths(self) -> dict[str, int]:
        return {
            "train": self.decisions["train"],
            "train_with_correction": self.decisions["train_with_correction"],
            "replay": self.decisions["replay"] + self.arrival_tiers["replay"],
            "quarantine": self.decisions["quarantine"] + self.arrival_tiers["quarantine"],
            "reject": self.kinds["submission.rejected"],
            "lease_expiry": self.kinds["lease.expired"],
            "worker_abandonment": self.kinds["lease.abandoned"],
            "reload_quorum": len(self.activations),
        }


def trainer_overrides(config: DemoConfig, model: Path, url: str) -> list[str]:
    """The `rollmarket train` settings of the demo's trainer: async (it takes groups of any version and
    its gate sorts them by lag: one version old already goes to replay, past `max_policy_lag` to
    quarantine), the real precisions and the simulated workers' fp16 round robin over
    a step's jobs, no evaluation and no trackers (the demo is about the paths)."""
    precisions = [p for _, p in config.real_workers] + [SIM_PRECISION] * (config.sim_jobs_per_step if config.workers else 0)
    return [
        f"model.path='{model}'", f"rollout.suite='{config.suite}'", f"rollout.precisions={precisions!r}",
        f"rollout.groups_per_step={len(precisions)}", f"rollout.group_size={config.group_size}",
        f"agent.max_turns={config.agent_max_steps}", f"optim.lr={config.lr}", f"loop.steps={config.steps}",
        "loop.mode='async'", "loop.max_staleness=0", f"loop.fetch_timeout_s={config.timeout_s}", f"loop.quorum_timeout_s={config.timeout_s}",
        f"gate.clamp={config.clamp}", f"gate.max_clipped_fraction={config.max_clipped_fraction}",
        f"gate.max_policy_lag={config.max_policy_lag}", "eval.tasks=0", "logging.trackers=[]",
        f"exchange.url='{url}'", "exchange.wait_s=60"]


def observatory_jobs(config: DemoConfig) -> list[RolloutJob]:
    """`observe_tasks` suite tasks on every real precision, with the same seed: the observatory compares
    the precisions' runs of the same task (its divergence report)."""
    from ..engines.precision import Precision
    from ..tasks.suites import load_suite

    tasks = load_suite(config.suite, "train")[:config.observe_tasks]
    return [RolloutJob(
        job_id=f"observe-{task.task_id}-{precision}", idempotency_key=f"observe-{task.task_id}-{precision}",
        task=task, policy_version=0, group_size=config.group_size,
        sampling_config=SamplingConfig(temperature=1.0, max_tokens=96, seed=1000 + i),
        required_precision=precision, required_quantization=Precision(precision).quantization,
        max_context_tokens=2048) for i, task in enumerate(tasks) for _, precision in config.real_workers]


def run_demo(config: DemoConfig, *, runs_dir: Path = Path("runs"), console: Console | None = None) -> dict:
    """Run the demo and return its summary (also written to summary.json)."""
    console = console or Console()
    model = Path(config.model).resolve()
    if not (model / "config.json").exists():
        raise FileNotFoundError(f"demo model {config.model} not found (run from the repository root, or pass --model PATH)")
    run_dir = new_run_dir(runs_dir)
    (run_dir / "workers").mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    token = secrets.token_urlsafe(24)
    # The trainer's gate judges every group: the exchange's arrival triage (by lag alone) must tier none
    # away from it, so its lag thresholds sit past any lag of the run (train/cluster.py, arrival_gate).
    no_triage = str(config.steps + 1)
    exchange_args = [
        "--db", str(run_dir / "exchange.db"), "--port", str(port),
        "--lease-ttl-s", str(config.lease_ttl_s), "--heartbeat-ttl-s", str(config.heartbeat_ttl_s),
        "--reaper-interval-s", str(config.reaper_interval_s),
        "--preference-hold-s", str(config.preference_hold_s), "--max-attempts", str(config.max_attempts),
        "--gate-replay-lag", no_triage, "--gate-max-policy-lag", no_triage, "--log-level", "warning",
    ]
    overrides = trainer_overrides(config, model, url)
    write_json(run_dir / "demo.json", {
        "demo": asdict(config), "exchange_args": exchange_args, "trainer_overrides": overrides, "url": url,
        "code": code_version(), "profiles": {p.value: DESCRIPTIONS[p] for p in Profile},
    })
    console.print(f"[bold]rollmarket demo paths[/] → {run_dir}")
    procs = ChildProcesses({"ROLLMARKET_TRAINER_TOKEN": token})
    started = time.monotonic()
    follower = None
    metrics_path = run_dir / "metrics.jsonl"
    trainer_exit = None
    try:
        exchange = procs.start("exchange", [sys.executable, "-m", "rollmarket", "exchange", "serve",
                                            *exchange_args], run_dir / "logs" / "exchange.log")
        wait_healthy(url, exchange, log=run_dir / "logs" / "exchange.log")
        console.print(f"exchange up on {url} (docs at {url}/docs)")
        observer = TrainerClient(url, token, trainer_id="demo-observer")
        if config.real_workers and config.observe_tasks:
            observer.enqueue(observatory_jobs(config))
        for worker_id, precision in config.real_workers:
            procs.start(worker_id, [
                sys.executable, "-m", "rollmarket", "worker", "--model", str(model),
                "--precision", precision, "--threads", "1", "--exchange", url, "--worker-id", worker_id,
                "--heartbeat-s", str(config.heartbeat_ttl_s / 5), "--lease-wait-s", "1",
                "--max-steps", str(config.agent_max_steps),
                "--events", str(run_dir / "workers" / f"{worker_id}.jsonl"),
                "--rollouts", str(run_dir / "workers" / f"{worker_id}.rollouts.jsonl"),
            ], run_dir / "logs" / f"worker-{worker_id}.log")
        for index, (worker_id, profile, price) in enumerate(config.workers):
            procs.start(worker_id, [
                sys.executable, "-m", "rollmarket.sim.worker", "--url", url, "--profile", Profile(profile).value,
                "--worker-id", worker_id, "--seed", str(config.seed * 100 + index), "--model", str(model),
                "--events", str(run_dir / "workers" / f"{worker_id}.jsonl"),
                "--lease-ttl-s", str(config.lease_ttl_s), "--heartbeat-s", str(config.heartbeat_ttl_s / 5),
                "--price", str(price),
            ], run_dir / "logs" / f"worker-{worker_id}.log")
        # The trainer starts once every worker has registered (the scoring ones load torch first): its
        # first jobs would otherwise go only to the quick starters, the faulty workers, and bounce.
        expected = {w[0] for w in config.real_workers} | {w[0] for w in config.workers}
        while not expected <= {w.worker_id for w in observer.pool().workers}:
            if time.monotonic() - started > config.timeout_s:
                raise TimeoutError(f"workers did not register in {config.timeout_s:.0f}s (logs in {run_dir / 'logs'})")
            time.sleep(0.5)
        trainer_proc = procs.start("trainer", [sys.executable, "-m", "rollmarket", "train", *overrides,
                                               "--run-dir", str(run_dir)], run_dir / "logs" / "trainer.log")
        console.print(f"started {len(config.real_workers)} real workers "
                      f"({', '.join(w[0] for w in config.real_workers) or 'none'}), "
                      f"{len(config.workers)} simulated ({', '.join(w[0] for w in config.workers) or 'none'}) "
                      f"and `rollmarket train` (async, {config.steps} steps at most)")
        follower = _AuditFollower(observer, run_dir / "audit.jsonl")
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                      TimeElapsedColumn(), console=console, transient=False) as progress:
            steps_task = progress.add_task("trainer steps", total=config.steps, info="")
            paths_task = progress.add_task("paths fired", total=len(PATHS), info="")
            real_task = progress.add_task("real workers delivered", total=len(config.real_workers), info="")
            while True:
                follower.poll()
                lines = read_step_rows(metrics_path)[0]
                fired = follower.paths()
                # A real worker counts once the trainer has judged one of its groups.
                waiting = [w for w, _ in config.real_workers
                           if not any(k.startswith("decision:") for k in follower.per_worker[w])]
                progress.update(real_task, completed=len(config.real_workers) - len(waiting),
                                info=("waiting for " + ", ".join(waiting)) if waiting else "all delivered")
                missing = [name for name, count in fired.items() if not count and config.workers] + waiting
                progress.update(steps_task, completed=len(lines),
                                info=f"policy v{lines[-1]['policy_version'] + 1 if lines else 0}")
                progress.update(paths_task, completed=sum(1 for count in fired.values() if count),
                                info=("waiting for " + ", ".join(n for n, c in fired.items() if not c))
                                if not all(fired.values()) else "all fired")
                if trainer_proc.poll() is not None:
                    trainer_exit = trainer_proc.returncode
                    break
                if not missing and len(lines) >= config.min_steps:
                    break
                if time.monotonic() - started > config.timeout_s:
                    console.print("[yellow]timeout: stopping[/]")
                    break
                time.sleep(0.5)
        procs.stop(["trainer"])  # a kill mid-step is one the trainer's resume is built for
        follower.poll()
        pool = observer.pool()
    finally:
        procs.stop([name for name in procs.procs if name != "exchange"])
        if follower is not None:
            try:
                follower.poll()
            except ExchangeError:
                pass
        procs.close()
    summary = _summarize(config, follower, pool, read_step_rows(metrics_path)[0], time.monotonic() - started, run_dir)
    summary["trainer_exit"] = trainer_exit
    if config.real_workers:
        summary["observatory"] = _observe(config, run_dir, console)
    summary["seconds"] = round(time.monotonic() - started, 1)
    write_json(run_dir / "summary.json", summary)
    _print_summary(console, summary)
    if config.real_workers:
        console.print(f"observatory matrix: {run_dir}/matrix.json — see it with "
                      f"[bold]rollmarket dashboard --runs {run_dir.parent}[/] (then open "
                      f"http://127.0.0.1:8080/runs/{run_dir.name})", highlight=False)
    return summary


def observe_with_progress(settings, run_dir: Path, console: Console):
    """`run_observatory` into a demo's run directory, with a progress bar per stage; prints the matrix
    and returns it. Its settings go to observe.json: the demo's config.json stays the demo's."""
    from ..observatory.console import print_matrix
    from ..observatory import layout
    from ..observatory.runner import run_observatory

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TimeElapsedColumn(), console=console,
                  transient=True) as bars:
        stages: dict[str, int] = {}

        def progress(stage: str, done: int, total: int) -> None:
            if stage not in stages:
                stages[stage] = bars.add_task(f"observatory: {stage}", total=total)
            bars.update(stages[stage], completed=done, total=total)

        matrix = run_observatory(settings, run_dir, progress, config_name=layout.EMBEDDED_CONFIG)
    print_matrix(matrix, console)
    return matrix


def _observe(config: DemoConfig, run_dir: Path, console: Console) -> dict:
    """The observatory over the real workers' agent runs: each precision's runs teacher-forced on
    the trainer engines, with length probes and agent divergence, written into the run directory."""
    from ..observatory.runner import ObserveSettings

    sources = {precision: str(run_dir / "workers" / f"{worker_id}.rollouts.jsonl")
               for worker_id, precision in config.real_workers
               if (run_dir / "workers" / f"{worker_id}.rollouts.jsonl").exists()}
    if not sources:
        return {}
    settings = ObserveSettings(
        model=str(Path(config.model).resolve()), suite=config.suite, split="train",
        rollout_engines=list(sources), trainer_engines=list(config.observe_trainers),
        n=config.observe_length_n, lengths=list(config.observe_lengths), length_n=config.observe_length_n,
        from_rollouts=sources)
    matrix = observe_with_progress(settings, run_dir, console)
    return {"matrix": str(run_dir / "matrix.json"), "cells": len(matrix.cells),
            "diverged": sum(d.first_divergent_step is not None for d in matrix.divergence),
            "compared": len(matrix.divergence)}


def _summarize(config: DemoConfig, follower: _AuditFollower, pool, lines: list[dict], seconds: float,
               run_dir: Path) -> dict:
    paths = follower.paths()
    profiles = {w[0]: Profile(w[1]).value for w in config.workers}
    profiles.update({worker_id: f"real-{precision}" for worker_id, precision in config.real_workers})
    quality = {w.worker_id: round(w.quality, 3) for w in pool.workers}
    status = {w.worker_id: w.status for w in pool.workers}
    workers = {}
    for worker_id, profile in profiles.items():
        counts = follower.per_worker.get(worker_id, Counter())
        workers[worker_id] = {
            "profile": profile, "status": status.get(worker_id), "quality": quality.get(worker_id),
            "leases": counts["leases"], "accepted": counts["accepted"], "rejected": counts["rejected"],
            "expired": counts["expired"], "abandoned": counts["abandoned"],
            "reload_violations": counts["reload_violations"],
            "decisions": {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("decision:")},
            "arrival_tiers": {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("arrival:")},
            "rejection_reasons": {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("reason:")},
        }
    return {
        "run_dir": str(run_dir),
        "suite": config.suite if config.real_workers else None,
        "seconds": round(seconds, 1),
        "steps": len(lines),
        "active_version": pool.active_version,
        "published_version": pool.published_version,
        "paths": paths,
        "all_paths_fired": all(paths.values()),
        "real_workers_delivered": all(follower.per_worker[w]["accepted"] for w, _ in config.real_workers),
        "ok": (all(paths.values()) or not config.workers)
              and all(follower.per_worker[w]["accepted"] for w, _ in config.real_workers),
        "decisions": dict(follower.decisions),
        "arrival_tiers": dict(follower.arrival_tiers),
        "rejection_reasons": dict(follower.rejections),
        "reload_violations": follower.kinds["reload.violation"],
        "activations": follower.activations,
        "audit_events": dict(follower.kinds),
        "workers": workers,
        "engines": _engines_summary(config, follower, lines, run_dir),
    }


def _weighted(lines: list[dict], prefix: str, key: str):
    """The mean of a per-step metric over the run, weighted by the step's group count."""
    pairs = [(line[f"{prefix}/{key}"], line[f"{prefix}/groups"]) for line in lines
             if line.get(f"{prefix}/{key}") is not None and line.get(f"{prefix}/groups")]
    total = sum(w for _, w in pairs)
    return round(sum(v * w for v, w in pairs) / total, 6) if total else None


def _engines_summary(config: DemoConfig, follower: _AuditFollower, lines: list[dict], run_dir: Path) -> dict:
    """Per real worker: what its agent runs scored (rewards, pass@k) and what teacher forcing at
    the trainer's fp32 found in its groups (token ESS, |Δlogp|, router flips)."""
    from ..contracts import AgentTrajectory
    from ..verifiers.profile import profile_rollouts

    engines = {}
    for worker_id, precision in config.real_workers:
        path = run_dir / "workers" / f"{worker_id}.rollouts.jsonl"
        runs = [AgentTrajectory.model_validate_json(line) for line in path.read_text().splitlines()
                if line.strip()] if path.exists() else []
        report = profile_rollouts(runs).model_dump(mode="json") if runs else None
        counts = follower.per_worker.get(worker_id, Counter())
        prefix = f"mismatch/{precision}"
        engines[worker_id] = {
            "precision": precision,
            "groups_accepted": counts["accepted"],
            "decisions": {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("decision:")},
            "runs": len(runs),
            "reward_mean": report["overall"]["reward_mean"] if report else None,
            "pass_at_k": report["overall"]["pass_at_k"] if report else {},
            "terminal_reasons": report["overall"]["terminal_reasons"] if report else {},
            "groups_scored": sum(line.get(f"{prefix}/groups") or 0 for line in lines),
            "token_ess_mean": _weighted(lines, prefix, "token_ess_mean"),
            "mean_abs_delta": _weighted(lines, prefix, "mean_abs_delta"),
            "router_flip_rate": _weighted(lines, prefix, "router_flip_rate"),
        }
    return engines


def _print_summary(console: Console, summary: dict) -> None:
    table = Table(title="paths", show_lines=False)
    table.add_column("path")
    table.add_column("count", justify="right")
    table.add_column("what it is")
    for name, count in summary["paths"].items():
        mark = "[green]✓[/]" if count else "[red]✗[/]"
        table.add_row(f"{mark} {name}", str(count), PATHS[name])
    console.print(table)
    workers = Table(title="workers", caption="t/c/r/q: train / with correction / replay / quarantine, "
                                              "counting groups triaged by lag on arrival")
    for column in ("worker", "quality", "leases", "ok", "rej", "t/c/r/q", "exp/abd"):
        workers.add_column(column, no_wrap=True)
    for worker_id, row in summary["workers"].items():
        d, a = row["decisions"], row["arrival_tiers"]
        outcomes = [d.get("train", 0), d.get("train_with_correction", 0),
                    d.get("replay", 0) + a.get("replay", 0), d.get("quarantine", 0) + a.get("quarantine", 0)]
        workers.add_row(
            worker_id + (" (dead)" if row["status"] == "dead" else ""),
            f"{row['quality']:.2f}" if row["quality"] is not None else "-",
            str(row["leases"]), str(row["accepted"]), str(row["rejected"]),
            "/".join(map(str, outcomes)), f"{row['expired']}/{row['abandoned']}",
        )
    console.print(workers)
    for worker_id, row in summary["workers"].items():
        if row["rejection_reasons"]:
            reasons = ", ".join(f"{k} ×{v}" for k, v in sorted(row["rejection_reasons"].items()))
            console.print(f"  {worker_id} rejected for: {reasons}", highlight=False)
    if summary.get("engines"):
        engines = Table(title=f"real workers on the {summary.get('suite', '')} suite", box=box.SIMPLE_HEAD,
                        pad_edge=False, collapse_padding=True, caption=(
            "reward and pass@k (unbiased, per task) from the verifiers; ESS, mean |Δlogp| and router "
            "flips from teacher forcing the same tokens at fp32"))
        for column in ("worker", "prec", "grp", "runs", "reward", "p@1", "p@4", "ESS", "|Δlogp|", "flip"):
            engines.add_column(column, no_wrap=True, justify="left" if column == "worker" else "right")

        def fmt(value, spec=".3f"):
            return "-" if value is None else format(value, spec)

        for worker_id, row in summary["engines"].items():
            engines.add_row(worker_id, row["precision"], str(row["groups_accepted"]), str(row["runs"]),
                            fmt(row["reward_mean"], ".2f"), fmt(row["pass_at_k"].get("1"), ".2f"),
                            fmt(row["pass_at_k"].get("4"), ".2f"), fmt(row["token_ess_mean"], ".4f"),
                            fmt(row["mean_abs_delta"], ".1e"), fmt(row["router_flip_rate"], ".1%"))
        console.print(engines)
    verdict = ("[green]every path fired[/]" if summary["all_paths_fired"] else
               "[red]some paths did not fire[/]" if summary["workers"] and any(
                   row["profile"] in {p.value for p in Profile} for row in summary["workers"].values())
               else "[green]real workers only[/]")
    if not summary["real_workers_delivered"]:
        verdict += " [red](a real worker delivered nothing)[/]"
    console.print(
        f"{verdict} in {summary['seconds']}s over {summary['steps']} trainer steps; policy v"
        f"{summary['active_version']} active; {summary['reload_violations']} reload violation(s).\n"
        f"summary: {summary['run_dir']}/summary.json"
    )
