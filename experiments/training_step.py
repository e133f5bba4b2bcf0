"""Experiment (b): does engine drift change what a training step does, and does IS correction undo it?

    python experiments/training_step.py --seeds 3 --steps 8 --out runs/exp-b [KEY=VALUE ...]

For each seed and each condition (rollout precision bf16 or fp8) × (IS correction never or always),
one `rollmarket train CONFIG --local` run with a single worker of that precision. Within a seed every
condition starts from the same weights and gets the same tasks with the same sampling seeds, so
conditions differ only by the rollout engine's numerics (and what they make the sampler choose)
and by the correction. Compared, after step 1 and after the last step N:

- the parameter updates Δθ = θ_step − θ_0: cosine similarity and relative norm difference
  ‖Δa − Δb‖ / ‖Δb‖ between conditions of the same seed; as the yardstick, the same numbers
  between two seeds of one condition (what sampling noise alone does);
- learning curves (correct_rate per step, mean over seeds with a 95% t interval);
- final held-out accuracy (greedy and sampled pass@1), mean over seeds with a 95% t interval.

Writes report.json and prints the tables.
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from _runs import ROOT, flat_weights, metrics, run_campaign
from rollmarket.train.stats import cosine, relative_norm_difference, t_interval

CONDITIONS = [("bf16", "never"), ("bf16", "always"), ("fp8", "never"), ("fp8", "always")]


def name(precision: str, correction: str, seed: int) -> str:
    return f"{precision}-is_{correction}-seed{seed}"


def fmt(i, spec=".3f") -> str:
    return "-" if i.mean is None else f"{i.mean:{spec}} [{i.lo:{spec}}, {i.hi:{spec}}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "exp-b")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "exp-a.toml")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    console = Console()
    N = args.steps
    conditions = {f"{precision}-is_{correction}": {
        "rollout.precisions": [precision], "local.workers": [precision], "correction.when": correction,
        "correction.kind": "token_tis"} for precision, correction in CONDITIONS}
    campaign = run_campaign("exp-b", args.config, conditions, list(range(args.seeds)), args.out,
                            overrides=[f"loop.steps={N}", f"loop.keep_checkpoints={N + 1}", f"eval.every={N}",
                                       *args.overrides], parallel=args.parallel, console=console)
    runs = {f"{condition}-seed{seed}": run_dir for (condition, seed), run_dir in campaign.items()}
    model = json.loads((next(iter(runs.values())) / "config.json").read_text())["config"]["model"]["path"]
    theta0 = flat_weights(Path(model) if Path(model).is_absolute() else ROOT / model)
    delta = {(k, step): flat_weights(run / "checkpoints" / f"v{step:04d}") - theta0
             for k, run in runs.items() for step in (1, N)}

    report: dict = {"steps": N, "seeds": args.seeds, "runs": {k: str(v) for k, v in runs.items()}, "updates": {}}
    pairs = {
        "bf16 vs fp8, no IS": (("bf16", "never"), ("fp8", "never")),
        "bf16 vs fp8, IS on": (("bf16", "always"), ("fp8", "always")),
        "fp8: IS on vs off": (("fp8", "always"), ("fp8", "never")),
        "bf16: IS on vs off": (("bf16", "always"), ("bf16", "never")),
    }
    table = Table(title="parameter updates: cosine similarity and ‖Δa − Δb‖/‖Δb‖ (mean over seeds [95% t])")
    for column in ("comparison", "cos after 1", "rel. diff after 1", f"cos after {N}", f"rel. diff after {N}"):
        table.add_column(column, justify="right")
    for label, (a, b) in pairs.items():
        cells, raw = {}, {}
        for step in (1, N):
            cos = [cosine(delta[(name(*a, s), step)], delta[(name(*b, s), step)]) for s in range(args.seeds)]
            rel = [relative_norm_difference(delta[(name(*a, s), step)], delta[(name(*b, s), step)])
                   for s in range(args.seeds)]
            cells[step] = (t_interval(cos), t_interval(rel))
            raw[step] = {"cosine": cos, "relative_norm_difference": rel}
        report["updates"][label] = {str(step): {"cosine": c.model_dump(), "relative_norm_difference": r.model_dump(),
                                                "values": raw[step]}  # per seed (or seed pair): the raw result
                                    for step, (c, r) in cells.items()}
        table.add_row(label, fmt(cells[1][0]), fmt(cells[1][1]), fmt(cells[N][0]), fmt(cells[N][1]))
    # The yardstick: the same condition under two different seeds (different tasks and samples).
    for condition in (("bf16", "never"), ("fp8", "never")):
        cells, raw = {}, {}
        for step in (1, N):
            pairs_s = list(itertools.combinations(range(args.seeds), 2))
            cos = [cosine(delta[(name(*condition, s), step)], delta[(name(*condition, t), step)]) for s, t in pairs_s]
            rel = [relative_norm_difference(delta[(name(*condition, s), step)], delta[(name(*condition, t), step)])
                   for s, t in pairs_s]
            cells[step] = (t_interval(cos), t_interval(rel))
            raw[step] = {"cosine": cos, "relative_norm_difference": rel}
        label = f"{condition[0]}, seed vs seed (noise)"
        report["updates"][label] = {str(step): {"cosine": c.model_dump(), "relative_norm_difference": r.model_dump(),
                                                "values": raw[step]}  # per seed pair: the raw result
                                    for step, (c, r) in cells.items()}
        table.add_row(label, fmt(cells[1][0]), fmt(cells[1][1]), fmt(cells[N][0]), fmt(cells[N][1]))
    console.print(table)

    curves = Table(title="correct_rate per step and final held-out accuracy (mean over seeds [95% t])")
    curves.add_column("condition")
    for step in range(1, N + 1):
        curves.add_column(str(step), justify="right")
    curves.add_column("held-out greedy", justify="right")
    curves.add_column("held-out pass@1", justify="right")
    curves.add_column("token ESS", justify="right")
    report["curves"], report["final"] = {}, {}
    for precision, correction in CONDITIONS:
        rows = [[r for r in metrics(runs[name(precision, correction, s)]) if r["step"] > 0] for s in range(args.seeds)]
        finals = [metrics(runs[name(precision, correction, s)])[-1] for s in range(args.seeds)]
        per_step = [t_interval([rs[i]["correct_rate"] for rs in rows]) for i in range(N)]
        greedy = t_interval([f["eval/accuracy/mean"] for f in finals])
        pass1 = t_interval([f["eval/pass@1"] for f in finals])
        ess = t_interval([float(np.mean([r["mismatch/token_ess_mean"] for r in rs])) for rs in rows])
        label = f"{precision}, IS {correction}"
        report["curves"][label] = [i.model_dump() for i in per_step]
        report["final"][label] = {"greedy": greedy.model_dump(), "pass@1": pass1.model_dump(),
                                  "token_ess": ess.model_dump()}
        curves.add_row(label, *[f"{i.mean:.2f}" for i in per_step], fmt(greedy), fmt(pass1), fmt(ess, ".4f"))
    console.print(curves)
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"report: {args.out / 'report.json'}")


if __name__ == "__main__":
    main()
