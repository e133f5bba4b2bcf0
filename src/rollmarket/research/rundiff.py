"""Two training runs side by side: the settings that differ (config.json) and the headline metrics.

For each headline metric: its final value (the last metrics row that has it) and its best over the
run (the highest, or the lowest where lower is better; none for metrics without a better side),
with the step where the best was reached. The held-out evaluation before and after training comes
from summary.json, or from the metrics rows of a run that has not finished.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from ..runs import read_step_rows
from .campaign import flatten

Better = Literal["max", "min"] | None

HEADLINE: dict[str, Better] = {
    "correct_rate": "max",
    "running_correct_rate": "max",
    "mean_reward": "max",
    "eval/accuracy/mean": "max",
    "eval/pass@1": "max",
    "eval/reward/mean": "max",
    "loss": None,
    "actor/entropy": None,
    "actor/grad_norm": None,
    "response_length/mean": None,
    "reward_tie_group_rate": "min",
    "mismatch/token_ess_mean": "max",
    "timing_s/step": "min",
}
"""The metrics `rollmarket diff` shows, and which side of each is better (None: neither)."""

EVAL_KEYS = ("eval/accuracy/mean", "eval/pass@1", "eval/reward/mean")
IGNORED_SETTINGS = ("runs_root",)
"""Settings that differ between any two runs without changing what they do."""


class RunDirError(ValueError):
    """A path is not a training run directory (no config.json with a training config)."""

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.fix = fix


def _read_run(run_dir: Path) -> tuple[dict, list[dict], dict | None]:
    config_path = Path(run_dir) / "config.json"
    try:
        config = json.loads(config_path.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError):
        raise RunDirError(f"{run_dir} is not a training run directory (no readable config.json with a config)",
                          fix="pass run directories that `rollmarket train` or `rollmarket campaign` made") from None
    rows, _ = read_step_rows(Path(run_dir) / "metrics.jsonl")
    summary_path = Path(run_dir) / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
    return config, rows, summary


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def headline(rows: list[dict], key: str, better: Better) -> dict:
    """final (last row with the metric), best and its step, over the training steps (step ≥ 1; the
    evaluation metrics also at step 0)."""
    points = [(r["step"], r[key]) for r in rows if _number(r.get(key)) and (r["step"] >= 1 or key.startswith("eval/"))]
    if not points:
        return {"final": None, "best": None, "best_step": None}
    final = points[-1][1]
    if better is None:
        return {"final": final, "best": None, "best_step": None}
    pick = max if better == "max" else min
    best = pick(v for _, v in points)
    step = next(s for s, v in points if v == best)  # the first step that reached it
    return {"final": final, "best": best, "best_step": step}


def _evaluations(rows: list[dict], summary: dict | None) -> tuple[dict, dict]:
    if summary is not None:
        return summary.get("eval_before") or {}, summary.get("eval_after") or {}
    evaluated = [r for r in rows if any(k in r for k in EVAL_KEYS)]
    before = next((r for r in evaluated if r["step"] == 0), {})
    after = evaluated[-1] if evaluated and evaluated[-1]["step"] > 0 else {}
    return before, after


def diff_runs(run_a: Path, run_b: Path) -> dict:
    """The settings that differ and the headline metrics of two runs, as data (see the module's docstring)."""
    config_a, rows_a, summary_a = _read_run(run_a)
    config_b, rows_b, summary_b = _read_run(run_b)
    flat_a, flat_b = flatten(config_a), flatten(config_b)
    settings = [{"key": k, "a": flat_a.get(k), "b": flat_b.get(k)}
                for k in sorted(flat_a.keys() | flat_b.keys())
                if k not in IGNORED_SETTINGS and flat_a.get(k) != flat_b.get(k)]
    metrics = []
    for key, better in HEADLINE.items():
        a, b = headline(rows_a, key, better), headline(rows_b, key, better)
        if a["final"] is None and b["final"] is None:
            continue
        metrics.append({"key": key, "better": better, "a": a, "b": b})
    (before_a, after_a), (before_b, after_b) = _evaluations(rows_a, summary_a), _evaluations(rows_b, summary_b)
    evaluation = [{"key": k, "a_before": before_a.get(k), "a_after": after_a.get(k),
                   "b_before": before_b.get(k), "b_after": after_b.get(k)}
                  for k in EVAL_KEYS if any(d.get(k) is not None for d in (before_a, after_a, before_b, after_b))]
    return {
        "a": {"dir": str(run_a), "steps": max((r["step"] for r in rows_a), default=0),
              "planned_steps": config_a.get("loop", {}).get("steps"), "finished": summary_a is not None},
        "b": {"dir": str(run_b), "steps": max((r["step"] for r in rows_b), default=0),
              "planned_steps": config_b.get("loop", {}).get("steps"), "finished": summary_b is not None},
        "settings": settings, "metrics": metrics, "evaluation": evaluation,
    }
