"""Shared by the experiment scripts: run `rollmarket train --local` runs side by side, read them back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

ROOT = Path(__file__).resolve().parent.parent


def run_all(jobs: dict[str, list[str]], out: Path, *, parallel: int, config: Path, console: Console) -> dict[str, Path]:
    """Run each named list of overrides as `rollmarket train CONFIG --local`; skip names already done.

    Each run goes under out/<name>/ (its only run directory); the log goes to out/<name>.log.
    """
    out.mkdir(parents=True, exist_ok=True)

    def one(name: str) -> Path:
        root = out / name
        done = [p for p in root.glob("*/summary.json")]
        if done:
            return done[0].parent
        for partial in root.glob("*"):  # an interrupted run is started over
            subprocess.run(["rm", "-rf", str(partial)], check=True)
        cmd = [sys.executable, "-m", "rollmarket", "train", str(config), "--local", *jobs[name],
               f"runs_root={json.dumps(str(root))}"]
        with open(out / f"{name}.log", "w") as log:
            code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        if code:
            raise RuntimeError(f"{name} failed ({code}); see {out / (name + '.log')}")
        return next(root.glob("*/summary.json")).parent

    started = time.monotonic()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress, ThreadPoolExecutor(parallel) as pool:
        bar = progress.add_task("training runs", total=len(jobs))
        futures = {name: pool.submit(one, name) for name in jobs}
        result = {}
        for name, future in futures.items():
            result[name] = future.result()
            progress.advance(bar)
    console.print(f"{len(jobs)} runs in {(time.monotonic() - started) / 60:.1f} min")
    return result


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
