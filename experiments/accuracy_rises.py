"""Experiment (a): does a short CPU run of `rollmarket train` raise held-out accuracy beyond noise?

    python experiments/accuracy_rises.py --seeds 3 --out runs/exp-a [KEY=VALUE ...]

Each seed is one `rollmarket train CONFIG --local` run of a one-condition campaign (seed_mode "all") (the exchange, real workers, the gate, the
trainer; config configs/exp-a.toml unless --config). Held-out accuracy is measured before the first
step and after the last on the same tasks with the same sampling seeds: greedy accuracy and the
sampled pass@1 (the mean over `eval.samples` runs per task at `eval.temperature`). Intervals: a t
interval over seeds of each seed's gain, and a percentile bootstrap over the pooled (seed, task)
pairs. Writes report.json and prints the table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from _runs import ROOT, evals, metrics, run_campaign
from rollmarket.train.stats import paired_difference, t_interval


def per_task(rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    rows = sorted(rows, key=lambda r: r["task_id"])
    return (np.array([float(r["greedy_passed"]) for r in rows]),
            np.array([float(np.mean(r["sampled_passed"])) for r in rows]))


def fmt(i) -> str:
    return f"{i.mean:+.3f} [{i.lo:+.3f}, {i.hi:+.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "exp-a")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "exp-a.toml")
    parser.add_argument("--parallel", type=int, default=2, help="Runs at once (each uses about one core).")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE overrides for every run.")
    args = parser.parse_args()
    console = Console()
    campaign = run_campaign("exp-a", args.config, {"train": {}}, list(range(args.seeds)), args.out,
                            overrides=args.overrides, parallel=args.parallel, console=console)
    runs = {f"seed{seed}": run_dir for (_, seed), run_dir in campaign.items()}

    table = Table(title="held-out accuracy before → after training, per seed")
    for column in ("seed", "steps", "minutes", "greedy", "sampled pass@1", "train correct_rate first→last 5 steps"):
        table.add_column(column, justify="right")
    gains = {"greedy": [], "pass@1": []}
    pooled = {"greedy": ([], []), "pass@1": ([], [])}
    per_seed = {}
    for name, run_dir in runs.items():
        by_step = evals(run_dir)
        first, last = min(by_step), max(by_step)
        g0, p0 = per_task(by_step[first])
        g1, p1 = per_task(by_step[last])
        rows = [r for r in metrics(run_dir) if r["step"] > 0]
        summary = json.loads((run_dir / "summary.json").read_text())
        early = float(np.mean([r["correct_rate"] for r in rows[:5]]))
        late = float(np.mean([r["correct_rate"] for r in rows[-5:]]))
        gains["greedy"].append(g1.mean() - g0.mean())
        gains["pass@1"].append(p1.mean() - p0.mean())
        for key, (b, a) in (("greedy", (g0, g1)), ("pass@1", (p0, p1))):
            pooled[key][0].extend(b.tolist())
            pooled[key][1].extend(a.tolist())
        per_seed[name] = {"run_dir": str(run_dir), "steps": last, "minutes": summary["minutes"],
                          "greedy": [g0.mean(), g1.mean()], "pass@1": [p0.mean(), p1.mean()],
                          "train_correct_rate_first5_last5": [early, late]}
        table.add_row(name, str(last), f"{summary['minutes']:.1f}", f"{g0.mean():.3f} → {g1.mean():.3f}",
                      f"{p0.mean():.3f} → {p1.mean():.3f}", f"{early:.3f} → {late:.3f}")
    console.print(table)
    result = {"per_seed": per_seed}
    for key in ("greedy", "pass@1"):
        over_seeds = t_interval(gains[key])
        over_pairs = paired_difference(*pooled[key])
        result[key] = {"gain_over_seeds_t95": over_seeds.model_dump(), "gain_over_tasks_bootstrap95": over_pairs.model_dump()}
        verdict = "rises beyond its 95% interval" if over_seeds.lo is not None and over_seeds.lo > 0 else "no clear rise"
        console.print(f"{key}: gain {fmt(over_seeds)} (t, {over_seeds.n} seeds); {fmt(over_pairs)} "
                      f"(bootstrap, {over_pairs.n} seed×task pairs) → {verdict}", highlight=False)
    (args.out / "report.json").write_text(json.dumps(result, indent=2) + "\n")
    console.print(f"report: {args.out / 'report.json'}")


if __name__ == "__main__":
    main()
