"""`rollmarket demo`: train the starting model through the exchange with real workers, one of them drifting.

    exchange process (SQLite in the run dir) ◄── rollmarket worker --precision bf16                 (process)
                      ▲                      ◄── rollmarket worker --precision fp8                  (process)
                      │                      ◄── rollmarket worker --precision fp16 --reload-lag 3  (process)
    the trainer (this process, async): publish → jobs → fetch → teacher-force → gate → step → publish …

The third worker is a slow host: it reloads the policy only when the published one is more than 3
versions newer, so its groups really come from older weights. The trainer takes groups of any
version (async), teacher-forces each with its current weights and the gate judges what it finds,
with the demo's own stated thresholds (a 0.1-nat clamp, so that the clipped fraction can fire on a
tiny model): lag ≤ 1 train, lag 2 replay (trained with IS weights, `loop.replay`), lag ≥ 3
quarantine (held out), and a group with more than 6.5% of its tokens past the clamp
train_with_correction (the gate's order puts it before replay).

Each step prints one line (step k/N, ETA, mean reward, the gate's counts, each worker's mismatch)
and, for every tier other than train, what it did to the step. Held-out sampled pass@1 is measured
before and after training (`eval.tasks` × `eval.samples` at temperature 1) and printed with 95% t
intervals over tasks and the gain paired by task (research/stats.py). Everything lands in one run
directory: config.json (the training config: `rollmarket train --resume RUN_DIR --local` goes on
from it), metrics.jsonl, evals.jsonl, generations.jsonl, checkpoints/, exchange.db, workers/, logs/,
summary.json, and with `observe` the observatory matrix (matrix.json, reports/, observe.json).
"""

from __future__ import annotations

import json
import secrets
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from ..localhost import free_port, wait_healthy
from ..runs import new_run_dir, write_json

TIERS = ("train", "train_with_correction", "replay", "quarantine")
SHORT = {"train": "train", "train_with_correction": "correction", "replay": "replay", "quarantine": "quarantine"}


@dataclass
class TrainDemoConfig:
    model: str = "models/tiny-start"
    precisions: list = field(default_factory=lambda: ["bf16", "fp8"])
    """One real worker process per precision; the step's jobs go round robin over these and the drift worker's."""
    drift: str | None = "fp16@lag3"
    """A `local.workers`-style entry (PRECISION@lagK) for the drifting worker; None: no drift."""
    suite: str = "arithmetic"
    steps: int = 8
    groups_per_step: int = 6
    group_size: int = 4
    lr: float = 1e-4
    eval_tasks: int = 64
    eval_samples: int = 4
    clamp: float = 0.1
    """The gate's clamp c in nats (the default 20 never fires on a tiny model). On tiny-start a token's
    |Δlogp| stays under 0.25 nat, whether from precision or from a few versions of lag."""
    max_clipped_fraction: float = 0.065
    """Above: train_with_correction. On tiny-start 0-5% of a bf16 or fp8 group's tokens pass 0.1 nat,
    2-14% of a group two versions old (measured; docs/dev-notes.md)."""
    max_policy_lag: int = 2
    """Above: quarantine. Async caps replay_lag at loop.max_staleness (1): lag 2 … max_policy_lag replay."""
    observe: bool = False
    """End with the observatory matrix of the trained policy (adds a minute or more)."""
    observe_n: int = 8
    observe_lengths: list = field(default_factory=lambda: [64])
    overrides: list = field(default_factory=list)
    """Extra `rollmarket train` overrides (KEY=VALUE), applied last."""


def pass1_before_after(run_dir: Path) -> dict | None:
    """Held-out sampled pass@1 at step 0 and at the last evaluation, each with its 95% t interval over
    tasks, and the gain with the t interval of the per-task differences (paired by task), from
    evals.jsonl through research/stats.py. None when the run has no two evaluations."""
    import numpy as np

    from ..research.stats import Metric, load_run, per_task_values, samples_per_task, t_interval

    run = load_run(run_dir, seed=0)
    steps = sorted({r["step"] for r in run.evals() if isinstance(r.get("step"), int)})
    if len(steps) < 2 or steps[0] != 0:
        return None
    metric = Metric.parse("eval/pass@1@final")  # KEY@WHEN: the key is eval/pass@1
    before, after = per_task_values(run, metric, 0), per_task_values(run, metric, steps[-1])
    tasks = sorted(set(before or {}) & set(after or {}))
    if len(tasks) < 2:
        return None
    b_N = np.array([before[t] for t in tasks])
    a_N = np.array([after[t] for t in tasks])

    def interval(x_N) -> dict:
        lo, hi = t_interval(x_N)
        return {"mean": float(np.mean(x_N)), "lo": lo, "hi": hi}

    return {"tasks": len(tasks), "samples": samples_per_task(run, 0), "step": steps[-1],
            "before": interval(b_N), "after": interval(a_N), "gain": interval(a_N - b_N)}


def pass1_line(result: dict) -> str:
    def fmt(x: dict, sign: str = "") -> str:
        return f"{x['mean']:{sign}.3f} [{x['lo']:{sign}.3f}, {x['hi']:{sign}.3f}]"

    gain = result["gain"]
    verdict = ("the interval excludes 0" if gain["lo"] > 0 or gain["hi"] < 0 else "the interval includes 0: "
               "no change shown")
    return (f"held-out sampled pass@1 ({result['tasks']} tasks × {result['samples']} samples, temperature 1): "
            f"before {fmt(result['before'])} → after {fmt(result['after'])}; gain {fmt(gain, '+')} "
            f"(95% t intervals over tasks, the gain paired by task; {verdict})")


def _duration(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}:{seconds % 60:02d}"


class StepReport:
    """Turns a step's metrics row and generations rows into the demo's lines."""

    def __init__(self, config: TrainDemoConfig, train_cfg, worker_names: dict[str, str]):
        self.config = config
        self.cfg = train_cfg
        self.names = worker_names
        """worker id → the label it is shown with (its precision, with @lagK for the drift worker)."""

    def worker(self, worker_id: str) -> str:
        return self.names.get(worker_id, worker_id)

    def lines(self, row: dict, generations: list[dict], *, eta_s: float | None) -> list[str]:
        step, total = row["step"], self.cfg.loop.steps
        gate = " · ".join(f"{row[f'gate/{k}']} {SHORT[k]}" for k in TIERS)
        groups: dict[str, dict] = {}
        for g in generations:
            groups.setdefault(g["group_id"], {**g, "runs": [], "clipped": 0})
            groups[g["group_id"]]["runs"].append(g)
            groups[g["group_id"]]["clipped"] += g.get("clipped_tokens") or 0
        mismatch = []
        for precision in sorted({g["precision"] for g in groups.values()}):
            ess, delta = row.get(f"mismatch/{precision}/token_ess_mean"), row.get(f"mismatch/{precision}/mean_abs_delta")
            if ess is None:
                continue
            label = " ".join(sorted({self.worker(g["worker_id"]) for g in groups.values()
                                     if g["precision"] == precision}))
            mismatch.append(f"{label} ESS {ess:.4f} |Δ| {delta:.1e}")
        eta = f"ETA {_duration(eta_s)}" if eta_s is not None else "ETA -"
        out = [f"step {step}/{total}  {eta}  reward {row['mean_reward']:.2f}  gate {gate}  "
               f"mismatch {' · '.join(mismatch) or '-'}"]
        out += self._tiers(groups)
        return out

    def _tiers(self, groups: dict[str, dict]) -> list[str]:
        """One line per tier other than train: what it did to the step, from the groups it judged."""
        by_tier: dict[str, list[dict]] = defaultdict(list)
        for g in groups.values():
            by_tier[g["decision"]].append(g)
        out = []
        c = self.cfg.correction

        def who(items: list[dict]) -> str:
            counts = Counter((self.worker(g["worker_id"]), g["policy_lag"]) for g in items)
            return ", ".join(f"{n}× {w} lag {lag}" for (w, lag), n in sorted(counts.items()))

        def used(items: list[dict]) -> int:
            return sum(r["used"] for g in items for r in g["runs"])

        if items := by_tier.get("train_with_correction"):
            tokens = sum(g["clipped"] for g in items)
            out.append(f"  correction: {len(items)} group(s) ({who(items)}) with more than "
                       f"{self.cfg.gate.max_clipped_fraction:.1%} of their tokens past the {self.cfg.gate.clamp:g}-nat "
                       f"clamp ({tokens} tokens in all): {used(items)} runs trained with {c.kind} IS weights "
                       f"(cap {c.cap:g})")
        if items := by_tier.get("replay"):
            what = (f"{used(items)} runs trained with {c.kind} IS weights (loop.replay) and the groups kept in the "
                    f"exchange's replay tier" if self.cfg.loop.replay else
                    "not trained on this step; kept in the exchange's replay tier")
            out.append(f"  replay: {len(items)} group(s) ({who(items)}) older than the staleness budget "
                       f"({self.cfg.loop.max_staleness} version(s)): {what}")
        if items := by_tier.get("quarantine"):
            runs = sum(len(g["runs"]) for g in items)
            out.append(f"  quarantine: {len(items)} group(s) ({who(items)}) past max_policy_lag "
                       f"{self.cfg.gate.max_policy_lag} or the ESS / router limits: held out, their {runs} runs "
                       f"not trained on")
        return out


def _read_new(path: Path, offset: int) -> tuple[list[dict], int]:
    """JSON lines appended to `path` since byte `offset`, and the new offset."""
    if not path.exists():
        return [], offset
    with path.open("rb") as handle:
        handle.seek(offset)
        data = handle.read()
    end = data.rfind(b"\n") + 1
    rows = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return rows, offset + end


def demo_overrides(config: TrainDemoConfig, model: Path, url: str, runs_dir: Path) -> list[str]:
    """The `rollmarket train` settings the demo runs with (printed, saved in config.json)."""
    precisions = list(config.precisions)
    if config.drift:
        from .config import WorkerSpec

        spec = WorkerSpec.parse(config.drift)
        if spec.precision not in precisions:
            precisions.append(spec.precision)  # its jobs: the drift worker's own share of each step
    return [
        f"model.path='{model}'", f"rollout.suite='{config.suite}'", f"rollout.precisions={precisions!r}",
        f"rollout.groups_per_step={config.groups_per_step}", f"rollout.group_size={config.group_size}",
        f"optim.lr={config.lr}", f"loop.steps={config.steps}", "loop.mode='async'", "loop.replay=true",
        f"eval.tasks={config.eval_tasks}", f"eval.samples={config.eval_samples}", "eval.temperature=1.0",
        "eval.every=0", f"gate.clamp={config.clamp}", f"gate.max_clipped_fraction={config.max_clipped_fraction}",
        f"gate.max_policy_lag={config.max_policy_lag}", f"exchange.url='{url}'", f"runs_root='{runs_dir}'",
        *config.overrides]


def run_train_demo(config: TrainDemoConfig, *, runs_dir: Path = Path("runs"), console: Console | None = None) -> dict:
    from ..observatory.runner import ObserveSettings
    from ..sim.demo import ChildProcesses, observe_with_progress
    from .cluster import arrival_gate
    from ..tasks.suites import load_suite
    from .config import WorkerSpec, resolve, validate
    from .loop import Trainer

    console = console or Console()
    model = Path(config.model).resolve()
    if not (model / "config.json").exists():
        raise FileNotFoundError(f"demo model {config.model} not found (run from the repository root or pass --model)")
    workers = [WorkerSpec(p) for p in config.precisions] + ([WorkerSpec.parse(config.drift)] if config.drift else [])
    port, token = free_port(), secrets.token_urlsafe(24)
    url = f"http://127.0.0.1:{port}"
    cfg = resolve(None, demo_overrides(config, model, url, runs_dir))
    validate(cfg, local=False, token=token)  # a bad --set is refused before the run directory exists
    run_dir = new_run_dir(runs_dir)
    (run_dir / "workers").mkdir()
    names = {f"{model.name}-{w.precision}" + (f"-lag{w.reload_lag}" if w.reload_lag else ""): str(w) for w in workers}
    console.print(f"[bold]rollmarket demo[/] → {run_dir}", highlight=False)
    heldout = len(load_suite(config.suite, "heldout"))
    if heldout < cfg.eval.tasks:
        console.print(f"note: the {config.suite} suite's held-out split has {heldout} tasks; all of them are "
                      f"evaluated (eval.tasks {cfg.eval.tasks})", highlight=False)
    console.print(f"training {model.name} on the {config.suite} suite, {cfg.loop.steps} steps × "
                  f"{cfg.rollout.groups_per_step} groups × {cfg.rollout.group_size} runs, async, lr {cfg.optim.lr:g}; "
                  f"workers: {', '.join(map(str, workers))}", highlight=False)
    console.print(f"the demo's gate: clamp {cfg.gate.clamp:g} nat, correction above {cfg.gate.max_clipped_fraction:.1%} "
                  f"of tokens past it, replay at lag > {min(cfg.gate.replay_lag, cfg.loop.max_staleness)} "
                  f"(async: loop.max_staleness), quarantine at lag > {cfg.gate.max_policy_lag} or ESS < "
                  f"{cfg.gate.min_ess:g}" + ("; replayed groups are trained with IS weights" if cfg.loop.replay else ""),
                  highlight=False)
    started = time.monotonic()
    procs = ChildProcesses({"ROLLMARKET_TRAINER_TOKEN": token})
    triage = arrival_gate(cfg.loop.steps + 1)  # the trainer's gate judges every group: none tiered away before
    report = StepReport(config, cfg, names)
    try:
        exchange = procs.start("exchange", [
            sys.executable, "-m", "rollmarket", "exchange", "serve", "--db", str(run_dir / "exchange.db"),
            "--port", str(port), "--lease-ttl-s", "60", "--heartbeat-ttl-s", "10", "--log-level", "warning",
            "--gate-replay-lag", str(triage.replay_lag), "--gate-max-policy-lag", str(triage.max_policy_lag)],
            run_dir / "logs" / "exchange.log")
        wait_healthy(url, exchange, log=run_dir / "logs" / "exchange.log")
        for worker_id, spec in zip(names, workers):
            procs.start(worker_id, [
                sys.executable, "-m", "rollmarket", "worker", "--model", str(model), "--precision", spec.precision,
                "--threads", "1", "--exchange", url, "--worker-id", worker_id, "--heartbeat-s", "1",
                "--lease-wait-s", "1", "--max-steps", str(cfg.agent.max_turns), "--reload-lag", str(spec.reload_lag),
                "--events", str(run_dir / "workers" / f"{worker_id}.jsonl"),
                "--rollouts", str(run_dir / "workers" / f"{worker_id}.rollouts.jsonl"),
            ], run_dir / "logs" / f"worker-{worker_id}.log")
        console.print(f"exchange on {url}; {len(workers)} worker processes (logs in {run_dir / 'logs'})",
                      highlight=False)

        with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                      TimeElapsedColumn(), console=console, transient=True) as progress:
            bar = progress.add_task("training", total=cfg.loop.steps, info="starting workers")
            clock = {"eval": 0.0, "train_started": None, "offset": 0}

            def on_event(kind: str, data: dict) -> None:
                if kind == "evaluated":  # the evaluation after training takes about as long: the ETA counts it
                    clock["eval"], clock["train_started"] = data["seconds"], time.monotonic()
                    return
                if kind == "eval":
                    what = "before training" if data.get("step") == 0 else "after training"
                    info = f"held-out evaluation {what} ({cfg.eval.tasks} tasks × {cfg.eval.samples} samples)"
                elif kind == "quorum":
                    info = f"workers loading policy v{data.get('version')}"
                else:
                    info = ""
                progress.update(bar, info=info)

            def on_step(row: dict) -> None:
                rows, clock["offset"] = _read_new(run_dir / "generations.jsonl", clock["offset"])
                done = row["step"]
                # the row comes after the step's evaluation: the last step's ETA is 0
                per_step = (time.monotonic() - (clock["train_started"] or started)) / done
                eta = per_step * (cfg.loop.steps - done) + clock["eval"] if done < cfg.loop.steps else 0.0
                for line in report.lines(row, [r for r in rows if r["step"] == done], eta_s=eta):
                    progress.console.print(line, highlight=False, markup=False)
                progress.update(bar, advance=1, info=f"step {done}: reward {row['mean_reward']:.2f}")

            trainer = Trainer(cfg, run_dir=run_dir, token=token, on_step=on_step, on_event=on_event)
            trainer.run()
    finally:
        procs.close()
    summary = json.loads((run_dir / "summary.json").read_text())
    result = pass1_before_after(run_dir)
    if result:
        console.print(pass1_line(result), highlight=False)
    tiers = Counter()
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        tiers.update({k: row.get(f"gate/{k}") or 0 for k in TIERS})
    console.print("gate decisions over the run: " + " · ".join(f"{tiers[k]} {SHORT[k]}" for k in TIERS),
                  highlight=False)

    if config.observe:
        final = run_dir / "checkpoints" / f"v{summary['final_version']:04d}"
        settings = ObserveSettings(model=str(final), suite=config.suite, split="heldout",
                                   rollout_engines=["fp32", *config.precisions], trainer_engines=["fp32", "bf16"],
                                   n=config.observe_n, lengths=list(config.observe_lengths), length_n=config.observe_n,
                                   max_steps=cfg.agent.max_turns, max_tokens=cfg.rollout.max_tokens)
        observe_with_progress(settings, run_dir, console)
        summary["matrix"] = str(run_dir / "matrix.json")
    summary.update({"demo": asdict(config), "pass1": result, "gate_totals": dict(tiers),
                    "seconds": round(time.monotonic() - started, 1)})
    write_json(run_dir / "summary.json", summary)
    console.print(f"run directory: {run_dir} (config.json, metrics.jsonl, evals.jsonl, generations.jsonl, "
                  f"exchange.db); see it with [bold]rollmarket dashboard --runs {run_dir.parent}[/]", highlight=False)
    for tracker in summary.get("trackers", []):
        console.print(f"{tracker['tracker']}: {tracker['open']}", highlight=False)
    console.print(f"demo took {_duration(summary['seconds'])}", highlight=False)
    return summary
