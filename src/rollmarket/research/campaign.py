"""Campaigns: conditions × seeds from one TOML file, each run a `rollmarket train --local` process.

    # a normal train config: its sections apply to every run
    [loop]
    steps = 20

    [campaign]
    name = "advantage-modes"
    seeds = [1, 2, 3]
    seed_mode = "all"      # all: task order, samples and torch seed vary; sampling: same tasks, new samples
    parallel = 2           # runs at once (default: the machine's cores)

    [[campaign.conditions]]
    name = "grpo"
    algorithm.advantage = "grpo"

    [[campaign.conditions]]
    name = "maxrl"
    algorithm.advantage = "maxrl"

    [stats]                # read by `rollmarket stats`, kept in campaign.json as it is
    metrics = ["eval/pass@1@final"]

The campaign directory:

    CAMPAIGN_DIR/campaign.json                           the manifest (name, file, conditions, seeds, runs)
    CAMPAIGN_DIR/runs/<condition>__s<seed>/<run dir>/    each run: `rollmarket train`'s run directory
    CAMPAIGN_DIR/runs/<condition>__s<seed>/train.log     its output
    CAMPAIGN_DIR/.lock                                   held (flock) by the process running the campaign

Every setting is checked before anything is created (`load_campaign` resolves every run's config
with train/config.py's `resolve` and `validate`). Running the same campaign again into the same
directory resumes it: finished runs (summary.json) are skipped, a run with a run directory is
continued with `rollmarket train --resume`, the others start. Runs die with the campaign process
(PR_SET_PDEATHSIG), so a kill -9 of the campaign cannot leave a run writing beside its resumed self.
"""

from __future__ import annotations

import difflib
import fcntl
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from ..localhost import die_with_parent
from ..runs import code_version, read_step_rows, write_json

SeedMode = Literal["all", "sampling"]
MANIFEST = "campaign.json"
LOG = "train.log"
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$"
"""Condition and campaign names: they become directory names."""

SEED_KEYS: dict[str, tuple[str, ...]] = {
    "all": ("rollout.seed", "rollout.sampling_seed", "seed"),
    "sampling": ("rollout.sampling_seed",),
}
"""The keys each seed mode sets from the campaign seed; the file and overrides may not set them."""
CAMPAIGN_KEYS = ("labels.condition", "labels.seed")
"""Keys the campaign always sets itself. (runs_root may be set: it says where campaign directories go
by default; each run's own runs_root is its directory in the campaign.)"""


class CampaignError(ValueError):
    """The campaign file, an override or the campaign directory is not usable; nothing was started.
    `fix` says how to fix it, when known."""

    def __init__(self, message: str, fix: str | None = None):
        super().__init__(message)
        self.fix = fix


class CampaignFailed(RuntimeError):
    """Some runs of the campaign failed (their logs say why); running the campaign again resumes them."""


class CampaignSection(BaseModel):
    """The `[campaign]` table."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field("campaign", pattern=NAME_PATTERN, description="The campaign's name.")
    seeds: list[int] = Field(min_length=1, description="Seeds every condition runs with.")
    seed_mode: SeedMode = Field(
        "all", description="all: the seed sets rollout.seed (task order), the sampling seed and the torch seed; "
                           "sampling: only rollout.sampling_seed (same tasks, new samples).")
    parallel: int | None = Field(None, ge=1, description="Runs at once; None: the machine's cores.")
    conditions: list[dict[str, Any]] = Field(min_length=1, description="[[campaign.conditions]]: name + overrides.")

    @field_validator("seeds")
    @classmethod
    def _distinct(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds repeat: {seeds}")
        return seeds


@dataclass(frozen=True)
class Condition:
    """One condition: its name and the training keys it overrides (dotted key → value)."""

    name: str
    overrides: dict[str, Any]


@dataclass(frozen=True)
class PlannedRun:
    """One (condition, seed) of a campaign with its resolved settings."""

    condition: str
    seed: int
    overrides: list[str]
    """Every setting of the run as KEY=VALUE overrides, as `rollmarket train` takes them: the file's
    train sections, the condition's, the seeds, the command line's, the labels."""
    config: Any
    """The resolved TrainConfig (typed Any: this module loads train/config lazily)."""

    @property
    def key(self) -> str:
        """Its directory under CAMPAIGN_DIR/runs/."""
        return f"{self.condition}__s{self.seed}"


@dataclass(frozen=True)
class Campaign:
    """A parsed, checked campaign: what would run, before anything runs."""

    name: str
    text: str
    """The campaign TOML as written (kept in campaign.json)."""
    source: str
    base: dict
    """The file's train sections (everything but [campaign] and [stats])."""
    conditions: list[Condition]
    seeds: list[int]
    seed_mode: SeedMode
    parallel: int | None
    stats: dict
    overrides: list[str]
    """KEY=VALUE overrides from the command line, applied to every run after the conditions."""
    runs: list[PlannedRun]

    def manifest(self) -> dict:
        """campaign.json without the runs' directories (those are added as runs start)."""
        return {"name": self.name, "file": self.text, "source": self.source,
                "conditions": [{"name": c.name, "overrides": c.overrides} for c in self.conditions],
                "seeds": self.seeds, "seed_mode": self.seed_mode, "stats": self.stats, "overrides": self.overrides,
                "runs": [{"condition": r.condition, "seed": r.seed, "dir": None, "status": "pending"}
                         for r in self.runs]}


def _toml_value(value: Any) -> str:
    """A value as TOML text: JSON's spelling of strings, numbers, booleans and lists is valid TOML."""
    return json.dumps(value)


def flatten(table: dict, prefix: str = "") -> dict[str, Any]:
    """Nested tables as dotted keys: {"a": {"b": 1}} → {"a.b": 1}."""
    out: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, dict):
            out.update(flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def campaign_toml(base: Path | str, *, name: str, seeds: list[int], conditions: dict[str, dict[str, Any]],
                  seed_mode: SeedMode = "all", parallel: int | None = None) -> str:
    """A campaign file's text from a train config file and conditions given in code (the experiments'
    scripts build theirs this way, so that their campaign.json holds a file `rollmarket campaign` runs)."""
    lines = [Path(base).read_text().rstrip(), "", "[campaign]", f"name = {_toml_value(name)}",
             f"seeds = {_toml_value(seeds)}", f"seed_mode = {_toml_value(seed_mode)}"]
    if parallel is not None:
        lines.append(f"parallel = {parallel}")
    for cond, overrides in conditions.items():
        lines += ["", "[[campaign.conditions]]", f"name = {_toml_value(cond)}"]
        lines += [f"{key} = {_toml_value(value)}" for key, value in overrides.items()]
    return "\n".join(lines) + "\n"


def load_campaign(path: Path | str, overrides: list[str] = ()) -> Campaign:
    """Read and check a campaign file (see the module's docstring). Raises CampaignError; creates nothing."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise CampaignError(f"cannot read {path}: {exc.strerror}",
                            fix="pass a campaign TOML such as configs/campaign-example.toml") from None
    return parse_campaign(text, source=str(path), overrides=overrides)


def parse_campaign(text: str, *, source: str = "<campaign>", overrides: list[str] = ()) -> Campaign:
    """Parse and check a campaign's TOML text; every run's settings are resolved and validated."""
    from ..train.config import TrainConfigError, parse_override, resolve, validate

    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise CampaignError(f"{source} is not valid TOML: {exc}") from None
    table = data.pop("campaign", None)
    stats = data.pop("stats", {})
    if not isinstance(table, dict):
        raise CampaignError(f"{source} has no [campaign] table",
                            fix="add [campaign] with seeds = [...] and [[campaign.conditions]] (docs/campaigns.md)")
    if not isinstance(stats, dict):
        raise CampaignError(f"{source}: stats must be a table ([stats])")
    try:
        section = CampaignSection.model_validate(table)
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            where = ".".join(map(str, error["loc"]))
            if error["type"] == "extra_forbidden":
                close = difflib.get_close_matches(where, list(CampaignSection.model_fields), n=1, cutoff=0.6)
                problems.append(f"unknown key campaign.{where}" + (f"; did you mean campaign.{close[0]}?" if close else ""))
            elif error["type"] == "missing":
                problems.append(f"campaign.{where} is missing")
            else:
                problems.append(f"bad value for campaign.{where} ({json.dumps(error.get('input'), default=str)}): "
                                f"{error['msg'].removeprefix('Value error, ')}")
        raise CampaignError(f"{source}: " + "; ".join(problems), fix="docs/campaigns.md lists the [campaign] keys") from None

    conditions: list[Condition] = []
    for i, raw in enumerate(section.conditions):
        raw = dict(raw)
        cond_name = raw.pop("name", None)
        if not isinstance(cond_name, str) or not re.match(NAME_PATTERN, cond_name):
            raise CampaignError(f"{source}: condition #{i + 1} needs a name of letters, digits and _.+- "
                                f"(got {cond_name!r})", fix='add name = "..." to each [[campaign.conditions]]')
        if any(c.name == cond_name for c in conditions):
            raise CampaignError(f"{source}: two conditions are named {cond_name!r}", fix="give each condition its own name")
        conditions.append(Condition(cond_name, flatten(raw)))

    try:  # the file's train sections and the command line's overrides, before any condition
        command_line = {".".join(parse_override(o)[0]) for o in overrides}
        resolve(source, list(overrides), base=data)
    except TrainConfigError as exc:
        raise CampaignError(f"{source}: {exc}", fix=exc.fix) from None
    reserved = SEED_KEYS[section.seed_mode] + CAMPAIGN_KEYS
    for where, keys in [("the file's train sections", flatten(data)),
                        *((f"condition {c.name}", c.overrides) for c in conditions),
                        ("the command line", command_line)]:
        taken = sorted(k for k in keys if k in reserved)
        if taken:
            raise CampaignError(f"{source}: {where} sets {', '.join(taken)}, which the campaign sets itself "
                                f"(seed_mode = {section.seed_mode!r})",
                                fix="drop it; the campaign's seeds and seed_mode decide the seeds (docs/campaigns.md)")

    runs: list[PlannedRun] = []
    for cond in conditions:
        for seed in section.seeds:
            seeds = {key: seed for key in SEED_KEYS[section.seed_mode]}
            labels = {"labels.condition": cond.name, "labels.seed": seed}
            # The child gets everything as overrides (the file's train sections first): `rollmarket train`
            # would refuse the campaign file's [campaign] and [stats] tables.
            run_overrides = ([f"{k}={_toml_value(v)}" for k, v in {**flatten(data), **cond.overrides, **seeds}.items()]
                             + list(overrides) + [f"{k}={_toml_value(v)}" for k, v in labels.items()])
            try:
                config = resolve(source, run_overrides, base={})
                validate(config, local=True)
            except TrainConfigError as exc:
                raise CampaignError(f"{source}: condition {cond.name}: {exc}", fix=exc.fix) from None
            runs.append(PlannedRun(cond.name, seed, run_overrides, config))
    return Campaign(name=section.name, text=text, source=source, base=data, conditions=conditions,
                    seeds=list(section.seeds), seed_mode=section.seed_mode, parallel=section.parallel, stats=stats,
                    overrides=list(overrides), runs=runs)


def new_campaign_dir_name() -> str:
    """runs/campaign-<UTC stamp>-<id>: the run directories' naming (runs.py) with a prefix."""
    return f"campaign-{datetime.now(timezone.utc).strftime('%Y%m%dT%H%M%SZ')}-{secrets.token_hex(3)}"


# -- the state of a campaign directory --------------------------------------------------------------

RunState = Literal["pending", "running", "resuming", "done", "failed"]


@dataclass
class RunStatus:
    """Where one run of a campaign stands (what the progress view shows)."""

    condition: str
    seed: int
    key: str
    steps: int
    state: RunState = "pending"
    step: int = 0
    """The newest step with a metrics row (0: none yet, or only the evaluation before training)."""
    run_dir: Path | None = None
    skipped: bool = False
    """Finished before this process started (summary.json was there)."""
    resumed: bool = False
    """Continued with `rollmarket train --resume` by this process."""
    returncode: int | None = None
    log: Path | None = None
    started: float | None = None
    finished: float | None = None


def run_dir_of(root: Path) -> Path | None:
    """The run directory `rollmarket train` made under `root` (the one holding config.json), if any."""
    found = sorted(p.parent for p in root.glob("*/config.json"))
    return found[0] if found else None


def last_step(run_dir: Path | None) -> int:
    """The newest step with a metrics row in run_dir/metrics.jsonl (a torn last line is skipped)."""
    rows = read_step_rows(run_dir / "metrics.jsonl")[0] if run_dir else []
    return rows[-1]["step"] if rows else 0


def _comparable(config: dict) -> dict:
    """A config.json's settings less what may differ between two processes of the same run."""
    return {k: v for k, v in config.items() if k != "runs_root"}


def _config_differences(a: dict, b: dict) -> list[str]:
    fa, fb = flatten(_comparable(a)), flatten(_comparable(b))
    return sorted(k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k))


class CampaignRunner:
    """Runs (or resumes) a campaign in `out`. `on_update(statuses)` sees every change and each poll."""

    POLL_S = 0.5

    def __init__(self, campaign: Campaign, out: Path, *, parallel: int | None = None,
                 on_update: Callable[[list[RunStatus]], None] | None = None, python: str = sys.executable):
        self.campaign = campaign
        self.out = Path(out)
        self.parallel = parallel or campaign.parallel or os.cpu_count() or 1
        self.on_update = on_update or (lambda statuses: None)
        self.python = python
        self.statuses = [RunStatus(r.condition, r.seed, r.key, r.config.loop.steps) for r in campaign.runs]
        self._lock_fd: int | None = None

    # -- the directory ------------------------------------------------------------------------------

    def check(self) -> None:
        """Refuse a directory that holds another campaign, or runs whose saved settings differ from this
        plan (CampaignError); `run` checks it too, this is for callers that want to know before."""
        from ..train.config import TrainConfigError, resolve

        manifest = self.out / MANIFEST
        if self.out.exists() and not manifest.exists() and any(self.out.iterdir()):
            raise CampaignError(f"{self.out} exists and is not a campaign directory (no {MANIFEST})",
                                fix="pass --out with a new or empty directory, or an earlier campaign's directory")
        if not manifest.exists():
            return
        saved = json.loads(manifest.read_text())
        ours = self.campaign.manifest()
        for key in ("name", "conditions", "seeds", "seed_mode"):
            if saved.get(key) != ours[key]:
                raise CampaignError(f"{self.out} holds another campaign: its {key} differ from {self.campaign.source}'s",
                                    fix="run it with the campaign file it was started with, or pass another --out")
        for run in self.campaign.runs:
            run_dir = run_dir_of(self.out / "runs" / run.key)
            if run_dir is None:
                continue
            saved = json.loads((run_dir / "config.json").read_text()).get("config", {})
            try:  # as `rollmarket train --resume` reads it: keys added since take their defaults
                stored = resolve(None, [], base=saved).model_dump(mode="json")
            except TrainConfigError as exc:
                raise CampaignError(f"{run_dir}: its saved settings no longer resolve ({exc})") from None
            differ = _config_differences(stored, run.config.model_dump(mode="json"))
            if differ:
                raise CampaignError(f"{run_dir} was started with other settings than this campaign gives it "
                                    f"({', '.join(differ[:5])})",
                                    fix="resume with the same file and overrides, or pass another --out")

    def _lock(self) -> None:
        self._lock_fd = os.open(self.out / ".lock", os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            self._lock_fd = None
            raise CampaignError(f"another process is running the campaign in {self.out}",
                                fix="wait for it, or stop it; a rerun then resumes") from None

    def _write_manifest(self) -> None:
        manifest = self.campaign.manifest()
        manifest["code"] = code_version()
        manifest["parallel"] = self.parallel
        for entry, status in zip(manifest["runs"], self.statuses):
            entry["dir"] = str(status.run_dir.relative_to(self.out)) if status.run_dir else None
            entry["status"] = status.state
        write_json(self.out / MANIFEST, manifest)

    # -- running ------------------------------------------------------------------------------------

    def _start(self, run: PlannedRun, status: RunStatus) -> subprocess.Popen:
        root = (self.out / "runs" / run.key).resolve()
        root.mkdir(parents=True, exist_ok=True)
        status.run_dir = run_dir_of(root)
        if status.run_dir is not None:
            args = ["train", "--resume", str(status.run_dir), "--local"]
            status.state, status.resumed = "resuming", True
        else:
            for leftover in root.iterdir():  # a run directory killed before its config.json was written
                if leftover.is_dir():
                    shutil.rmtree(leftover)
            args = ["train", "--local", *run.overrides, f"runs_root={_toml_value(str(root))}"]
            status.state = "running"
        status.log = root / LOG
        status.started, status.returncode, status.finished = time.monotonic(), None, None
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        with open(status.log, "a") as log:
            log.write(f"$ rollmarket {' '.join(args)}\n")
            log.flush()
            return subprocess.Popen([self.python, "-m", "rollmarket", *args], stdout=log, stderr=subprocess.STDOUT,
                                    env=env, preexec_fn=die_with_parent())

    def run(self) -> list[RunStatus]:
        """Run every unfinished run (at most `parallel` at once) and return their statuses.

        Raises CampaignError for a directory that cannot take this campaign and CampaignFailed when
        some runs failed (the others ran to the end)."""
        self.check()
        self.out.mkdir(parents=True, exist_ok=True)
        self._lock()
        try:
            return self._run()
        finally:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _run(self) -> list[RunStatus]:
        queue: list[tuple[PlannedRun, RunStatus]] = []
        for run, status in zip(self.campaign.runs, self.statuses):
            status.run_dir = run_dir_of(self.out / "runs" / run.key)
            status.step = last_step(status.run_dir)
            if status.run_dir is not None and (status.run_dir / "summary.json").exists():
                status.state, status.skipped = "done", True
            else:
                queue.append((run, status))
        self._write_manifest()
        self.on_update(self.statuses)
        running: dict[str, tuple[subprocess.Popen, RunStatus]] = {}
        try:
            while queue or running:
                while queue and len(running) < self.parallel:
                    run, status = queue.pop(0)
                    running[run.key] = (self._start(run, status), status)
                    self._write_manifest()
                for key, (process, status) in list(running.items()):
                    if status.run_dir is None:
                        status.run_dir = run_dir_of(self.out / "runs" / key)
                        if status.run_dir is not None:
                            self._write_manifest()
                    status.step = last_step(status.run_dir)
                    code = process.poll()
                    if code is None:
                        continue
                    del running[key]
                    status.returncode, status.finished = code, time.monotonic()
                    status.run_dir = run_dir_of(self.out / "runs" / key)
                    status.step = last_step(status.run_dir)
                    finished = code == 0 and status.run_dir is not None and (status.run_dir / "summary.json").exists()
                    status.state = "done" if finished else "failed"
                    self._write_manifest()
                self.on_update(self.statuses)
                if running:
                    time.sleep(self.POLL_S)  # polling the children's files and exit codes
        finally:
            for process, _ in running.values():  # interrupted (Ctrl-C): the runs stop here and resume later
                process.terminate()
            for process, _ in running.values():
                process.wait()
        failed = [s for s in self.statuses if s.state == "failed"]
        if failed:
            raise CampaignFailed(f"{len(failed)} of {len(self.statuses)} runs failed: "
                                 + ", ".join(f"{s.key} (exit {s.returncode}, log {s.log})" for s in failed))
        return self.statuses


def run_campaign(campaign: Campaign, out: Path, *, parallel: int | None = None,
                 on_update: Callable[[list[RunStatus]], None] | None = None) -> dict[tuple[str, int], Path]:
    """Run or resume `campaign` in `out`; (condition, seed) → run directory. Raises CampaignFailed."""
    statuses = CampaignRunner(campaign, out, parallel=parallel, on_update=on_update).run()
    return {(s.condition, s.seed): s.run_dir for s in statuses}


def read_manifest(campaign_dir: Path) -> dict:
    """A campaign directory's campaign.json."""
    path = Path(campaign_dir) / MANIFEST
    if not path.is_file():
        raise CampaignError(f"{campaign_dir} is not a campaign directory (no {MANIFEST})",
                            fix="pass the directory `rollmarket campaign` printed")
    return json.loads(path.read_text())
