"""Every kind of run under `--runs`: what the index page lists (files are the source of truth).

Discovery walks the runs directory a few levels deep (campaign runs sit at
`<campaign>/runs/<condition>__s<seed>/<stamp-id>/`) and recognises a directory by its files:

    campaign   campaign.json                       (`rollmarket campaign --out`; its id is its name)
    demo       metrics.jsonl or a training config.json, and summary.json's "demo" block (`rollmarket demo`)
    train      metrics.jsonl or a training config.json (`rollmarket train`)
    observe    matrix.json and no training files   (`rollmarket observe`)
    collect    config.json with "tasks" and "model_url" (`rollmarket collect`)

A run's status is read from its files, never from a process table it does not own:

    finished   summary.json exists (every writer writes it last); an observatory run's matrix.json
    running    no summary yet, and a file of the run changed within `stale_after_s`; a campaign's
               `.lock` is flock-held (by the campaign process, seen in /proc/locks)
    crashed    no summary and nothing changed for `stale_after_s`; a campaign whose lock nobody holds
               while some of its runs are unfinished; a campaign run whose campaign is not running

A run that stops changing might be slow rather than dead (a long evaluation), so the window is
generous (15 minutes) and a later write turns it back to running on the next request.

Parsed files are cached by (size, mtime); a JSONL file that only grew is read from where the last
read stopped (`JsonlTail`), so a live run's page costs its new lines, not the whole file.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from enum import Enum
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field

from ..contracts import Record
from .data import DashboardError, Missing, RunSummary
from .data import IndexPage as ObservatoryIndex

MAX_DEPTH = 4
"""How deep discovery looks below --runs: <campaign>/runs/<condition>__s<seed>/<run> is 4."""
STALE_AFTER_S = 15 * 60
"""A run without summary.json whose files have not changed for this long is called crashed."""
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
    inode: int = -1
    offset: int = 0
    mtime_ns: int = -1
    rows: list[dict] = field(default_factory=list)


class JsonlTail:
    """The rows of JSONL files that writers only append to, read incrementally.

    For each path it keeps the rows read so far and the byte offset after the last whole line; a
    request reads only the bytes appended since. A file that shrank or was replaced (another inode)
    is read again from the start. A torn last line (the writer is mid-line) is left for the next
    read; a torn line in the middle (a crash the writer repaired by rewriting) is skipped, as
    runs.read_step_rows does."""

    def __init__(self, max_files: int = 256):
        self._files: dict[str, _Tail] = {}
        self._lock = threading.Lock()
        self._max = max_files

    def rows(self, path: Path) -> list[dict]:
        """Every whole row of `path` ([] when it does not exist). The list is shared: do not change it."""
        key = str(path)
        try:
            st = os.stat(key)
        except FileNotFoundError:
            return []
        with self._lock:
            tail = self._files.get(key)
            if tail is None or st.st_ino != tail.inode or st.st_size < tail.offset:
                tail = _Tail(inode=st.st_ino)
                if len(self._files) >= self._max:
                    self._files.pop(next(iter(self._files)))
                self._files[key] = tail
            if st.st_size == tail.offset and st.st_mtime_ns == tail.mtime_ns:
                return tail.rows
            with open(key, "rb") as f:
                f.seek(tail.offset)
                data = f.read(st.st_size - tail.offset)
            end = data.rfind(b"\n") + 1  # only whole lines; the rest waits for its newline
            added = []
            for line in data[:end].splitlines():
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                if isinstance(row, dict):
                    added.append(row)
            # A new list, so that a caller holding the old one never sees it change under it.
            tail.rows = tail.rows + added if added else tail.rows
            tail.offset += end
            tail.mtime_ns = st.st_mtime_ns
            return tail.rows


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


# ----------------------------------------------------------------------------- discovery


def is_training_dir(path: Path) -> bool:
    if (path / "metrics.jsonl").is_file():
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

    def walk(folder: Path, depth: int, campaign: Path | None) -> None:
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return
        deeper = []
        for child in children:
            kind = _kind(child)
            if kind is not None and child.name not in found:
                found[child.name] = Found(child.name, kind, child, campaign)
            if kind is RunKind.campaign:
                deeper.append((child, child))
            elif kind is None and child.name not in SKIP_DIRS:
                deeper.append((child, campaign))
        if depth < max_depth:
            for child, within in deeper:
                walk(child, depth + 1, within)

    if runs_dir.is_dir():
        walk(runs_dir, 1, None)
    return found


def started_at(run_id: str, path: Path) -> str | None:
    match = STAMP.match(run_id)
    if match:
        return datetime.strptime(match.group(1), "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc).isoformat()
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


def last_value(rows: list[dict], key: str) -> float | None:
    """The value of `key` in the last row that has a number there."""
    for row in reversed(rows):
        value = row.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


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
        rows = TAIL.rows(found.path / "metrics.jsonl")
        config = read_json(found.path / "config.json") or {}
        planned = ((config.get("config") or {}).get("loop") or {}).get("steps")
        steps = [r["step"] for r in rows if isinstance(r.get("step"), int)]
        trained = [r for r in rows if r.get("step", 0) > 0]
        return dict(steps_done=max(steps) if steps else None, steps_planned=planned, unit="steps",
                    pass1=last_value(rows, "eval/pass@1"), accuracy=last_value(rows, "eval/accuracy/mean"),
                    mean_reward=last_value(trained, "critic/rewards/mean"))

    def _numbers_campaign(self, found: Found) -> dict[str, Any]:
        manifest = read_json(found.path / "campaign.json") or {}
        runs = manifest.get("runs") or []
        finals = []
        for run in runs:
            run_dir = run.get("dir")
            if run_dir:
                value = last_value(TAIL.rows(self._campaign_run(found.path, Path(run_dir)) / "metrics.jsonl"),
                                   "eval/pass@1")
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
                     runs=observatory.runs)
