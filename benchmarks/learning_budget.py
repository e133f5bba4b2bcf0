"""Issue 14's time budgets on this machine: `make demo` (≤ 4 min) and one run of experiment (a)
(≤ 10 min), each measured alone, as a fresh process, from the command to its exit.

    rollmarket demo                       the demo as `make demo` runs it (its own defaults), with
                                          held-out pass@1 before and after and the gate's tiers
    experiment (a), one run alone         configs/exp-a-campaign.toml's grpo run of seed 0, as
                                          `rollmarket campaign` starts it (`rollmarket train --local`
                                          with that run's overrides, one torch thread)

The baseline each beats is the issue's budget: the ratio is budget / measured (above 1 = within it).
What each run learned is read from the run directory it wrote, so the time is of a run that worked.

    python benchmarks/learning_budget.py                      # both, ~10 min on the 2-core box
    python benchmarks/learning_budget.py --only demo
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _result import write_result
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
ROLLMARKET = [sys.executable, "-m", "rollmarket"]
BUDGET_S = {"demo": 240.0, "exp-a run": 600.0}


def _run(argv: list[str], log: Path, **env_extra: str) -> float:
    """Seconds from start to exit of ARGV (run in the repository, output to LOG); exits on failure."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **env_extra}
    started = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, check=False).returncode
    elapsed = time.perf_counter() - started
    if code != 0:
        raise SystemExit(f"{' '.join(argv)}: exit {code}; see {log}\n{log.read_text()[-3000:]}")
    return elapsed


def _run_dir(root: Path) -> Path:
    dirs = [p for p in root.iterdir() if (p / "summary.json").is_file()]
    if len(dirs) != 1:
        raise SystemExit(f"expected one finished run under {root}, found {len(dirs)}")
    return dirs[0]


def demo(tmp: Path) -> dict:
    root = tmp / "demo"
    seconds = _run([*ROLLMARKET, "demo", "--runs-dir", str(root)], tmp / "demo.log")
    summary = json.loads((_run_dir(root) / "summary.json").read_text())
    p = summary["pass1"]
    return {"case": "demo", "seconds": round(seconds, 1), "steps": summary["steps"],
            "pass1_before": p["before"], "pass1_after": p["after"], "gain": p["gain"],
            "eval": f"{p['tasks']} tasks × {p['samples']} samples", "gate_totals": summary["gate_totals"]}


def exp_a_run(tmp: Path) -> dict:
    from rollmarket.research.campaign import load_campaign

    campaign = load_campaign(REPO / "configs" / "exp-a-campaign.toml")
    run = next(r for r in campaign.runs if r.condition == "grpo" and r.seed == 0)
    root = tmp / "exp-a"
    argv = [*ROLLMARKET, "train", "--local", *run.overrides, f"runs_root={json.dumps(str(root))}"]
    seconds = _run(argv, tmp / "exp-a.log", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")  # as the campaign runs it
    summary = json.loads((_run_dir(root) / "summary.json").read_text())
    return {"case": "exp-a run", "seconds": round(seconds, 1), "steps": summary["steps"],
            "condition": run.condition, "seed": run.seed,
            "pass1_before": summary["eval_before"]["eval/pass@1"], "pass1_after": summary["eval_after"]["eval/pass@1"],
            "eval": f"{summary['eval_after'].get('eval/tasks', '?')} tasks × 16 samples"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=["demo", "exp-a"], default=None)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "learning_budget.json")
    args = parser.parse_args()
    console = Console()
    rows = []
    with tempfile.TemporaryDirectory(prefix="learning-budget-") as tmp:
        for name, case in (("demo", demo), ("exp-a", exp_a_run)):
            if args.only in (None, name):
                console.print(f"[bold]{name}[/]: running (load average {os.getloadavg()[0]:.2f}) …")
                row = case(Path(tmp))
                row["budget_s"] = BUDGET_S[row["case"]]
                row["ratio"] = round(row["budget_s"] / row["seconds"], 2)
                rows.append(row)
    table = Table(title="issue 14's budgets, one process alone on this machine")
    for col in ("case", "seconds", "budget (s)", "budget / measured", "held-out pass@1 before → after"):
        table.add_column(col)
    for r in rows:
        before = r["pass1_before"]["mean"] if isinstance(r["pass1_before"], dict) else r["pass1_before"]
        after = r["pass1_after"]["mean"] if isinstance(r["pass1_after"], dict) else r["pass1_after"]
        table.add_row(r["case"], f"{r['seconds']:.0f}", f"{r['budget_s']:.0f}", f"{r['ratio']:.2f}×",
                      f"{before:.3f} → {after:.3f}")
    console.print(table)
    write_result(args.out, "learning_budget", args, rows)
    console.print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
