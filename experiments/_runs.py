"""Shared by the experiment scripts: run conditions × seeds as a campaign, read the runs back."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
from rich.console import Console

ROOT = Path(__file__).resolve().parent.parent


def run_campaign(name: str, config: Path, conditions: dict[str, dict], seeds: list[int], out: Path, *,
                 overrides: list[str], parallel: int, console: Console) -> dict[tuple[str, int], Path]:
    """Run conditions × seeds over CONFIG as a campaign (rollmarket.research.campaign) in `out`;
    (condition, seed) → run directory. Running it again resumes it (finished runs are skipped).

    The campaign file it amounts to is kept in out/campaign.json, so `rollmarket campaign` can rerun it.
    """
    from rollmarket.cli.campaign import run_live
    from rollmarket.research.campaign import CampaignRunner, campaign_toml, parse_campaign

    out, config = out.resolve(), config.resolve()
    os.chdir(ROOT)  # the configs' relative paths (model.path) are the repository's, wherever the script starts
    text = campaign_toml(config, name=name, seeds=seeds, conditions=conditions, seed_mode="all")
    plan = parse_campaign(text, source=str(config), overrides=overrides)
    runner = CampaignRunner(plan, out, parallel=parallel)
    started = time.monotonic()
    run_live(runner, console, f"{name}: {len(plan.runs)} runs, {runner.parallel} at once")
    console.print(f"{len(plan.runs)} runs in {(time.monotonic() - started) / 60:.1f} min")
    return {(s.condition, s.seed): s.run_dir for s in runner.statuses}


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def evals(run_dir: Path) -> dict[int, list[dict]]:
    """Per-task evaluation rows by step."""
    out: dict[int, list[dict]] = {}
    for line in (run_dir / "evals.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.setdefault(row["step"], []).append(row)
    return out


def flat_weights(path: Path) -> np.ndarray:
    """Every tensor of a checkpoint's model.safetensors, in name order, as one float64 vector."""
    from safetensors.numpy import load_file

    tensors = load_file(str(path / "model.safetensors"))
    return np.concatenate([tensors[k].astype(np.float64).ravel() for k in sorted(tensors)])
