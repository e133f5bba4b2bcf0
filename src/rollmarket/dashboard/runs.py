"""Every kind of run under `--runs`: what the index page lists (files are the source of truth).

Discovery walks the runs directory a few levels deep (campaign runs sit at
`<campaign>/runs/<condition>__s<seed>/<stamp-id>/`) and recognises a directory by its files:

    campaign   campaign.json                       (`rollmarket campaign --out`; its id is its name)
    demo       metrics.jsonl or a training config.json, and summary.json's "demo" block (`rollmarket demo`)
    train      metrics.jsonl or a training config.json (`rollmarket train`)
    observe    matrix.json and no training files   (`rollmarket observe`)
    collect    config.json with "tasks" and "model_url" (`rollmarket collect`)

A run's status is read from its files and, on the host that ran it, from whether the processes it
recorded (`processes.jsonl`: pid, host, boot id and start time, so a reused pid is not mistaken for
it) still run:

    finished   summary.json exists (every writer writes it last); an observatory run's matrix.json
    running    no summary yet, and a process it recorded on this host runs; with no such record (older
               runs, another host's), a file of the run changed within `stale_after_s`; a campaign's
               `.lock` is flock-held (by the campaign process, seen in /proc/locks)
    crashed    no summary and every process it recorded is gone; with no such record, nothing changed
               for `stale_after_s`; a campaign whose lock nobody holds while some of its runs are
               unfinished; a campaign run whose campaign is not running

Where only the files can tell, a run that stops changing might be slow rather than dead (a long
evaluation), so the window is generous (15 minutes) and a later write turns it back to running.

Parsed files are cached by (size, mtime); a JSONL file that only grew is read from where the last
read stopped (`JsonlTail`), so a live run's page costs its new lines, not the whole file.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from bisect import bisect_right
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field
from pydantic_core import from_json

from ..contracts import Record
from ..runs import process_alive, read_processes
from .data import DashboardError, Missing, RunSummary
from .probes import ProbeEntry, probe_entries
from .data import IndexPage as ObservatoryIndex

MAX_DEPTH = 4
"""How deep discovery looks below --runs: <campaign>/runs/<condition>__s<seed>/<run> is 4."""
STALE_AFTER_S = 15 * 60
"""A run without summary.json whose files have not changed for this long is called crashed."""
HEADLINE = ("eval/pass@1", "eval/accuracy/mean", "critic/rewards/mean")
"""The metrics the index shows of a training run (their newest values)."""
SKIP_DIRS = {"checkpoints", "logs", "workers", "reports", "viewer", "trainer", "__pycache__"}
"""Folders inside runs that never hold other runs (not walked, for speed)."""
STAMP = re.compile(r"^(\d{8}T\d{6}Z)-[0-9a-z]+$")


class RunKind(str, Enum):
    train = "train"
    demo = "demo"
    campaign = "campaign"
    observe = "observe"
    collect = "collect"


class RunStatus(str, Enum):
    running = "running"
    finished = "finished"
    crashed = "crashed"


SORT_KEYS = ("run_id", "kind", "status", "started_at", "steps_done", "pass1", "accuracy", "mean_reward")
"""Columns the index sorts by (`?sort=<column>`, `-<column>` for descending)."""


class RunEntry(Record):
    """One run of any kind as the index lists it."""

    run_id: str = Field(description="The directory's name: the run's id in every URL.")
    kind: RunKind
    status: RunStatus
    path: str = Field(description="The run's directory relative to --runs.")
    started_at: str | None = Field(description="UTC, from the directory's stamp (else its config's mtime).")
    steps_done: int | None = Field(description="Train/demo: the last metrics row's step; campaign: finished runs; "
                                               "collect: agent runs written; observe: matrix cells.")
    steps_planned: int | None
    unit: str = Field(description="What steps count: steps, runs or cells.")
    pass1: float | None = Field(description="Held-out pass@1 at the last evaluation (campaign: mean over its runs).")
    accuracy: float | None = Field(description="Held-out greedy accuracy at the last evaluation; collect: pass rate.")
    mean_reward: float | None = Field(description="Mean reward of the last training step; collect: of its runs.")
    campaign: str | None = Field(default=None, description="The campaign this run belongs to.")
    observatory: bool = Field(default=False, description="Whether it has an observatory page (/runs/<id>).")
    error: str | None = Field(default=None, description="Why a file of the run could not be read.")


# ----------------------------------------------------------------------------- incremental JSONL


@dataclass
class _Tail:
    """Where the last read of an append-only file stopped."""

    inode: int = -1
    offset: int = 0
    mtime_ns: int = -1


def read_appended(path: Path, tail: _Tail) -> tuple[list[dict], bool] | None:
    """The rows appended to `path` since `tail` (which moves on), and whether the file had to be
    read from the start (it shrank or was replaced: a resume's repair); None when it does not exist.

    Only whole lines count: a torn last line (the writer is mid-line) waits for its newline. A line
    that does not parse in the middle (a crash the writer later repaired by rewriting) is skipped,
    as runs.read_step_rows does."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    reset = st.st_ino != tail.inode or st.st_size < tail.offset
    if reset:
        tail.inode, tail.offset, tail.mtime_ns = st.st_ino, 0, -1
    if st.st_size == tail.offset and st.st_mtime_ns == tail.mtime_ns:
        return [], reset
    with open(path, "rb") as f:
        f.seek(tail.offset)
        data = f.read(st.st_size - tail.offset)
    end = data.rfind(b"\n") + 1
    added = []
    for line in data[:end].splitlines():
        if not line.strip():
            continue
        try:
            row = from_json(line, cache_strings="keys")  # pydantic's parser: a third faster than json's here
        except ValueError:
            continue
        if isinstance(row, dict):
            added.append(row)
    tail.offset += end
    tail.mtime_ns = st.st_mtime_ns
    return added, reset


class JsonlTail:
    """The rows of JSONL files that writers only append to, read incrementally (`read_appended`):
    a request reads only the bytes appended since the last one."""

    def __init__(self, max_files: int = 256):
        self._files: dict[str, tuple[_Tail, list[dict]]] = {}
        self._lock = threading.Lock()
        self._max = max_files

    def rows(self, path: Path) -> list[dict]:
        """Every whole row of `path` ([] when it does not exist). The list is shared: do not change it."""
        key = str(path)
        with self._lock:
            tail, rows = self._files.get(key) or (_Tail(), [])
            read = read_appended(path, tail)
            if read is None:
                self._files.pop(key, None)
                return []
            added, reset = read
            # A new list, so that a caller holding the old one never sees it change under it.
            rows = added if reset else (rows + added if added else rows)
            if key not in self._files and len(self._files) >= self._max:
                self._files.pop(next(iter(self._files)))
            self._files[key] = (tail, rows)
            return rows


NUMBERS = {int, float, type(None)}


def _number(value: Any) -> float | None:
    """A metric's value as a float; None for labels (strings), booleans, nulls and NaN/inf."""
    kind = type(value)
    if kind is float:
        return value if value - value == 0 else None  # inf − inf and nan − nan are nan
    return float(value) if kind is int else None


@dataclass
class Columns:
    """A metrics.jsonl as columns: every numeric key, one value per step (None where a row lacks it)."""

    tail: _Tail = field(default_factory=_Tail)
    steps: list[int] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    """Seconds since the start: the running sum of timing_s/step."""
    tokens: list[float] = field(default_factory=list)
    """Response tokens so far: the running sum of perf/total_num_tokens."""
    columns: dict[str, list[float | None]] = field(default_factory=dict)

    def extend(self, rows: list[dict]) -> None:
        """Append `rows` (parsed metrics rows; those without an integer step are skipped).

        Column by column rather than row by row: a comprehension per key is several times faster
        than a Python loop over every value of a 10,000-step file."""
        rows = [r for r in rows if type(r.get("step")) is int]
        if not rows:
            return
        n, steps, columns = len(self.steps), self.steps, self.columns
        steps.extend(r["step"] for r in rows)
        for total, key, out in ((self.wall_s[-1] if self.wall_s else 0.0, "timing_s/step", self.wall_s),
                                (self.tokens[-1] if self.tokens else 0.0, "perf/total_num_tokens", self.tokens)):
            for value in (_number(r.get(key)) or 0.0 for r in rows):
                total += value
                out.append(total)
        keys: set[str] = set()
        for r in rows:
            keys.update(r)
        keys.discard("step")
        for key in keys:
            values = [r.get(key) for r in rows]
            kinds = set(map(type, values))
            if kinds <= NUMBERS:
                if int in kinds:
                    values = [None if v is None else float(v) for v in values]
                total = sum(filter(None, values))  # nan or inf when any value is (or, rarely, the sum overflows)
                if total - total != 0:
                    values = [_number(v) for v in values]
            else:
                values = [_number(v) for v in values]  # labels, booleans, lists: not numbers
            column = columns.get(key)
            if column is None:
                if all(v is None for v in values):
                    continue  # a key that never held a number (a label, a null) is no column
                column = columns[key] = [None] * n
            column.extend(values)
        for column in columns.values():
            if len(column) < len(steps):
                column.extend([None] * (len(steps) - len(column)))

    def last(self, key: str) -> float | None:
        """The newest value of `key` (its last non-null)."""
        for value in reversed(self.columns.get(key, ())):
            if value is not None:
                return value
        return None


@dataclass(frozen=True)
class ColumnsView:
    """Steps `start`… of a run's columns, copied under the lock (a consistent snapshot)."""

    steps: list[int]
    wall_s: list[float]
    tokens: list[float]
    columns: dict[str, list[float | None]]
    """The columns asked for (all by default); a key the file lacks is absent."""
    last_step: int | None
    names: list[str]
    """Every numeric key of the file, sorted (whichever columns were asked for)."""


class MetricColumns:
    """metrics.jsonl of each run as columns, extended with the rows appended since the last read;
    the parsed rows themselves are not kept (a 10,000-step run's dicts would cost far more)."""

    def __init__(self, max_files: int = 2048) -> None:
        # Enough for every run of a large runs directory: the index reads each run's headline, and a
        # cache smaller than the directory would parse every file again on every request.
        self._cache: dict[str, Columns] = {}
        self._lock = threading.Lock()
        self._max = max_files

    def _update(self, path: Path) -> Columns:
        key = str(path)
        cols = self._cache.get(key) or Columns()
        read = read_appended(path, cols.tail)
        if read is None:
            self._cache.pop(key, None)
            return Columns()
        added, reset = read
        if reset and cols.steps:
            cols = Columns(tail=cols.tail)
        cols.extend(added)
        if key not in self._cache and len(self._cache) >= self._max:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = cols
        return cols

    def view(self, path: Path, after: int | None = None, keys: Iterable[str] | None = None) -> ColumnsView:
        """The columns of steps > `after` (all steps when None), of `keys` (every column when None)."""
        with self._lock:
            cols = self._update(path)
            # Steps increase down the file (the trainer repairs it on resume), so `after` is a cut.
            start = 0 if after is None else bisect_right(cols.steps, after)
            wanted = cols.columns if keys is None else [k for k in dict.fromkeys(keys) if k in cols.columns]
            return ColumnsView(steps=cols.steps[start:], wall_s=cols.wall_s[start:], tokens=cols.tokens[start:],
                               columns={k: cols.columns[k][start:] for k in wanted},
                               last_step=cols.steps[-1] if cols.steps else None, names=sorted(cols.columns))

    def headline(self, path: Path, keys: tuple[str, ...]) -> tuple[int | None, dict[str, float | None]]:
        """The last step and the newest value of each of `keys` (what the index shows)."""
        with self._lock:
            cols = self._update(path)
            return (cols.steps[-1] if cols.steps else None), {k: cols.last(k) for k in keys}


COLUMNS = MetricColumns()
"""One columnar cache of metrics files for the process."""


TAIL = JsonlTail()
"""One incremental reader for the process: every page of every run shares its cache."""


def stat_key(path: Path) -> tuple[str, int, int] | None:
    try:
        st = path.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    return str(path), st.st_mtime_ns, st.st_size


@lru_cache(maxsize=512)
def _read_json(key: tuple[str, int, int]) -> Any:
    return json.loads(Path(key[0]).read_text())


def read_json(path: Path) -> Any:
    """A JSON file's value, cached by (size, mtime); None when missing. ValueError when it does not parse."""
    key = stat_key(path)
    return None if key is None else _read_json(key)


@lru_cache(maxsize=256)
def _count_lines(key: tuple[str, int, int]) -> int:
    with open(key[0], "rb") as f:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))


def count_lines(path: Path) -> int:
    key = stat_key(path)
    return 0 if key is None else _count_lines(key)


def flock_held(path: Path) -> bool | None:
    """Whether some process holds a flock on `path`, read from /proc/locks (never by taking the
    lock: a probe holding it would make the owner's own non-blocking lock fail). None where the
    system has no /proc/locks."""
    try:
        st = path.stat()
        text = Path("/proc/locks").read_text()
    except FileNotFoundError:
        return False if Path("/proc/locks").exists() else None
    except OSError:
        return None
    wanted = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(len(parts) > 5 and parts[1] == "FLOCK" and parts[5] == wanted
               for parts in (line.split() for line in text.splitlines()))


def processes_alive(path: Path) -> bool | None:
    """Whether a process the run recorded (`processes.jsonl`) still runs on this host: True if one
    does; False if every one is gone; None when the run recorded none or one ran elsewhere (then
    only its files can tell)."""
    states = [process_alive(p) for p in read_processes(path)]
    if True in states:
        return True
    return False if states and None not in states else None


# ----------------------------------------------------------------------------- discovery


def is_training_dir(path: Path) -> bool:
    if (path / "metrics.jsonl").is_file() or (path / "generations.jsonl").is_file():
        return True
    try:
        config = read_json(path / "config.json")
    except (ValueError, OSError):
        return False
    return isinstance(config, dict) and "config" in config


def _kind(path: Path) -> RunKind | None:
    if (path / "campaign.json").is_file():
        return RunKind.campaign
    if is_training_dir(path):
        try:
            summary = read_json(path / "summary.json")
        except (ValueError, OSError):
            summary = None
        return RunKind.demo if isinstance(summary, dict) and "demo" in summary else RunKind.train
    if (path / "matrix.json").is_file():
        return RunKind.observe
    try:
        config = read_json(path / "config.json")
    except (ValueError, OSError):
        return None
    if isinstance(config, dict) and "tasks" in config and "model_url" in config:
        return RunKind.collect
    return None


@dataclass(frozen=True)
class Found:
    """A run directory found under --runs."""

    run_id: str
    kind: RunKind
    path: Path
    campaign: Path | None = None
    """The campaign directory the run sits in, if any."""


def discover(runs_dir: Path, max_depth: int = MAX_DEPTH) -> dict[str, Found]:
    """Every run under `runs_dir` by id (its directory name), shallowest first; a second directory
    with a name already found is ignored (ids are unique stamps, so only a copy collides)."""
    found: dict[str, Found] = {}

    def level(folders: list[tuple[Path, Path | None]]) -> list[tuple[Path, Path | None]]:
        """Record the runs among these folders' children; return the children to look into next."""
        deeper = []
        for folder, campaign in folders:
            try:
                children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
            except OSError:
                continue
            for child in children:
                kind = _kind(child)
                if kind is not None and child.name not in found:
                    found[child.name] = Found(child.name, kind, child, campaign)
                if kind is RunKind.campaign:
                    deeper.append((child, child))
                elif kind is None and child.name not in SKIP_DIRS:
                    deeper.append((child, campaign))
        return deeper

    def walk(root: Path, campaign: Path | None) -> None:
        # Level by level, so that of two directories with one name the shallower is found.
        frontier = [(root, campaign)]
        for _ in range(max_depth):
            frontier = level(frontier)
            if not frontier:
                break

    if runs_dir.is_dir():
        # --runs may itself be a run or a campaign (`--runs experiments/results/exp-a2`).
        kind = _kind(runs_dir)
        if kind is not None:
            name = runs_dir.resolve().name
            found[name] = Found(name, kind, runs_dir, None)
        walk(runs_dir, runs_dir if kind is RunKind.campaign else None)
    return found


def find_run(runs_dir: Path, run_id: str, kinds: tuple[RunKind, ...], needs: str | None = None) -> Path | None:
    """The directory of run `run_id` (its name) under `runs_dir` if it is one of `kinds` and holds the
    file `needs`; None otherwise. The one lookup every page uses, so they all agree on what a run is."""
    hit = discover(Path(runs_dir)).get(run_id)
    if hit is None or hit.kind not in kinds or (needs is not None and not (hit.path / needs).is_file()):
        return None
    return hit.path


def started_at(run_id: str, path: Path) -> str | None:
    match = STAMP.match(run_id)
    if match:
        try:
            return datetime.strptime(match.group(1), "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc).isoformat()
        except ValueError:
            pass  # a name shaped like a stamp that is no date: the files say when
    for name in ("config.json", "campaign.json", "matrix.json"):
        try:
            return datetime.fromtimestamp((path / name).stat().st_mtime, timezone.utc).isoformat()
        except OSError:
            continue
    return None


def last_change(path: Path) -> float:
    """The newest mtime of the run's own files and of its logs/ and workers/ (what a live run touches)."""
    newest = 0.0
    for folder in (path, path / "logs", path / "workers"):
        try:
            with os.scandir(folder) as entries:
                for entry in entries:
                    try:
                        newest = max(newest, entry.stat().st_mtime)
                    except OSError:
                        continue
        except OSError:
            continue
    return newest


class RunIndex:
    """Every run under one directory, with its status and headline numbers."""

    def __init__(self, runs_dir: Path, *, stale_after_s: float = STALE_AFTER_S, observatory_ids=None):
        self.runs_dir = Path(runs_dir)
        self.stale_after_s = stale_after_s
        self._observatory_ids = observatory_ids
        """A callable giving the ids the observatory pages serve (data.Runs.run_ids)."""

    def find(self) -> dict[str, Found]:
        return discover(self.runs_dir)

    def campaign_running(self, campaign: Path) -> bool:
        held = flock_held(campaign / ".lock")
        if held is None:  # no /proc/locks: judge by the files as for a run
            return time.time() - last_change(campaign) < self.stale_after_s
        return held

    def status(self, found: Found) -> RunStatus:
        path = found.path
        if found.kind is RunKind.campaign:
            manifest = read_json(path / "campaign.json") or {}
            runs = manifest.get("runs") or []
            if runs and all(r.get("status") == "done" for r in runs):
                return RunStatus.finished
            return RunStatus.running if self.campaign_running(path) else (
                RunStatus.finished if not runs else RunStatus.crashed)
        if found.kind is RunKind.observe or (path / "summary.json").is_file():
            return RunStatus.finished
        if found.campaign is not None and not self.campaign_running(found.campaign):
            return RunStatus.crashed
        alive = processes_alive(path)
        if alive is not None:
            return RunStatus.running if alive else RunStatus.crashed
        fresh = time.time() - last_change(path) < self.stale_after_s
        return RunStatus.running if fresh else RunStatus.crashed

    def entry(self, found: Found, observatory: set[str] = frozenset()) -> RunEntry:
        """The index row of one run; a file that does not parse gives a row with `error`.
        `observatory`: the ids the observatory pages serve."""
        base = dict(run_id=found.run_id, kind=found.kind, path=str(found.path.relative_to(self.runs_dir)),
                    started_at=started_at(found.run_id, found.path),
                    campaign=found.campaign.name if found.campaign else None,
                    observatory=found.run_id in observatory)
        empty = dict(steps_done=None, steps_planned=None, unit="steps", pass1=None, accuracy=None, mean_reward=None)
        try:
            status = self.status(found)
            numbers = getattr(self, f"_numbers_{found.kind.value if found.kind is not RunKind.demo else 'train'}")(
                found)
        except (ValueError, OSError, TypeError, AttributeError) as exc:
            return RunEntry(**base, **empty, status=RunStatus.crashed, error=f"{type(exc).__name__}: {exc}")
        return RunEntry(**base, **{**empty, **numbers}, status=status)

    def _numbers_train(self, found: Found) -> dict[str, Any]:
        last, values = COLUMNS.headline(found.path / "metrics.jsonl", HEADLINE)
        config = read_json(found.path / "config.json") or {}
        planned = ((config.get("config") or {}).get("loop") or {}).get("steps")
        return dict(steps_done=last, steps_planned=planned, unit="steps", pass1=values["eval/pass@1"],
                    accuracy=values["eval/accuracy/mean"], mean_reward=values["critic/rewards/mean"])

    def _numbers_campaign(self, found: Found) -> dict[str, Any]:
        manifest = read_json(found.path / "campaign.json") or {}
        runs = manifest.get("runs") or []
        finals = []
        for run in runs:
            run_dir = run.get("dir")
            if run_dir:
                path = self._campaign_run(found.path, Path(run_dir)) / "metrics.jsonl"
                value = COLUMNS.headline(path, ("eval/pass@1",))[1]["eval/pass@1"]
                if value is not None:
                    finals.append(value)
        return dict(steps_done=sum(r.get("status") == "done" for r in runs), steps_planned=len(runs), unit="runs",
                    pass1=sum(finals) / len(finals) if finals else None)

    @staticmethod
    def _campaign_run(campaign: Path, run_dir: Path) -> Path:
        """A manifest's run directory: as written, or (the campaign was moved) at the same place in it."""
        if run_dir.is_dir():
            return run_dir
        parts = run_dir.parts
        return campaign / Path(*parts[parts.index("runs"):]) if "runs" in parts else run_dir

    def _numbers_observe(self, found: Found) -> dict[str, Any]:
        matrix = read_json(found.path / "matrix.json")
        settings = matrix.get("settings") or {}
        planned = len(matrix.get("rollout_engines") or settings.get("rollout_engines") or []) * len(
            matrix.get("trainer_engines") or settings.get("trainer_engines") or [])
        return dict(steps_done=len(matrix.get("cells") or []), steps_planned=planned or None, unit="cells")

    def _numbers_collect(self, found: Found) -> dict[str, Any]:
        config = read_json(found.path / "config.json")
        summary = read_json(found.path / "summary.json")
        planned = (config.get("num_tasks") or 0) * (config.get("repeats") or 1) or None
        if summary is not None:
            return dict(steps_done=(summary.get("done") or 0) + (summary.get("skipped") or 0), steps_planned=planned,
                        unit="runs", accuracy=summary.get("pass_rate"), mean_reward=summary.get("mean_reward"))
        out = Path(config.get("out") or "")
        done = count_lines(out) if out.is_file() else None
        return dict(steps_done=done, steps_planned=planned, unit="runs")

    def entries(self) -> list[RunEntry]:
        observatory = set(self._observatory_ids()) if self._observatory_ids else set()
        return [self.entry(f, observatory) for f in self.find().values()]


def filter_and_sort(entries: list[RunEntry], *, kind: RunKind | None = None, status: RunStatus | None = None,
                    q: str | None = None, sort: str = "-started_at") -> list[RunEntry]:
    """The index's server-side filter and sort (the page does the same client side). Runs without
    a value in the sort column go last either way."""
    out = [e for e in entries if (kind is None or e.kind is kind) and (status is None or e.status is status)
           and (not q or q.lower() in f"{e.run_id} {e.path} {e.campaign or ''}".lower())]
    column = sort.lstrip("-")
    descending = sort.startswith("-")

    def value(e: RunEntry):
        v = getattr(e, column)
        return v.value if isinstance(v, Enum) else v

    present = sorted((e for e in out if value(e) is not None), key=lambda e: (value(e), e.run_id),
                     reverse=descending)
    return present + sorted((e for e in out if value(e) is None), key=lambda e: e.run_id)


# ----------------------------------------------------------------------------- the index page


class IndexPage(Record):
    """The runs index (`/`): every kind of run, filtered and sorted as the query asks."""

    runs_dir: str
    entries: list[RunEntry] = Field(description="Every run of every kind that passes the filters, in `sort` order.")
    total: int = Field(description="Runs found before filtering.")
    kind: RunKind | None = None
    status: RunStatus | None = None
    q: str | None = Field(default=None, description="Text the run's id, path or campaign contains.")
    sort: str = Field(default="-started_at", description="A column of SORT_KEYS, '-' first for descending.")
    runs: list[RunSummary] = Field(description="The observatory runs' details (matrix.json), newest first.")
    probes: list[ProbeEntry] = Field(description="Endpoint probe reports saved under <runs>/probes/ "
                                                 "(`rollmarket probe --out`), newest first; not filtered.")


def index_page(index: RunIndex, observatory: ObservatoryIndex, *, kind: str | None = None,
               status: str | None = None, q: str | None = None, sort: str | None = None) -> IndexPage:
    """The index record; an unknown kind, status or sort column is a typed 400."""
    def choice(name: str, value: str | None, enum):
        if not value:
            return None
        try:
            return enum(value)
        except ValueError:
            raise DashboardError(Missing.bad_query, f"{name}={value!r}: one of {', '.join(e.value for e in enum)}",
                                 parameter=name) from None

    kind_, status_ = choice("kind", kind, RunKind), choice("status", status, RunStatus)
    sort = sort or "-started_at"
    if sort.lstrip("-") not in SORT_KEYS:
        raise DashboardError(Missing.bad_query, f"sort={sort!r}: one of {', '.join(SORT_KEYS)} (- for descending)",
                             parameter="sort")
    entries = index.entries()
    return IndexPage(runs_dir=str(index.runs_dir), total=len(entries), kind=kind_, status=status_, q=q or None,
                     sort=sort, entries=filter_and_sort(entries, kind=kind_, status=status_, q=q, sort=sort),
                     runs=observatory.runs, probes=probe_entries(index.runs_dir))
