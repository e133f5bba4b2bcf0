"""Statistics over training runs with the seed as the unit of replication (docs/statistics.md).

Each run gives ONE number per declared metric (final held-out pass@1 by default, the area under a
metric's curve, or any metrics key at a step). Runs of two conditions are paired by their seed, and
everything below works on the per-seed differences d_N = candidate − baseline:

    exact sign-flip test       two-sided p = #{s in {±1}^n : |Σ s·d| ≥ |Σ d|} / 2^n, every flip
                               enumerated for n ≤ EXACT_MAX_SEEDS, else (1 + hits) / (1 + draws)
                               over seeded random flips (Monte Carlo, stated in the report)
    t interval                 mean(d) ± t_{1−α/2, n−1} · sd(d) / √n
    paired Cohen's d           d_z = mean(d) / sd(d), interval by inverting the noncentral t
    power, MDE, seeds needed   paired t-test at level α, power 0.8 (noncentral t)
    TOST equivalence           two one-sided paired t-tests against ±margin; p = the larger
    Holm                       across the declared metrics of one comparison
    two-way bootstrap          with per-task evals: resample seeds and tasks independently

Steps and episodes are never pooled across seeds: they are not independent replicates of a
training run (pseudo-replication), and pooling them makes p-values far too small.

Library only: numpy and scipy, no torch; the CLI (cli/stats.py) prints and writes.
"""

from __future__ import annotations

import difflib
import glob
import json
import math
import re
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Sequence

import numpy as np

EXACT_MAX_SEEDS = 20
"""Seeds up to which the sign-flip test enumerates all 2^n flips (2^20 ≈ 1M sums)."""
MC_DRAWS = 100_000
"""Random sign flips of the Monte Carlo test beyond EXACT_MAX_SEEDS."""
BOOTSTRAP_RESAMPLES = 2000
"""Resamples of the two-way (seed, task) bootstrap."""
MIN_SAMPLES_PER_TASK = 16
"""Sampled runs per held-out task below which a pass@k claim is INCONCLUSIVE (issue 13: ≥16)."""
POWER = 0.8
DEFAULT_METRIC = "eval/pass@1@final"
STATS_KEYS = ("metrics", "baseline", "alpha", "equivalence_margin", "target_effect", "power")
"""Keys of the campaign file's [stats] table."""
PER_TASK_KEYS = ("eval/accuracy/mean", "eval/reward/mean")
"""Metrics keys (besides eval/pass@k) that evals.jsonl holds per task."""


# ---------------------------------------------------------------------------------------------
# Errors


class StatsError(ValueError):
    """Input `rollmarket stats` / `compare` cannot use; `fix` says what to do instead."""

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.fix = fix


class UnpairedSeeds(StatsError):
    """The two sides do not have the same seeds (or one side has a seed twice)."""


class MissingMetric(StatsError):
    """A run has no value for a declared metric (where it was asked for)."""


class TooFewSeeds(StatsError):
    """Fewer than 2 paired seeds: no spread, no test."""


class UnknownCondition(StatsError):
    """A condition the campaign does not have."""


class BadMetricSpec(StatsError):
    """A metric spec that does not parse."""


class BadSettings(StatsError):
    """A [stats] setting out of range or unknown."""


class NotARunDir(StatsError):
    """A path with no run (metrics.jsonl) in or under it, or a directory without campaign.json."""


# ---------------------------------------------------------------------------------------------
# Metric specs


@dataclass(frozen=True)
class Metric:
    """One number per run: `key` (a metrics.jsonl column) at `at` = "final", "auc" or a step."""

    key: str
    at: str | int = "final"
    higher_is_better: bool = True

    @classmethod
    def parse(cls, text: str) -> "Metric":
        """`KEY@final`, `KEY@auc` or `KEY@STEP`, optionally followed by `:lower` (lower is better) or
        `:higher` (the default). The last `@` splits, so `eval/pass@1@final` is eval/pass@1 at the
        end, and a bare `eval/pass@1` would mean key `eval/pass` at step 1: always give the `@…`."""
        spec = text.strip()
        higher = True
        if spec.endswith((":lower", ":higher")):
            spec, direction = spec.rsplit(":", 1)
            higher = direction == "higher"
        key, sep, at = spec.rpartition("@")
        if not sep or not key:
            raise BadMetricSpec(f"metric {text!r} names no step", fix="write KEY@final, KEY@auc or KEY@STEP, "
                                                                      "e.g. eval/pass@1@final")
        if at in ("final", "auc"):
            return cls(key, at, higher)
        if re.fullmatch(r"\d+", at):
            return cls(key, int(at), higher)
        raise BadMetricSpec(f"metric {text!r}: {at!r} is not final, auc or a step number",
                            fix="write KEY@final, KEY@auc or KEY@STEP, e.g. eval/pass@1@final")

    @property
    def spec(self) -> str:
        return f"{self.key}@{self.at}" + ("" if self.higher_is_better else ":lower")

    @property
    def pass_at_k(self) -> int | None:
        """k when the key is the held-out eval/pass@k, else None."""
        found = re.fullmatch(r"eval/pass@(\d+)", self.key)
        return int(found.group(1)) if found else None

    @property
    def per_task(self) -> bool:
        """Whether evals.jsonl holds this metric per task (for the two-way bootstrap)."""
        return self.at != "auc" and (self.pass_at_k is not None or self.key in PER_TASK_KEYS)


# ---------------------------------------------------------------------------------------------
# Runs and campaigns on disk


def _read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file; a torn last line (a run killed mid-write) is left out."""
    rows: list[dict] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise NotARunDir(f"{path}: line {number} is not JSON", fix="repair or remove the line") from None
        if isinstance(row, dict):
            rows.append(row)
    return rows


@dataclass
class Run:
    """A training run directory: its metrics rows (one per step), seed label and condition."""

    path: Path
    seed: int | str
    condition: str | None
    rows: list[dict]
    config: dict | None = None
    _evals: list[dict] | None = field(default=None, repr=False)

    def evals(self) -> list[dict]:
        """evals.jsonl's rows (one per held-out task per evaluation); [] when there is none."""
        if self._evals is None:
            file = self.path / "evals.jsonl"
            self._evals = _read_jsonl(file) if file.is_file() else []
        return self._evals

    def eval_samples_setting(self) -> int | None:
        """eval.samples from config.json, when the run has one."""
        try:
            return int(self.config["config"]["eval"]["samples"])  # type: ignore[index]
        except (TypeError, KeyError, ValueError):
            return None


def _config_seed(config: dict | None) -> int | str | None:
    """The seed label of a run outside a campaign: labels.seed, else its seed settings."""
    cfg = (config or {}).get("config")
    if not isinstance(cfg, dict):
        return None
    label = (cfg.get("labels") or {}).get("seed")
    if label is not None:
        return label
    rollout = cfg.get("rollout") or {}
    seeds = {"seed": cfg.get("seed"), "rollout.seed": rollout.get("seed"),
             "rollout.sampling_seed": rollout.get("sampling_seed")}
    seeds = {k: v for k, v in seeds.items() if v is not None}
    if not seeds:
        return None
    if len(set(seeds.values())) == 1:
        return next(iter(seeds.values()))
    return ",".join(f"{k}={v}" for k, v in seeds.items())


def load_run(path: Path | str, *, seed: int | str | None = None, condition: str | None = None) -> Run:
    """The run at `path` (a directory with metrics.jsonl). Its seed label is `seed` when given,
    else the metrics rows' `seed`, else config.json's labels.seed, else its seed settings."""
    path = Path(path)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise NotARunDir(f"{path} is not a training run directory (no metrics.jsonl)",
                         fix="pass a directory `rollmarket train` wrote")
    by_step: dict[int, dict] = {}
    for row in _read_jsonl(metrics):
        if isinstance(row.get("step"), int):
            by_step[row["step"]] = row  # a re-written step (resume) replaces the earlier row
    rows = [by_step[s] for s in sorted(by_step)]
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text()) if config_file.is_file() else None
    except json.JSONDecodeError as exc:
        raise NotARunDir(f"{config_file} is not JSON ({exc})") from None
    if seed is None:
        seed = next((r["seed"] for r in rows if r.get("seed") is not None), None)
    if seed is None:
        seed = _config_seed(config)
    if seed is None:
        raise UnpairedSeeds(f"{path}: no seed label in metrics.jsonl or config.json",
                            fix="runs are paired by seed; train with labels.seed=N (rollmarket campaign sets it)")
    if condition is None:
        condition = next((r["condition"] for r in rows if r.get("condition") is not None), None)
    return Run(path=path, seed=seed, condition=condition, rows=rows, config=config)


def before_training(run: Run) -> Run:
    """The run as it stood before its first optimizer step: only its step-0 row (the evaluation
    `rollmarket train` makes before training) and step-0 evals, so that `KEY@final` of the view is
    the starting value. Paired with the run itself, it measures what training changed, seed by seed."""
    rows = [r for r in run.rows if r.get("step") == 0]
    if not rows:
        raise MissingMetric(f"{run.path}: no step-0 row (the evaluation before training)",
                            fix="train with eval.tasks > 0: the run evaluates before its first step")
    return Run(path=run.path, seed=run.seed, condition=run.condition, rows=rows, config=run.config,
               _evals=[r for r in run.evals() if r.get("step") == 0])


def resolve_run_dirs(pattern: str | Path) -> list[Path]:
    """Run directories named by `pattern`: a run directory, a glob of them, or a directory whose
    immediate subdirectories are runs (a campaign's runs/<condition>__s<seed>/)."""
    text = str(pattern)
    paths = [Path(p) for p in sorted(glob.glob(text))] if glob.has_magic(text) else [Path(text)]
    found: list[Path] = []
    for path in paths:
        if (path / "metrics.jsonl").is_file():
            found.append(path)
        elif path.is_dir():
            found += sorted(p for p in path.iterdir() if (p / "metrics.jsonl").is_file())
    if not found:
        raise NotARunDir(f"{text}: no training run there (no metrics.jsonl in it or its subdirectories)",
                         fix="pass run directories or a glob such as 'runs/grpo__s*'")
    return found


@dataclass
class Campaign:
    """A campaign directory as `rollmarket campaign` writes it (campaign.json and runs/)."""

    path: Path
    name: str
    conditions: list[str]
    runs: dict[str, list[Run]]
    stats: dict
    missing: list[dict]
    """Manifest runs without data yet (pending, running without a row, failed): condition, seed, status."""


def load_campaign(path: Path | str) -> Campaign:
    """Read CAMPAIGN_DIR/campaign.json and the runs it lists (their seed is the manifest's)."""
    path = Path(path)
    manifest_file = path / "campaign.json"
    if not manifest_file.is_file():
        raise NotARunDir(f"{path} is not a campaign directory (no campaign.json)",
                         fix="pass the directory `rollmarket campaign` wrote, or compare runs with "
                             "`rollmarket compare`")
    try:
        manifest = json.loads(manifest_file.read_text())
        conditions = [c["name"] for c in manifest["conditions"]]
        entries = list(manifest.get("runs") or [])
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise NotARunDir(f"{manifest_file}: not a campaign manifest ({exc})") from None
    runs: dict[str, list[Run]] = {name: [] for name in conditions}
    missing: list[dict] = []
    for entry in entries:
        condition, seed, where = entry.get("condition"), entry.get("seed"), entry.get("dir")
        run_dir = path / where if where else None
        if run_dir is not None and not (run_dir / "metrics.jsonl").is_file():
            inner = sorted(p for p in run_dir.iterdir() if (p / "metrics.jsonl").is_file()) if run_dir.is_dir() else []
            run_dir = inner[-1] if inner else None
        if run_dir is None or condition not in runs:
            missing.append({"condition": condition, "seed": seed, "status": entry.get("status", "no data")})
            continue
        run = load_run(run_dir, seed=seed, condition=condition)
        if not run.rows:
            missing.append({"condition": condition, "seed": seed, "status": entry.get("status", "no rows")})
            continue
        runs[condition].append(run)
    stats = manifest.get("stats") or {}
    if not isinstance(stats, dict):
        raise BadSettings(f"{manifest_file}: stats must be a table")
    return Campaign(path=path, name=str(manifest.get("name", path.name)), conditions=conditions, runs=runs,
                    stats=stats, missing=missing)


# ---------------------------------------------------------------------------------------------
# One number per run


@dataclass(frozen=True)
class RunValue:
    """A run's value of one metric and where it came from."""

    value: float
    step: int | None
    """The step read (final or a named step); None for an area under the curve."""
    span: tuple[int, int] | None = None
    """First and last step of an area under the curve."""


def _points(run: Run, key: str) -> list[tuple[int, float]]:
    out = []
    for row in run.rows:
        value = row.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise MissingMetric(f"{run.path}: {key} at step {row['step']} is {value!r}, not a finite number")
        out.append((row["step"], float(value)))
    return out


def metric_value(run: Run, metric: Metric) -> RunValue:
    """`metric` of one run: the last non-null value (final), the value at a step, or the area under
    the curve (trapezoid over the steps that have the key, divided by the step span: the curve's
    mean height, in the metric's own units)."""
    points = _points(run, metric.key)
    if not points:
        keys = sorted({k for row in run.rows for k, v in row.items() if v is not None})
        close = difflib.get_close_matches(metric.key, keys, n=3)
        fix = f"did you mean {', '.join(close)}?" if close else "pick a key metrics.jsonl has (docs/metrics.md)"
        if metric.key.startswith("eval/"):
            fix += " (eval/* keys appear only when eval.tasks > 0)"
        raise MissingMetric(f"{run.path}: no value of {metric.key} in metrics.jsonl", fix=fix)
    if metric.at == "final":
        step, value = points[-1]
        return RunValue(value, step)
    if metric.at == "auc":
        if len(points) < 2:
            raise MissingMetric(f"{run.path}: {metric.key} has one step ({points[0][0]}); an area needs two",
                                fix="evaluate more often (eval.every) or use @final")
        x = np.array([p[0] for p in points], dtype=np.float64)
        y = np.array([p[1] for p in points], dtype=np.float64)
        area = float(np.sum((x[1:] - x[:-1]) * (y[1:] + y[:-1]) / 2.0))
        return RunValue(area / float(x[-1] - x[0]), None, (points[0][0], points[-1][0]))
    for step, value in points:
        if step == metric.at:
            return RunValue(value, step)
    raise MissingMetric(f"{run.path}: no value of {metric.key} at step {metric.at}",
                        fix=f"steps with it: {', '.join(str(p[0]) for p in points[:12])}")


def per_task_values(run: Run, metric: Metric, step: int) -> dict[str, float] | None:
    """The metric per held-out task at `step` from evals.jsonl (pass@k per task, greedy pass,
    mean sampled reward); None when the run has no per-task rows there."""
    if not metric.per_task:
        return None
    rows = [r for r in run.evals() if r.get("step") == step and r.get("task_id") is not None]
    if not rows:
        return None
    from ..verifiers.profile import pass_at_k

    out: dict[str, float] = {}
    k = metric.pass_at_k
    for row in rows:
        if k is not None:
            passed = list(row.get("sampled_passed") or [])
            value = pass_at_k(len(passed), sum(map(bool, passed)), k)
        elif metric.key == "eval/accuracy/mean":
            value = float(bool(row.get("greedy_passed")))
        else:
            rewards = list(row.get("sampled_rewards") or [])
            value = float(np.mean(rewards)) if rewards else None
        if value is not None:
            out[str(row["task_id"])] = float(value)
    return out or None


def samples_per_task(run: Run, step: int | None) -> int | None:
    """The fewest sampled runs of any held-out task at `step` (evals.jsonl), else eval.samples."""
    rows = [r for r in run.evals() if step is None or r.get("step") == step]
    if rows:
        return min(len(r.get("sampled_passed") or []) for r in rows)
    return run.eval_samples_setting()


# ---------------------------------------------------------------------------------------------
# The tests


@dataclass(frozen=True)
class SignFlip:
    """The sign-flip (paired permutation) test of mean(d) = 0, two-sided."""

    p: float
    exact: bool
    flips: int
    """2^n when exact, else the number of random draws."""
    floor: float
    """The smallest p this design can give: 2 / 2^n (flipping every sign gives the same |Σ d|)."""


def _signed_sums(x_N: np.ndarray) -> np.ndarray:
    """Σ s·x for all 2^n sign vectors s."""
    sums = np.zeros(1)
    for value in x_N:
        sums = np.concatenate([sums + value, sums - value])
    return sums


def sign_flip_test(d_N: Sequence[float], *, exact_max: int = EXACT_MAX_SEEDS, draws: int = MC_DRAWS,
                   seed: int = 0) -> SignFlip:
    """Two-sided sign-flip test: under "no effect" each seed's difference is as likely +d as −d, so
    p = share of sign vectors whose |Σ s·d| reaches the observed |Σ d|. All 2^n vectors for
    n ≤ `exact_max`; else `draws` random ones, p = (1 + hits) / (1 + draws) (never 0)."""
    d = np.asarray(d_N, dtype=np.float64)
    n = int(d.size)
    if n < 1:
        raise TooFewSeeds("the sign-flip test needs at least one difference")
    observed = abs(float(d.sum()))
    tol = 1e-9 * max(float(np.abs(d).sum()), 1e-300)  # sums equal on paper differ by float rounding
    floor = 2.0 / 2.0**n
    if n <= exact_max:
        half = n // 2
        low, high = _signed_sums(d[:half]), _signed_sums(d[half:])
        hits = int(np.count_nonzero(np.abs(low[None, :] + high[:, None]) >= observed - tol))
        return SignFlip(p=hits / 2.0**n, exact=True, flips=2**n, floor=floor)
    rng = np.random.default_rng(seed)
    hits = 0
    for start in range(0, draws, 10_000):
        rows = min(10_000, draws - start)
        signs_RN = rng.integers(0, 2, size=(rows, n)) * 2 - 1
        hits += int(np.count_nonzero(np.abs(signs_RN @ d) >= observed - tol))
    return SignFlip(p=(1 + hits) / (1 + draws), exact=False, flips=draws, floor=floor)


def _sd(d_N: np.ndarray) -> float:
    """Sample sd (ddof 1); 0 when the values are equal up to float rounding (mean of 0.2, 0.2, 0.2
    is not exactly 0.2, and a 1e-17 sd would make d_z 1e16)."""
    sd = float(np.std(d_N, ddof=1))
    return 0.0 if sd <= 1e-12 * float(np.max(np.abs(d_N))) else sd


def t_interval(d_N: Sequence[float], confidence: float = 0.95) -> tuple[float, float]:
    """mean ± t_{(1+c)/2, n−1} · sd / √n (Student t; needs n ≥ 2)."""
    from scipy import stats

    d = np.asarray(d_N, dtype=np.float64)
    n = d.size
    if n < 2:
        raise TooFewSeeds("a t interval needs at least 2 values")
    half = float(stats.t.ppf((1 + confidence) / 2, n - 1)) * _sd(d) / math.sqrt(n)
    mean = float(d.mean())
    return mean - half, mean + half


def t_test_p(d_N: Sequence[float]) -> float | None:
    """The paired t-test's two-sided p (for reference beside the exact test); None when sd = 0."""
    from scipy import stats

    d = np.asarray(d_N, dtype=np.float64)
    sd = _sd(d)
    if sd == 0:
        return None
    t_stat = float(d.mean()) / (sd / math.sqrt(d.size))
    return float(2 * stats.t.sf(abs(t_stat), d.size - 1))


def _solve_increasing(f, target: float, lo: float, hi: float) -> float:
    """x with f(x) = target for increasing f, widening [lo, hi] until it brackets."""
    from scipy.optimize import brentq

    step = max(1.0, hi - lo)
    while f(lo) > target:
        lo -= step
        step *= 2
    step = max(1.0, hi - lo)
    while f(hi) < target:
        hi += step
        step *= 2
    return float(brentq(lambda x: f(x) - target, lo, hi, xtol=1e-10))


def cohens_dz(d_N: Sequence[float], confidence: float = 0.95) -> tuple[float | None, float | None, float | None]:
    """Paired Cohen's d_z = mean / sd of the differences, with its interval from the noncentral t:
    t = d_z·√n follows nct(n−1, δ·√n), so the bounds are the δ whose cdf at the observed t is
    (1 ± c)/2. (None, None, None) when sd = 0."""
    from scipy import stats

    d = np.asarray(d_N, dtype=np.float64)
    n = d.size
    if n < 2:
        raise TooFewSeeds("Cohen's d needs at least 2 values")
    sd = _sd(d)
    if sd == 0:
        return None, None, None
    dz = float(d.mean()) / sd
    t_obs, df, root = dz * math.sqrt(n), n - 1, math.sqrt(n)

    def survival(nc: float) -> float:  # P(T ≥ t_obs | nc): increases with nc
        value = float(stats.nct.sf(t_obs, df, nc))
        return value if math.isfinite(value) else float(nc > t_obs)  # scipy's NaN far out in a tail

    tail = (1 - confidence) / 2
    lo = _solve_increasing(survival, tail, t_obs - 2, t_obs + 2)
    hi = _solve_increasing(survival, 1 - tail, t_obs - 2, t_obs + 2)
    return dz, lo / root, hi / root


def paired_power(dz: float, n: int, alpha: float = 0.05) -> float:
    """Power of the two-sided paired t-test at level alpha with n pairs when the true effect is d_z
    (= mean / sd of the differences): P(|T| > t_crit) for T ~ nct(n−1, d_z·√n)."""
    from scipy import stats

    if n < 2:
        raise TooFewSeeds("power needs at least 2 seeds")
    df = n - 1
    crit = float(stats.t.ppf(1 - alpha / 2, df))
    nc = abs(dz) * math.sqrt(n)  # symmetric in the effect's sign
    # scipy's nct.cdf answers NaN far out in the lower tail, where the term is ~0.
    return float(stats.nct.sf(crit, df, nc) + np.nan_to_num(stats.nct.cdf(-crit, df, nc)))


def minimum_detectable_dz(n: int, alpha: float = 0.05, power: float = POWER) -> float:
    """The smallest d_z the paired t-test detects with `power` at level alpha with n seeds."""
    return _solve_increasing(lambda dz: paired_power(dz, n, alpha), power, 1e-6, 5.0)


def seeds_needed(dz: float, alpha: float = 0.05, power: float = POWER, *, limit: int = 100_000) -> int | None:
    """The fewest seeds (≥ 2) whose paired t-test reaches `power` for effect d_z; None for d_z = 0
    or beyond `limit` seeds."""
    from scipy import stats

    dz = abs(dz)
    if dz == 0:
        return None
    z = float(stats.norm.ppf(1 - alpha / 2) + stats.norm.ppf(power))
    n = max(2, int((z / dz) ** 2) - 1)  # the normal approximation; the t-test needs about this many
    if n > limit:
        return None
    while n > 2 and paired_power(dz, n - 1, alpha) >= power:
        n -= 1
    while paired_power(dz, n, alpha) < power:
        n += 1
        if n > limit:
            return None
    return n


def seeds_for_exact_test(alpha: float, tests: int = 1) -> int:
    """The fewest seeds whose exact sign-flip p can get below alpha after Holm over `tests`
    metrics: m · 2 / 2^n < alpha."""
    n = 1
    while tests * 2.0 / 2.0**n >= alpha:
        n += 1
    return n


@dataclass(frozen=True)
class Equivalence:
    """TOST: two one-sided paired t-tests, H0 mean ≤ −margin and H0 mean ≥ +margin."""

    margin: float
    p_lower: float
    p_upper: float
    p: float
    """max(p_lower, p_upper): equivalent at level alpha when p < alpha."""
    interval: tuple[float, float]
    """The (1 − 2α) t interval; equivalence at alpha ⇔ it lies inside (−margin, +margin)."""


def tost(d_N: Sequence[float], margin: float, alpha: float = 0.05) -> Equivalence:
    """Paired TOST of |mean(d)| < margin (Schuirmann's two one-sided t-tests)."""
    from scipy import stats

    if not margin > 0:
        raise BadSettings(f"equivalence margin must be > 0, got {margin}")
    d = np.asarray(d_N, dtype=np.float64)
    n = d.size
    if n < 2:
        raise TooFewSeeds("TOST needs at least 2 values")
    mean, se, df = float(d.mean()), _sd(d) / math.sqrt(n), n - 1
    if se == 0:  # every difference equal: the tests' limit
        p_lower, p_upper = float(mean <= -margin), float(mean >= margin)
    else:
        p_lower = float(stats.t.sf((mean + margin) / se, df))
        p_upper = float(stats.t.cdf((mean - margin) / se, df))
    half = float(stats.t.ppf(1 - alpha, df)) * se
    return Equivalence(margin, p_lower, p_upper, max(p_lower, p_upper), (mean - half, mean + half))


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: the i-th smallest p times (m − i + 1),
    made non-decreasing, capped at 1. Reject where the adjusted p < alpha."""
    p = np.asarray(p_values, dtype=np.float64)
    m = p.size
    adjusted = np.empty(m)
    running = 0.0
    for rank, index in enumerate(np.argsort(p, kind="stable")):
        running = max(running, min(1.0, (m - rank) * float(p[index])))
        adjusted[index] = running
    return [float(x) for x in adjusted]


def two_way_bootstrap(diff_ST: np.ndarray, *, resamples: int = BOOTSTRAP_RESAMPLES, confidence: float = 0.95,
                      seed: int = 0) -> tuple[float, float, float]:
    """(mean, lo, hi): the percentile interval of the mean of a seeds × tasks matrix of paired
    differences when seeds and tasks are resampled independently, each with replacement. A
    resample's mean is w_sᵀ D w_t / (S·T) with multinomial counts w_s and w_t."""
    diff_ST = np.asarray(diff_ST, dtype=np.float64)
    n_seeds, n_tasks = diff_ST.shape
    rng = np.random.default_rng(seed)
    seeds_BS = rng.multinomial(n_seeds, np.full(n_seeds, 1.0 / n_seeds), size=resamples)
    tasks_BT = rng.multinomial(n_tasks, np.full(n_tasks, 1.0 / n_tasks), size=resamples)
    means_B = ((seeds_BS @ diff_ST) * tasks_BT).sum(axis=1) / (n_seeds * n_tasks)
    tail = (1 - confidence) / 2
    lo, hi = np.quantile(means_B, [tail, 1 - tail])
    return float(diff_ST.mean()), float(lo), float(hi)


# ---------------------------------------------------------------------------------------------
# Comparisons and verdicts


class Verdict(str, Enum):
    """What a comparison on one metric concludes (docs/statistics.md, "Verdicts")."""

    confirmed = "CONFIRMED"
    """The candidate is better: Holm-adjusted exact p < alpha and the t interval on the better side of 0."""
    refuted = "REFUTED"
    """The candidate is worse: significant the same way, in the opposite direction."""
    equivalent = "EQUIVALENT"
    """Not different, and TOST puts the difference inside ±equivalence_margin (Holm-adjusted p < alpha)."""
    inconclusive = "INCONCLUSIVE"
    """The seeds cannot decide; the reason says why and what would."""


@dataclass(frozen=True)
class StatsSettings:
    """The [stats] table's settings (and the CLI's overrides)."""

    alpha: float = 0.05
    equivalence_margin: float | dict[str, float] | None = None
    """± this counts as no difference (TOST), in the metric's units: one number for every metric,
    or a table from metric spec to margin (metrics left out get no TOST)."""
    target_effect: float | None = None
    """An effect (metric units) to plan seeds for; the report says how many seeds it needs."""
    power: float = POWER
    exact_max_seeds: int = EXACT_MAX_SEEDS
    draws: int = MC_DRAWS
    resamples: int = BOOTSTRAP_RESAMPLES
    seed: int = 0
    """Seed of the Monte Carlo flips and the bootstrap."""
    paired_only: bool = False
    """Drop seeds that only one side has instead of refusing."""

    def __post_init__(self):
        for name in ("alpha", "power", "target_effect"):
            value = getattr(self, name)
            if (value is not None or name != "target_effect") and (
                    isinstance(value, bool) or not isinstance(value, (int, float))):
                raise BadSettings(f"{name} must be a number, got {value!r}")
        if not 0 < self.alpha < 0.5:
            raise BadSettings(f"alpha must be in (0, 0.5), got {self.alpha}")
        margins = self.equivalence_margin
        if isinstance(margins, dict):
            object.__setattr__(self, "equivalence_margin", {Metric.parse(k).spec: v for k, v in margins.items()})
            margins = list(margins.values())
        for margin in margins if isinstance(margins, list) else [margins]:
            if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                                       or not margin > 0):
                raise BadSettings(f"equivalence_margin must be a number > 0 (or a table of them), got {margin!r}")
        if self.target_effect is not None and self.target_effect == 0:
            raise BadSettings("target_effect must not be 0")
        if not 0 < self.power < 1:
            raise BadSettings(f"power must be in (0, 1), got {self.power}")
        if self.draws < 1000 or self.resamples < 100:
            raise BadSettings("draws must be ≥ 1000 and resamples ≥ 100")

    def margin_for(self, metric: Metric) -> float | None:
        """The equivalence margin of `metric`, if any."""
        if isinstance(self.equivalence_margin, dict):
            return self.equivalence_margin.get(metric.spec)
        return self.equivalence_margin

    @classmethod
    def from_table(cls, table: dict, **overrides: Any) -> "StatsSettings":
        """Settings from a campaign's [stats] table; `overrides` (not None) win."""
        for key in table:
            if key not in STATS_KEYS:
                close = difflib.get_close_matches(key, STATS_KEYS, n=1)
                raise BadSettings(f"[stats] has no setting {key!r}",
                                  fix=f"did you mean {close[0]!r}?" if close else f"known: {', '.join(STATS_KEYS)}")
        values = {k: table[k] for k in ("alpha", "equivalence_margin", "target_effect", "power") if k in table}
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            return cls(**values)
        except TypeError as exc:
            raise BadSettings(str(exc)) from None


@dataclass
class MetricComparison:
    """One metric, candidate vs baseline over paired seeds: the numbers and the verdict."""

    metric: str
    higher_is_better: bool
    seeds: list
    baseline_values: list[float]
    candidate_values: list[float]
    differences: list[float]
    n_seeds: int
    baseline_mean: float
    candidate_mean: float
    mean_difference: float
    sd_difference: float
    steps: dict
    """Steps the values were read at (final/step) or spans (auc), per side."""
    sign_flip: dict
    p_holm: float | None = None
    t_interval: tuple[float, float] | None = None
    t_test_p: float | None = None
    cohens_dz: float | None = None
    cohens_dz_interval: tuple[float | None, float | None] | None = None
    power: dict = field(default_factory=dict)
    equivalence: dict | None = None
    two_way_bootstrap: dict | None = None
    samples_per_task: int | None = None
    unit: str = "seeds"
    """What was paired: seeds (training runs) or tasks (`rollmarket eval compare`)."""
    verdict: str = Verdict.inconclusive.value
    reason: str = ""
    evidence: dict = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    blockers: list[str] = field(default_factory=list, repr=False)


@dataclass
class Comparison:
    """A candidate against a baseline on every declared metric (one Holm family)."""

    baseline: str
    candidate: str
    metrics: list[MetricComparison]
    dropped_seeds: dict = field(default_factory=dict)


def _by_seed(runs: Sequence[Run], side: str) -> dict:
    out: dict = {}
    for run in runs:
        if run.seed in out:
            raise UnpairedSeeds(f"{side}: seed {run.seed} twice ({out[run.seed].path} and {run.path})",
                                fix="keep one run per seed on each side")
        out[run.seed] = run
    return out


def _seed_order(seed: int | str) -> tuple:
    return (0, seed, "") if isinstance(seed, int) else (1, 0, str(seed))


def _fmt(x: float | None, digits: int = 3) -> str:
    return "n/a" if x is None else f"{x:.{digits}g}" if abs(x) < 1e-3 and x != 0 else f"{x:.{digits}f}"


def _pfmt(p: float | None) -> str:
    return "n/a" if p is None else f"{p:.2g}" if p < 0.001 else f"{p:.4f}".rstrip("0").rstrip(".")


def compare(baseline: Sequence[Run], candidate: Sequence[Run], metrics: Sequence[Metric],
            settings: StatsSettings = StatsSettings(), *, baseline_name: str = "baseline",
            candidate_name: str = "candidate", same_runs: bool = False) -> Comparison:
    """Candidate vs baseline on each metric, paired by seed; Holm across the metrics; verdicts.

    `same_runs`: the two sides are the same runs read at different points (`before_training`
    against the run), so each side must end at one step but the sides may differ."""
    if not metrics:
        raise BadMetricSpec("no metric to compare", fix=f"declare [stats] metrics or pass --metric {DEFAULT_METRIC}")
    base, cand = _by_seed(baseline, baseline_name), _by_seed(candidate, candidate_name)
    dropped = {}
    if set(base) != set(cand):
        only_base = sorted(set(base) - set(cand), key=_seed_order)
        only_cand = sorted(set(cand) - set(base), key=_seed_order)
        if not settings.paired_only:
            raise UnpairedSeeds(
                f"{candidate_name} vs {baseline_name}: seeds do not pair (only {baseline_name}: {only_base or 'none'}; "
                f"only {candidate_name}: {only_cand or 'none'})",
                fix="finish the missing runs, or pass --paired-only to compare the seeds both sides have")
        dropped = {baseline_name: only_base, candidate_name: only_cand}
    seeds = sorted(set(base) & set(cand), key=_seed_order)
    if len(seeds) < 2:
        raise TooFewSeeds(f"{candidate_name} vs {baseline_name}: {len(seeds)} paired seed(s); the seed is the unit "
                          f"of replication and a comparison needs at least 2",
                          fix=f"run more seeds (≥ {seeds_for_exact_test(settings.alpha, len(metrics))} for the "
                              f"exact test to be able to decide)")
    results = [_compare_metric([base[s] for s in seeds], [cand[s] for s in seeds], seeds, metric, settings,
                               len(metrics), same_runs) for metric in metrics]
    judge(results, settings)
    return Comparison(baseline=baseline_name, candidate=candidate_name, metrics=results, dropped_seeds=dropped)


def paired_comparison(metric: str, higher_is_better: bool, units: Sequence, baseline: Sequence[float],
                      candidate: Sequence[float], settings: StatsSettings, tests: int, *,
                      margin: float | None = None, unit: str = "seeds") -> MetricComparison:
    """The paired numbers of one metric, before the verdict: the sign-flip test, the t interval,
    d_z, power and TOST of candidate − baseline over `units` (seeds for training runs, tasks for
    `rollmarket eval compare`): one implementation for both."""
    alpha = settings.alpha
    b_N, c_N = np.asarray(baseline, dtype=float), np.asarray(candidate, dtype=float)
    d_N = c_N - b_N
    n = d_N.size
    sd = _sd(d_N)
    result = MetricComparison(
        metric=metric, higher_is_better=higher_is_better, seeds=list(units),
        baseline_values=b_N.tolist(), candidate_values=c_N.tolist(), differences=d_N.tolist(), n_seeds=n,
        baseline_mean=float(b_N.mean()), candidate_mean=float(c_N.mean()), mean_difference=float(d_N.mean()),
        sd_difference=sd, steps={}, unit=unit,
        sign_flip=asdict(sign_flip_test(d_N, exact_max=settings.exact_max_seeds, draws=settings.draws,
                                        seed=settings.seed)),
    )
    result.t_interval = t_interval(d_N, 1 - alpha)
    result.t_test_p = t_test_p(d_N)
    dz, lo, hi = cohens_dz(d_N, 1 - alpha)
    result.cohens_dz, result.cohens_dz_interval = dz, (lo, hi)
    mde_dz = minimum_detectable_dz(n, alpha, settings.power)
    floor = seeds_for_exact_test(alpha, tests)

    def planned(effect_dz: float | None) -> int | None:  # the t-test's count, at least the exact test's floor
        needed = seeds_needed(effect_dz, alpha, settings.power) if effect_dz else None
        return None if needed is None else max(needed, floor)

    power = {"alpha": alpha, "power": settings.power, "mde_dz": mde_dz, "mde": mde_dz * sd if sd > 0 else None,
             "power_at_observed": paired_power(dz, n, alpha) if dz is not None else None,
             "seeds_for_observed": planned(dz), "seeds_for_exact_test": floor}
    if settings.target_effect is not None:
        power["target_effect"] = settings.target_effect
        power["seeds_for_target"] = planned(settings.target_effect / sd) if sd > 0 else None
    result.power = power
    if margin is not None:
        eq = tost(d_N, margin, alpha)
        result.equivalence = {**asdict(eq), "interval": list(eq.interval)}
    return result


def _compare_metric(base: list[Run], cand: list[Run], seeds: list, metric: Metric, settings: StatsSettings,
                    tests: int, same_runs: bool = False) -> MetricComparison:
    b_vals = [metric_value(r, metric) for r in base]
    c_vals = [metric_value(r, metric) for r in cand]
    result = paired_comparison(metric.spec, metric.higher_is_better, seeds, [v.value for v in b_vals],
                               [v.value for v in c_vals], settings, tests, margin=settings.margin_for(metric))
    result.steps = {"baseline": [v.step if v.span is None else list(v.span) for v in b_vals],
                    "candidate": [v.step if v.span is None else list(v.span) for v in c_vals]}
    for side in ((b_vals, c_vals) if same_runs else (b_vals + c_vals,)):
        ends = {v.step if v.span is None else v.span for v in side}
        if len(ends) <= 1:
            continue
        result.blockers.append(
            f"runs end at different steps ({', '.join(str(e) for e in sorted(ends, key=str))}): unfinished runs? "
            f"finish them or name a step ({metric.key}@STEP)")
    if metric.pass_at_k is not None:
        found = [samples_per_task(r, v.step) for r, v in zip(base + cand, b_vals + c_vals)]
        result.samples_per_task = None if any(s is None for s in found) else min(found)
        if result.samples_per_task is None:
            result.blockers.append(f"{metric.key}: samples per task unknown (no evals.jsonl, no eval.samples); "
                                   f"pass@k claims need ≥ {MIN_SAMPLES_PER_TASK}")
        elif result.samples_per_task < MIN_SAMPLES_PER_TASK:
            result.blockers.append(f"held-out evals have {result.samples_per_task} samples per task; a pass@k claim "
                                   f"needs ≥ {MIN_SAMPLES_PER_TASK} (set eval.samples = {MIN_SAMPLES_PER_TASK})")
    result.two_way_bootstrap = _two_way(base, cand, b_vals, c_vals, metric, settings, result.notes)
    return result


def _two_way(base, cand, b_vals, c_vals, metric, settings, notes) -> dict | None:
    if not metric.per_task:
        return None
    tables = [per_task_values(r, metric, v.step) for r, v in zip(base + cand, b_vals + c_vals)]
    if any(t is None for t in tables):
        notes.append("no two-way bootstrap: some runs have no per-task evals at the step read")
        return None
    common = sorted(set.intersection(*(set(t) for t in tables)))
    if len(common) < 2:
        notes.append("no two-way bootstrap: fewer than 2 held-out tasks common to every run")
        return None
    if any(len(t) != len(common) for t in tables):
        notes.append(f"two-way bootstrap over the {len(common)} tasks every run evaluated")
    half = len(base)
    matrix_RT = np.array([[t[task] for task in common] for t in tables])
    diff_ST = matrix_RT[half:] - matrix_RT[:half]
    mean, lo, hi = two_way_bootstrap(diff_ST, resamples=settings.resamples, confidence=1 - settings.alpha,
                                     seed=settings.seed)
    return {"mean": mean, "lo": lo, "hi": hi, "resamples": settings.resamples, "tasks": len(common),
            "seeds": half}


def judge(results: Sequence[MetricComparison], settings: StatsSettings) -> None:
    """Holm across one comparison's metrics (the tests and the TOSTs), then each one's verdict."""
    for result, p in zip(results, holm([r.sign_flip["p"] for r in results])):
        result.p_holm = p
    with_margin = [r for r in results if r.equivalence is not None]
    for result, p in zip(with_margin, holm([r.equivalence["p"] for r in with_margin])):
        result.equivalence["p_holm"] = p
    for result in results:
        decide(result, settings, len(results))


def decide(r: MetricComparison, settings: StatsSettings, tests: int) -> None:
    """Set the verdict and the evidence it rests on (docs/statistics.md, "Verdicts"); p_holm must be set."""
    alpha, n = settings.alpha, r.n_seeds
    flip = r.sign_flip
    test = (f"exact sign-flip test over all {flip['flips']} flips" if flip["exact"]
            else f"Monte Carlo sign-flip test ({flip['flips']} random flips)")
    lo, hi = r.t_interval
    holm_note = f", Holm-adjusted {_pfmt(r.p_holm)} across {tests} metrics" if tests > 1 else ""
    samples = f", {r.samples_per_task} samples per task" if r.samples_per_task is not None else ""
    r.evidence = {"test": test, "p": flip["p"], "p_holm": r.p_holm, "alpha": alpha,
                  "interval": [lo, hi], "interval_kind": f"t {100 * (1 - alpha):g}%", "n_seeds": n,
                  "samples_per_task": r.samples_per_task}
    tested = f"{test}: p = {_pfmt(flip['p'])}{holm_note}"
    effect = f"mean Δ {r.mean_difference:+.4g} ({100 * (1 - alpha):g}% t interval [{lo:.4g}, {hi:.4g}])"
    counted = f"{n} {r.unit}{samples}"
    stated = f"{tested}; {effect}; {counted}"
    reachable = tests * flip["floor"] < alpha
    if not reachable:
        need = seeds_for_exact_test(alpha, tests)
        r.verdict = Verdict.inconclusive.value
        r.reason = (f"the {r.unit} cannot decide: with {n} {r.unit} the smallest possible two-sided sign-flip p is "
                    f"2/2^{n} = {_pfmt(flip['floor'])}" + (f" (×{tests} under Holm)" if tests > 1 else "")
                    + f", not below α = {alpha:g}; {'run' if r.unit == 'seeds' else 'evaluate on'} ≥ {need} {r.unit}. "
                      f"{stated}")
        return
    if r.blockers:
        r.verdict = Verdict.inconclusive.value
        r.reason = "; ".join(r.blockers) + f". {stated}"
        return
    better = r.mean_difference > 0 if r.higher_is_better else r.mean_difference < 0
    if r.p_holm < alpha:
        if lo > 0 or hi < 0:
            r.verdict = (Verdict.confirmed if better else Verdict.refuted).value
            side = "better" if better else "worse"
            r.reason = f"candidate {side} than baseline: {tested} < α = {alpha:g}; {effect}; {counted}"
            return
        r.verdict = Verdict.inconclusive.value
        r.reason = (f"the exact test is significant but the t interval crosses 0 (the tests disagree: one seed "
                    f"far from the rest?): {stated}")
        return
    eq = r.equivalence
    if eq is not None and eq["p_holm"] < alpha:
        r.verdict = Verdict.equivalent.value
        r.evidence["tost_p"], r.evidence["tost_p_holm"] = eq["p"], eq["p_holm"]
        r.evidence["equivalence_margin"] = eq["margin"]
        r.reason = (f"no difference beyond ±{eq['margin']:g}: TOST p = {_pfmt(eq['p'])}"
                    + (f" (Holm {_pfmt(eq['p_holm'])})" if tests > 1 else "")
                    + f" < α = {alpha:g}, {100 * (1 - 2 * alpha):g}% interval [{eq['interval'][0]:.4g}, "
                      f"{eq['interval'][1]:.4g}]; {stated}")
        return
    r.verdict = Verdict.inconclusive.value
    mde = r.power.get("mde")
    why = [f"not significant: {stated}"]
    if mde is not None:
        why.append(f"these {n} {r.unit} detect |Δ| ≥ {mde:.3g} with {100 * settings.power:g}% power")
    if eq is not None:
        why.append(f"not shown equivalent within ±{eq['margin']:g} (TOST p = {_pfmt(eq['p'])})")
    else:
        why.append("no equivalence_margin declared, so 'no effect' cannot be shown either")
    r.reason = "; ".join(why)


# ---------------------------------------------------------------------------------------------
# Reports


@dataclass
class StatsReport:
    """What `rollmarket stats` / `compare` write (stats.json)."""

    kind: str
    """"campaign" or "compare"."""
    source: str
    baseline: str
    metrics: list[str]
    settings: dict
    comparisons: list[Comparison]
    missing_runs: list[dict] = field(default_factory=list)


def campaign_report(campaign: Campaign, *, baseline: str | None = None, metrics: Sequence[str] | None = None,
                    before_after: bool = False, **overrides: Any) -> StatsReport:
    """Every condition of the campaign against the baseline (the option, else [stats] baseline,
    else the first condition) on the declared metrics (the option, else [stats] metrics, else
    eval/pass@1@final). With `before_after`, each condition against itself before training
    (`before_training`): did training change the metric, seed by seed?"""
    settings = StatsSettings.from_table(campaign.stats, **overrides)
    if before_after:
        parsed = [Metric.parse(s) for s in _declared_metrics(campaign, metrics)]
        comparisons = [compare([before_training(r) for r in campaign.runs[name]], campaign.runs[name], parsed,
                               settings, baseline_name=f"{name} before training", candidate_name=name,
                               same_runs=True)
                       for name in campaign.conditions]
        return StatsReport(kind="before_after", source=str(campaign.path), baseline="before training",
                           metrics=[m.spec for m in parsed], settings=asdict(settings), comparisons=comparisons,
                           missing_runs=campaign.missing)
    baseline = baseline or campaign.stats.get("baseline") or campaign.conditions[0]
    if baseline not in campaign.runs:
        close = difflib.get_close_matches(str(baseline), campaign.conditions, n=1)
        raise UnknownCondition(f"{campaign.path}: no condition {baseline!r} (has {', '.join(campaign.conditions)})",
                               fix=f"did you mean {close[0]!r}?" if close else "pass --baseline with one of them")
    parsed = [Metric.parse(s) for s in _declared_metrics(campaign, metrics)]
    if len(campaign.conditions) < 2:
        raise UnknownCondition(f"{campaign.path}: one condition only; nothing to compare it with")
    comparisons = [compare(campaign.runs[baseline], campaign.runs[name], parsed, settings,
                           baseline_name=baseline, candidate_name=name)
                   for name in campaign.conditions if name != baseline]
    return StatsReport(kind="campaign", source=str(campaign.path), baseline=baseline,
                       metrics=[m.spec for m in parsed], settings=asdict(settings), comparisons=comparisons,
                       missing_runs=campaign.missing)


def _declared_metrics(campaign: Campaign, metrics: Sequence[str] | None) -> list[str]:
    """The option's metric specs, else [stats] metrics, else the default."""
    declared = campaign.stats.get("metrics")
    if isinstance(declared, str):
        declared = [declared]
    if declared is not None and not (isinstance(declared, list) and all(isinstance(m, str) for m in declared)):
        raise BadSettings(f"[stats] metrics must be a list of metric specs, got {declared!r}")
    return list(metrics or declared or [DEFAULT_METRIC])


def _clean(value: Any) -> Any:
    """JSON-safe: tuples to lists, NaN/inf to None (a metric that does not apply is null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    return value


def report_dict(report: StatsReport) -> dict:
    """The report as plain JSON data."""
    data = asdict(report)
    for comparison in data["comparisons"]:
        for metric in comparison["metrics"]:
            metric.pop("blockers", None)
    return _clean(data)


def report_json(report: StatsReport) -> str:
    return json.dumps(report_dict(report), indent=2) + "\n"


def report_markdown(report: StatsReport) -> str:
    """A markdown table (one row per condition × metric) and each verdict's reason."""
    alpha = report.settings["alpha"]
    lines = [f"# Statistics: {report.source}", "",
             f"Baseline **{report.baseline}**; the seed is the unit (one number per seed); α = {alpha:g}; "
             f"exact sign-flip p (Holm across the {len(report.metrics)} metric(s)); t interval of the mean "
             f"paired difference; d_z = mean/sd of the differences.", "",
             "| candidate | metric | seeds | baseline | candidate | Δ mean | interval | p (Holm) | d_z | MDE | "
             "verdict |", "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|"]
    for c in report.comparisons:
        for m in c.metrics:
            lo, hi = m.t_interval
            mde = m.power.get("mde")
            lines.append(f"| {c.candidate} | `{m.metric}` | {m.n_seeds} | {m.baseline_mean:.4f} | "
                         f"{m.candidate_mean:.4f} | {m.mean_difference:+.4f} | [{lo:.4f}, {hi:.4f}] | "
                         f"{_pfmt(m.sign_flip['p'])} ({_pfmt(m.p_holm)}) | {_fmt(m.cohens_dz, 2)} | "
                         f"{_fmt(mde)} | **{m.verdict}** |")
    lines.append("")
    for c in report.comparisons:
        for m in c.metrics:
            lines.append(f"- **{c.candidate}**, `{m.metric}`: {m.verdict}: {m.reason}")
            for note in m.notes:
                lines.append(f"  - {note}")
        if c.dropped_seeds:
            lines.append(f"  - seeds left out (unpaired): {c.dropped_seeds}")
    if report.missing_runs:
        lines += ["", "Runs without data: " + ", ".join(f"{r['condition']} s{r['seed']} ({r['status']})"
                                                         for r in report.missing_runs)]
    return "\n".join(lines) + "\n"
