"""The training run page (`/train/<id>`): a run's metrics.jsonl as columns, its held-out evaluation
with a 95% interval over tasks from evals.jsonl, and the charts the page draws by default.

Columns are built incrementally (runs.MetricColumns): only the rows appended since the last request
are parsed and added, so a live run's page and its poll (`/train/<id>/metrics.json?after=N`)
cost the new steps. Nothing here imports torch (the dashboard is a service).
"""

from __future__ import annotations

import math
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field

from ..contracts import Record
from .data import DashboardError, Missing
from .runs import COLUMNS, TAIL, RunEntry, RunIndex, RunKind, RunStatus, read_json, stat_key

POLL_S = 2.0
"""How often a running run's page asks for new steps."""
EVAL_METRICS = ("eval/pass@1", "eval/accuracy/mean")
"""Held-out metrics drawn with an interval band, computed per task from evals.jsonl."""
GATE_TIERS = ("gate/train", "gate/train_with_correction", "gate/replay", "gate/quarantine")
MAX_OVERLAYS = 8


class EvalPoint(Record):
    """One held-out metric at one evaluation: the mean over tasks and its 95% t interval."""

    step: int
    metric: str = Field(description="eval/pass@1 (per task: share of sampled runs passed) or eval/accuracy/mean "
                                    "(per task: the greedy run passed).")
    n_tasks: int
    mean: float
    lo: float | None = Field(description="mean − t(0.975, n−1)·sd/√n over tasks; None with one task.")
    hi: float | None


class Series(Record):
    """A run's metrics as columns (the keys asked for, or every numeric key of metrics.jsonl), from
    step `after` on."""

    run_id: str
    status: RunStatus
    after: int | None = Field(description="Only steps > after are here; None: every step.")
    steps: list[int]
    wall_s: list[float] = Field(description="Seconds since the start: the running sum of timing_s/step.")
    tokens: list[float] = Field(description="Response tokens so far: the running sum of perf/total_num_tokens.")
    columns: dict[str, list[float | None]] = Field(description="The keys asked for (every numeric key when none "
                                                               "were; a key the file lacks is absent), one value "
                                                               "per step (null where a row lacks it).")
    names: list[str] = Field(description="Every numeric key of the file, sorted: what the chooser offers.")
    evals: list[EvalPoint] = Field(description="Evaluations at steps > after, from evals.jsonl.")
    last_step: int | None = Field(description="The newest step in the file: the next poll's `after`.")


class PickedColumns(Record):
    """Metrics the page did not carry, fetched when the chooser picks one
    (`/train/<id>/columns.json?keys=K`; in a static export, a script per key beside the page)."""

    run_id: str
    last_step: int | None = Field(description="The newest step in the file when read.")
    columns: dict[str, list[float | None]] = Field(description="Each key asked for that the file has, one value per "
                                                               "step from the first (as Series.columns).")


class Panel(Record):
    """One chart of the page."""

    id: str
    title: str
    keys: list[str] = Field(description="The metrics.jsonl keys it draws, each a line (or a stacked bar).")
    kind: Literal["line", "stacked"] = "line"
    band: bool = Field(default=False, description="Draw the 95% interval over tasks of eval keys.")


class TrainPage(Record):
    run: RunEntry
    config: dict[str, Any] = Field(description="config.json as the run wrote it.")
    summary: dict[str, Any] | None = Field(description="summary.json, once the run finished.")
    groups: dict[str, list[str]] = Field(description="The metric chooser: every numeric key by its prefix.")
    panels: list[Panel] = Field(description="The charts drawn by default (those whose keys the run has).")
    metrics: Series = Field(description="The run's steps with only the columns the default panels draw; the page "
                                        "fetches any other when it is chosen.")
    overlays: list[Series] = Field(description="Other runs drawn on the same charts (?overlay=<id>,<id>), with the "
                                               "same columns.")
    rollouts: bool = Field(description="Whether generations.jsonl exists (the rollouts table has rows).")
    poll_s: float = POLL_S


# ----------------------------------------------------------------------------- held-out evaluation


@lru_cache(maxsize=256)
def t_critical(df: int) -> float:
    """Student t's 97.5% quantile with `df` degrees of freedom (scipy, imported only here)."""
    from scipy import stats

    return float(stats.t.ppf(0.975, df))


def t_band(values: list[float]) -> tuple[float, float | None, float | None]:
    """mean and the 95% t interval over `values` (one value per held-out task)."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, None, None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_critical(n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def per_task(row: dict, metric: str) -> float | None:
    """A task's value of an eval metric from its evals.jsonl row."""
    if metric == "eval/pass@1":
        passed = row.get("sampled_passed") or []
        return sum(map(bool, passed)) / len(passed) if passed else None
    greedy = row.get("greedy_passed")
    return None if greedy is None else float(bool(greedy))


@lru_cache(maxsize=64)
def _eval_points(key: tuple[str, int, int]) -> tuple[EvalPoint, ...]:
    rows = TAIL.rows(Path(key[0]))
    by_step: dict[int, list[dict]] = {}
    for row in rows:
        if isinstance(row.get("step"), int) and row.get("task_id") is not None:
            by_step.setdefault(row["step"], []).append(row)
    points = []
    for step in sorted(by_step):
        for metric in EVAL_METRICS:
            values = [v for v in (per_task(r, metric) for r in by_step[step]) if v is not None]
            if values:
                mean, lo, hi = t_band(values)
                points.append(EvalPoint(step=step, metric=metric, n_tasks=len(values), mean=mean, lo=lo, hi=hi))
    return tuple(points)


def eval_points(run_dir: Path) -> tuple[EvalPoint, ...]:
    """Held-out metrics per evaluation, recomputed when evals.jsonl changes (by size and mtime)."""
    key = stat_key(run_dir / "evals.jsonl")
    return () if key is None else _eval_points(key)


# ----------------------------------------------------------------------------- default charts


def default_panels(keys: set[str]) -> list[Panel]:
    """The charts every training run page starts with, each with the keys this run has."""
    precisions = sorted({k.split("/")[1] for k in keys if k.startswith("mismatch/") and k.count("/") == 2})
    timings = sorted(k for k in keys if k.startswith("timing_s/"))
    wanted = [
        Panel(id="heldout", title="Held-out accuracy and pass@1 (95% interval over tasks)",
              keys=list(EVAL_METRICS), band=True),
        Panel(id="rewards", title="Rewards (critic/rewards/mean)", keys=["critic/rewards/mean"]),
        Panel(id="correct", title="Correct rate", keys=["correct_rate", "running_correct_rate"]),
        Panel(id="entropy", title="Entropy", keys=["actor/entropy"]),
        Panel(id="kl", title="KL", keys=["actor/ppo_kl", "actor/kl_ref", "rollout_corr/kl"]),
        Panel(id="grad_norm", title="Gradient norm", keys=["actor/grad_norm"]),
        Panel(id="clipfrac", title="Clip fraction", keys=["actor/pg_clipfrac", "response_length/clip_ratio"]),
        Panel(id="length", title="Response length", keys=["response_length/mean", "response_length/max"]),
        Panel(id="ess", title="Mismatch: token ESS by precision",
              keys=[f"mismatch/{p}/token_ess_mean" for p in precisions]),
        Panel(id="delta", title="Mismatch: mean |Δlogp| by precision",
              keys=[f"mismatch/{p}/mean_abs_delta" for p in precisions]),
        Panel(id="flips", title="Mismatch: router flip rate by precision",
              keys=[f"mismatch/{p}/router_flip_rate" for p in precisions]),
        Panel(id="gate", title="Gate decisions per step", keys=list(GATE_TIERS), kind="stacked"),
        Panel(id="timings", title="Timings (s)", keys=timings),
        Panel(id="throughput", title="Throughput (trained tokens/s)", keys=["perf/throughput"]),
    ]
    out = []
    for panel in wanted:
        have = [k for k in panel.keys if k in keys]
        if have:
            out.append(panel.model_copy(update={"keys": have}))
    return out


def key_groups(keys: set[str]) -> dict[str, list[str]]:
    """Keys by prefix (the part before the first '/'; 'other' for plain names), sorted."""
    groups: dict[str, list[str]] = {}
    for key in sorted(keys):
        groups.setdefault(key.split("/", 1)[0] if "/" in key else "other", []).append(key)
    return dict(sorted(groups.items()))


# ----------------------------------------------------------------------------- pages


def bad_query(message: str, **details: Any) -> DashboardError:
    return DashboardError(Missing.bad_query, message, **details)


def parse_keys(keys: list[str] | None, *, required: bool = False) -> list[str] | None:
    """`?keys=K&keys=L` (repeated: a metric's name may hold any character) as a list; None when absent.
    Where keys are `required`, none is a typed 400."""
    keys = [k for k in keys or () if k]
    if required and not keys:
        raise bad_query("name the metrics to read: ?keys=<metric>&keys=<metric>…", parameter="keys")
    return keys or None


def parse_after(text: str | None) -> int | None:
    """`?after=` as a step number (None when absent); anything else is a typed 400."""
    if text is None or text == "":
        return None
    try:
        return int(text)
    except ValueError:
        raise bad_query(f"after={text!r} is not a step number", parameter="after") from None


class TrainingRuns:
    """The training (and demo) runs of a RunIndex, as pages."""

    def __init__(self, index: RunIndex):
        self.index = index

    def entry(self, run_id: str) -> tuple[RunEntry, Path]:
        found = self.index.find().get(run_id)
        if found is None or found.kind not in (RunKind.train, RunKind.demo):
            raise DashboardError(Missing.run, f"no training run {run_id!r} under {self.index.runs_dir}",
                                 run_id=run_id)
        return self.index.entry(found), found.path

    def series(self, run_id: str, after: int | None = None, keys: list[str] | None = None) -> Series:
        """The run's steps > `after` with the columns of `keys` (every column when None)."""
        entry, path = self.entry(run_id)
        return self._series(entry, path, after, keys)

    def columns(self, run_id: str, keys: list[str]) -> PickedColumns:
        """Whole columns of `keys` (those the run has), for a chart the page adds."""
        _, path = self.entry(run_id)
        view = COLUMNS.view(path / "metrics.jsonl", None, keys)
        return PickedColumns.model_construct(run_id=run_id, last_step=view.last_step, columns=view.columns)

    @staticmethod
    def _series(entry: RunEntry, path: Path, after: int | None, keys: list[str] | None) -> Series:
        view = COLUMNS.view(path / "metrics.jsonl", after, keys)
        last = view.last_step
        # An evaluation is written before its step's metrics row: it shows with that row, once.
        evals = [p for p in eval_points(path) if last is not None and p.step <= last and (after is None or p.step > after)]
        # Built without validation: the columns are floats and Nones by construction (runs.Columns), and
        # checking a million of them again would cost more than reading them.
        return Series.model_construct(run_id=entry.run_id, status=entry.status, after=after, steps=view.steps,
                                      wall_s=view.wall_s, tokens=view.tokens, columns=view.columns,
                                      names=view.names, evals=evals, last_step=last)

    def page(self, run_id: str, overlay: str | None = None) -> TrainPage:
        entry, path = self.entry(run_id)
        ids = [i for i in (overlay or "").split(",") if i and i != run_id]
        if len(ids) > MAX_OVERLAYS:
            raise bad_query(f"at most {MAX_OVERLAYS} runs overlay one page", parameter="overlay")
        # Only the default panels' columns travel with the page: a 10,000-step run's every metric is
        # ~16 MB of JSON that takes seconds to parse and draw; the chooser fetches the others.
        names = COLUMNS.view(path / "metrics.jsonl", None, ()).names
        panels = default_panels(set(names) | {p.metric for p in eval_points(path)})
        drawn = [k for panel in panels for k in panel.keys]
        overlays = [self.series(i, None, drawn) for i in dict.fromkeys(ids)]
        metrics = self._series(entry, path, None, drawn)
        try:
            config = read_json(path / "config.json") or {}
            summary = read_json(path / "summary.json")
            if not isinstance(config, dict) or not isinstance(summary, (dict, type(None))):
                raise ValueError("config.json and summary.json must hold JSON objects")
        except ValueError as exc:
            raise DashboardError(Missing.unreadable_run, f"{path}: {exc}", run_id=run_id) from None
        return TrainPage(run=entry, config=config, summary=summary, groups=key_groups(set(metrics.names)),
                         panels=panels, metrics=metrics, overlays=overlays,
                         rollouts=(path / "generations.jsonl").is_file())
