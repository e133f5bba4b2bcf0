"""`rollmarket demo`: the exchange, honest and faulty workers and a trainer, as real processes.

The orchestrator starts `rollmarket exchange serve` on a free loopback port with its database in
the run directory, one process per worker profile, and the simulated trainer; follows the audit
log until every path has fired; stops everything; and writes the run directory:

    runs/<UTC timestamp>-<id>/
        config.json      demo and exchange settings, code version
        summary.json     paths fired, per-worker outcomes, decisions, rejections
        metrics.jsonl    one line per trainer step
        audit.jsonl      the exchange's audit log
        exchange.db      the exchange's SQLite database
        workers/*.jsonl  what each worker saw
        logs/*.log       process output
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from ..client import ExchangeError, TrainerClient
from ..localhost import free_port, wait_healthy
from ..runs import code_version, new_run_dir, write_json
from .profiles import DESCRIPTIONS, Profile

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
    ("engine-bf16", Profile.engine, 1.0),
    ("honest-a", Profile.honest, 1.0), ("honest-b", Profile.honest, 1.5), ("noisy", Profile.noisy, 0.8),
    ("stale", Profile.stale, 1.0), ("toxic-tokenizer", Profile.toxic_tokenizer, 0.5),
    ("toxic-precision", Profile.toxic_precision, 0.6), ("no-logprobs", Profile.no_logprobs, 0.7),
    ("version-drift", Profile.version_drift, 0.9), ("crashing", Profile.crashing, 1.0),
)


@dataclass
class DemoConfig:
    """Settings of one demo run (saved as config.json)."""

    steps: int = 12
    min_steps: int = 6
    timeout_s: float = 240.0
    seed: int = 0
    jobs_per_step: int = 8
    group_size: int = 4
    step_seconds: float = 1.5
    lease_ttl_s: float = 6.0
    heartbeat_ttl_s: float = 2.5
    reaper_interval_s: float = 0.25
    preference_hold_s: float = 0.5
    max_attempts: int = 8
    model: str | None = "models/tiny-moe"
    """The real model the policy is; the engine profile samples it and the trainer teacher-forces
    its groups. None runs the synthetic model alone (and drops the engine profile)."""
    workers: list = field(default_factory=lambda: [list(w) for w in DEFAULT_WORKERS])


class _Processes:
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


def _trainer_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_demo(config: DemoConfig, *, runs_dir: Path = Path("runs"), console: Console | None = None) -> dict:
    """Run the demo and return its summary (also written to summary.json)."""
    console = console or Console()
    env = {}
    if config.model:
        model = Path(config.model)
        if not (model / "config.json").exists():
            raise FileNotFoundError(f"demo model {model} not found (run from the repository root, "
                                    "or pass --model PATH / --no-model)")
        env["ROLLMARKET_DEMO_MODEL"] = str(model.resolve())
    else:
        config.workers = [w for w in config.workers if Profile(w[1]) is not Profile.engine]
    run_dir = new_run_dir(runs_dir)
    (run_dir / "workers").mkdir()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    token = secrets.token_urlsafe(24)
    exchange_args = [
        "--db", str(run_dir / "exchange.db"), "--port", str(port),
        "--lease-ttl-s", str(config.lease_ttl_s), "--heartbeat-ttl-s", str(config.heartbeat_ttl_s),
        "--reaper-interval-s", str(config.reaper_interval_s),
        "--preference-hold-s", str(config.preference_hold_s), "--max-attempts", str(config.max_attempts),
        "--log-level", "warning",
    ]
    write_json(run_dir / "config.json", {
        "demo": asdict(config), "exchange_args": exchange_args, "url": url, "code": code_version(),
        "profiles": {p.value: DESCRIPTIONS[p] for p in Profile},
    })
    console.print(f"[bold]rollmarket demo[/] → {run_dir}")
    procs = _Processes({"ROLLMARKET_TRAINER_TOKEN": token, **env})
    started = time.monotonic()
    follower = None
    metrics_path = run_dir / "metrics.jsonl"
    stop_file = run_dir / "STOP"
    try:
        exchange = procs.start("exchange", [sys.executable, "-m", "rollmarket", "exchange", "serve",
                                            *exchange_args], run_dir / "logs" / "exchange.log")
        wait_healthy(url, exchange, log=run_dir / "logs" / "exchange.log")
        console.print(f"exchange up on {url} (docs at {url}/docs)")
        for index, (worker_id, profile, price) in enumerate(config.workers):
            procs.start(worker_id, [
                sys.executable, "-m", "rollmarket.sim.worker", "--url", url, "--profile", Profile(profile).value,
                "--worker-id", worker_id, "--seed", str(config.seed * 100 + index),
                "--events", str(run_dir / "workers" / f"{worker_id}.jsonl"),
                "--lease-ttl-s", str(config.lease_ttl_s), "--heartbeat-s", str(config.heartbeat_ttl_s / 5),
                "--price", str(price),
            ], run_dir / "logs" / f"worker-{worker_id}.log")
        procs.start("trainer", [
            sys.executable, "-m", "rollmarket.sim.trainer", "--url", url,
            "--steps", str(config.steps), "--jobs-per-step", str(config.jobs_per_step),
            "--group-size", str(config.group_size), "--metrics", str(metrics_path),
            "--stop-file", str(stop_file), "--step-seconds", str(config.step_seconds),
        ], run_dir / "logs" / "trainer.log")
        console.print(f"started {len(config.workers)} workers ({', '.join(w[0] for w in config.workers)}) "
                      "and a trainer")
        trainer = TrainerClient(url, token, trainer_id="demo-observer")
        follower = _AuditFollower(trainer, run_dir / "audit.jsonl")
        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                      TimeElapsedColumn(), console=console, transient=False) as progress:
            steps_task = progress.add_task("trainer steps", total=config.steps, info="")
            paths_task = progress.add_task("paths fired", total=len(PATHS), info="")
            while True:
                follower.poll()
                lines = _trainer_lines(metrics_path)
                fired = follower.paths()
                missing = [name for name, count in fired.items() if not count]
                progress.update(steps_task, completed=len(lines),
                                info=f"policy v{lines[-1]['next_version'] if lines else 0}")
                progress.update(paths_task, completed=len(PATHS) - len(missing),
                                info=("waiting for " + ", ".join(missing)) if missing else "all fired")
                if not missing and len(lines) >= config.min_steps and not stop_file.exists():
                    stop_file.touch()
                if procs.procs["trainer"].poll() is not None:
                    break
                if time.monotonic() - started > config.timeout_s:
                    console.print("[yellow]timeout: stopping[/]")
                    stop_file.touch()
                    procs.stop(["trainer"])
                    break
                time.sleep(0.5)
        follower.poll()
        pool = trainer.pool()
    finally:
        procs.stop([name for name in procs.procs if name != "exchange"])
        if follower is not None:
            try:
                follower.poll()
            except ExchangeError:
                pass
        procs.close()
    stop_file.unlink(missing_ok=True)
    summary = _summarize(config, follower, pool, _trainer_lines(metrics_path), time.monotonic() - started, run_dir)
    write_json(run_dir / "summary.json", summary)
    _print_summary(console, summary)
    return summary


def _summarize(config: DemoConfig, follower: _AuditFollower, pool, lines: list[dict], seconds: float,
               run_dir: Path) -> dict:
    paths = follower.paths()
    profiles = {w[0]: Profile(w[1]).value for w in config.workers}
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
        "seconds": round(seconds, 1),
        "steps": len(lines),
        "active_version": pool.active_version,
        "published_version": pool.published_version,
        "paths": paths,
        "all_paths_fired": all(paths.values()),
        "decisions": dict(follower.decisions),
        "arrival_tiers": dict(follower.arrival_tiers),
        "rejection_reasons": dict(follower.rejections),
        "reload_violations": follower.kinds["reload.violation"],
        "replay_served": sum(line.get("replay_served", 0) for line in lines),
        "activations": follower.activations,
        "audit_events": dict(follower.kinds),
        "workers": workers,
        "engine": _engine_summary(lines),
    }


def _engine_summary(lines: list[dict]) -> dict:
    """What teacher forcing found in the groups the real engine sampled (bf16 vs fp32 trainer)."""
    groups = sum(line.get("engine/groups") or 0 for line in lines)

    def weighted(key: str):
        pairs = [(line[key], line["engine/groups"]) for line in lines
                 if line.get(key) is not None and line.get("engine/groups")]
        total = sum(w for _, w in pairs)
        return round(sum(v * w for v, w in pairs) / total, 6) if total else None

    return {"groups": groups, "token_ess_mean": weighted("engine/token_ess_mean"),
            "mean_abs_delta": weighted("engine/mean_abs_delta"),
            "router_flip_rate": weighted("engine/router_flip_rate"),
            "reward_mean": weighted("engine/reward_mean")}


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
    engine = summary.get("engine") or {}
    if engine.get("groups"):
        console.print(
            f"real engine (tiny MoE, bf16 rollout vs fp32 teacher forcing): {engine['groups']} groups, "
            f"token ESS {engine['token_ess_mean']:.4f}, mean |Δlogp| {engine['mean_abs_delta']:.4f}, "
            f"router flip {engine['router_flip_rate'] if engine['router_flip_rate'] is not None else '-'}",
            highlight=False)
    verdict = "[green]every path fired[/]" if summary["all_paths_fired"] else "[red]some paths did not fire[/]"
    console.print(
        f"{verdict} in {summary['seconds']}s over {summary['steps']} trainer steps; policy v"
        f"{summary['active_version']} active; {summary['reload_violations']} reload violation(s); "
        f"{summary['replay_served']} replay group(s) served on request.\n"
        f"summary: {summary['run_dir']}/summary.json"
    )
