"""The campaign page: each condition's mean curve over seeds with its 95% band, each run's status,
and the stats verdicts, read from a campaign directory as `rollmarket campaign` writes it
(campaign.json + runs/<condition>__s<seed>/<stamp-id>/).

The verdicts are `rollmarket stats`'s own (research/stats.py: `campaign_report`, `report_dict`) with
the campaign's declared [stats] settings, so the page and the CLI cannot disagree. research/stats
needs numpy and scipy only: the dashboard never loads torch. Nothing here writes a file
(`rollmarket stats` writes stats.json; reading a page does not).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import Field

from ..contracts import Record
from .data import DashboardError, Missing
from .runs import RunKind, discover

CAMPAIGN_FILE = "campaign.json"
DEFAULT_METRICS = ("eval/pass@1", "critic/rewards/mean")
"""Curves drawn when the URL chooses none: held-out sampled pass@1 and the training reward."""
CONFIDENCE = 0.95
NOT_METRICS = frozenset({"step", "seed", "condition", "policy_version"})
"""Numeric columns of metrics.jsonl that label a row rather than measure it."""


class CurvePoint(Record):
    """One step of a condition's curve: the mean over the seeds that have the metric there."""

    step: int
    n: int = Field(description="Seeds with a value at this step.")
    mean: float
    lo: float | None = Field(description="mean − t_{0.975, n−1}·sd/√n; None when n < 2.")
    hi: float | None = Field(description="mean + t_{0.975, n−1}·sd/√n; None when n < 2.")


class ConditionCurve(Record):
    condition: str
    points: list[CurvePoint]


class MetricCurves(Record):
    """One chart: a metric's curve per condition."""

    metric: str
    conditions: list[ConditionCurve]


class CampaignRun(Record):
    """One (condition, seed) of the campaign as its manifest and run directory have it."""

    condition: str
    seed: int | str
    status: str = Field(description="The manifest's (pending, running, resuming, done, failed); done when the run "
                                    "wrote summary.json.")
    run_id: str | None = Field(description="The run directory's name (<UTC stamp>-<id>): /train/<run_id>.")
    steps: int | None = Field(description="The last step in metrics.jsonl.")
    planned_steps: int | None = Field(description="loop.steps of the run's config.json.")
    final: dict[str, float | None] = Field(description="The chosen metrics' last values.")


class StatsTable(Record):
    """`rollmarket stats` (or `--before-after`) on the campaign, or why it cannot say."""

    report: dict[str, Any] | None = Field(description="research.stats.report_dict: what `rollmarket stats --json` "
                                                       "prints.")
    error: str | None = None
    fix: str | None = None


class CampaignPage(Record):
    campaign_id: str = Field(description="The campaign directory's name.")
    name: str
    path: str
    source: str | None = Field(description="The campaign file it was run from.")
    conditions: list[str]
    seeds: list[int | str]
    stats_settings: dict[str, Any] = Field(description="The campaign's declared [stats] table.")
    metrics_available: list[str] = Field(description="Numeric metrics.jsonl columns any run has.")
    metrics: list[str] = Field(description="The metrics drawn (?metric=, else eval/pass@1 and critic/rewards/mean).")
    curves: list[MetricCurves]
    runs: list[CampaignRun]
    verdicts: StatsTable = Field(description="Each condition against the baseline (`rollmarket stats --json`).")
    before_after: StatsTable = Field(description="Each condition against itself before training "
                                                 "(`rollmarket stats --before-after --json`).")


# ----------------------------------------------------------------------------- finding campaigns


def _campaign_dirs(runs_dir: Path) -> dict[str, Path]:
    """Campaign directories (holding campaign.json) under `runs_dir`, or `runs_dir` itself, by name
    (runs.py's discovery: the shallowest of two with one name wins)."""
    return {run_id: f.path for run_id, f in discover(Path(runs_dir)).items() if f.kind is RunKind.campaign}


class Campaigns:
    """The campaign directories under one --runs directory."""

    def __init__(self, runs_dir: Path):
        self.runs_dir = Path(runs_dir)

    def ids(self) -> list[str]:
        """Every campaign's id (its directory's name), sorted."""
        return sorted(_campaign_dirs(self.runs_dir))

    def campaign_dir(self, campaign_id: str) -> Path:
        """The directory of `campaign_id`; a typed 404 when no campaign has that name."""
        path = _campaign_dirs(self.runs_dir).get(campaign_id)
        if path is None:
            raise DashboardError(Missing.campaign, f"no campaign {campaign_id!r} under {self.runs_dir}",
                                 campaign_id=campaign_id)
        return path

    def page(self, campaign_id: str, metrics: list[str] | None = None) -> CampaignPage:
        """The campaign page; `metrics` chooses the curves (unknown ones are a typed 404)."""
        from ..research import stats

        path = self.campaign_dir(campaign_id)
        try:
            manifest = json.loads((path / CAMPAIGN_FILE).read_text())
            campaign = stats.load_campaign(path)
        except (ValueError, OSError) as exc:  # StatsError is a ValueError
            raise DashboardError(Missing.unreadable_run, f"{path / CAMPAIGN_FILE}: {exc}",
                                 campaign_id=campaign_id) from None
        runs_of = {c: campaign.runs[c] for c in campaign.conditions}
        available = sorted({k for runs in runs_of.values() for run in runs for row in run.rows
                            for k, v in row.items() if _number(v) is not None and k not in NOT_METRICS})
        if metrics:
            unknown = [m for m in metrics if m not in available]
            if unknown:
                raise DashboardError(Missing.metric, f"campaign {campaign_id!r} has no metric {unknown[0]!r}",
                                     campaign_id=campaign_id, metric=unknown[0])
            chosen = list(dict.fromkeys(metrics))
        else:
            chosen = [m for m in DEFAULT_METRICS if m in available]
        curves = [MetricCurves(metric=m, conditions=[ConditionCurve(condition=c, points=_curve(runs_of[c], m))
                                                     for c in campaign.conditions]) for m in chosen]
        return CampaignPage(
            campaign_id=campaign_id, name=campaign.name, path=str(path), source=manifest.get("source"),
            conditions=campaign.conditions, seeds=list(manifest.get("seeds") or []),
            stats_settings=campaign.stats, metrics_available=available, metrics=chosen, curves=curves,
            runs=_runs(path, manifest, campaign, chosen),
            verdicts=_stats(lambda: stats.campaign_report(campaign)),
            before_after=_stats(lambda: stats.campaign_report(campaign, before_after=True)))


# ----------------------------------------------------------------------------- the numbers


def _number(value: Any) -> float | None:
    """A finite number as float; None for null, text, booleans and NaN/inf (no point on a curve)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _curve(runs: list, metric: str) -> list[CurvePoint]:
    """Mean over seeds per step, with the t interval over the seeds that have the step (never
    pooling steps: the seed is the unit of replication, docs/statistics.md)."""
    from scipy.stats import t

    by_step: dict[int, list[float]] = {}
    for run in runs:
        for row in run.rows:
            value = _number(row.get(metric))
            if value is not None:
                by_step.setdefault(row["step"], []).append(value)
    points = []
    for step in sorted(by_step):
        values = by_step[step]
        n = len(values)
        mean = sum(values) / n
        lo = hi = None
        if n >= 2:
            sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
            half = float(t.ppf(0.5 + CONFIDENCE / 2, n - 1)) * sd / math.sqrt(n)
            lo, hi = mean - half, mean + half
        points.append(CurvePoint(step=step, n=n, mean=mean, lo=lo, hi=hi))
    return points


def _runs(path: Path, manifest: dict, campaign, metrics: list[str]) -> list[CampaignRun]:
    """The manifest's runs in its order, including those with no data yet (pending, or started
    without a metrics row)."""
    loaded = {(r.condition, r.seed): r for runs in campaign.runs.values() for r in runs}
    out = []
    for entry in manifest.get("runs") or []:
        condition, seed = entry.get("condition"), entry.get("seed")
        run = loaded.get((condition, seed))
        run_dir = run.path if run is not None else (path / entry["dir"] if entry.get("dir") else None)
        status = entry.get("status") or "pending"
        if run_dir is not None and (run_dir / "summary.json").is_file():
            status = "done"
        planned = None
        if run is not None and run.config:
            planned = ((run.config.get("config") or {}).get("loop") or {}).get("steps")
        final = {}
        for m in metrics:
            values = [_number(row.get(m)) for row in (run.rows if run else [])]
            final[m] = next((v for v in reversed(values) if v is not None), None)
        out.append(CampaignRun(condition=str(condition), seed=seed, status=status,
                               run_id=run_dir.name if run_dir is not None and run_dir.is_dir() else None,
                               steps=run.rows[-1]["step"] if run and run.rows else None,
                               planned_steps=planned if isinstance(planned, int) else None, final=final))
    return out


def _stats(report) -> StatsTable:
    """`report()`'s JSON, or the StatsError it raised: the page shows why stats cannot decide."""
    from ..research.stats import StatsError, report_dict

    try:
        return StatsTable(report=report_dict(report()))
    except StatsError as exc:
        return StatsTable(report=None, error=str(exc), fix=exc.fix)
