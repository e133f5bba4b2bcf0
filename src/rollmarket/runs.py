"""Run directories: `runs/<UTC timestamp>-<short id>/` holding config, metrics and reports."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from . import __version__


def code_version() -> dict[str, str]:
    """The package version and, when run from a git checkout, the commit."""
    info = {"rollmarket": __version__}
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5)
        if commit.returncode == 0:
            info["git_commit"] = commit.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def new_run_dir(root: Path | str = "runs", *, kind: str = "run") -> Path:
    """A new `<root>/<UTC stamp>-<short id>/` with its `logs/`, owned by this process (`record_process`)."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = Path(root) / f"{stamp}-{secrets.token_hex(3)}"
    path.mkdir(parents=True, exist_ok=False)
    (path / "logs").mkdir()
    record_process(path)
    return path


PROCESSES = "processes.jsonl"
"""The processes that worked on a run (one line each: its creator, each resume), in the run directory."""


@dataclass(frozen=True)
class RunProcess:
    """A process as a run directory records it: enough to tell, on its host, whether it still runs
    (a pid alone is not: the system hands it to a later process once this one is gone)."""

    pid: int
    host: str
    boot_id: str | None
    """/proc/sys/kernel/random/boot_id: a pid from before a reboot names nothing now."""
    start_ticks: int | None
    """The process's start, in clock ticks since boot (/proc/<pid>/stat field 22): a reused pid starts later."""
    started_at: str
    """UTC, for people."""


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """A live process's (state, start ticks) from /proc; None when there is no such process (or no /proc)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the name in parentheses may hold spaces
    return fields[0], int(fields[19])


def this_process() -> RunProcess:
    stat = _proc_stat(os.getpid())
    return RunProcess(pid=os.getpid(), host=socket.gethostname(), boot_id=_boot_id(),
                      start_ticks=stat[1] if stat else None,
                      started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"))


def record_process(run_dir: Path) -> None:
    """Add this process to the run's `processes.jsonl` (once), so a reader on the same host can tell
    a running run from a crashed one by liveness rather than by how long its files have been quiet."""
    me = this_process()
    if any((r.pid, r.start_ticks, r.host) == (me.pid, me.start_ticks, me.host) for r in read_processes(run_dir)):
        return
    with open(Path(run_dir) / PROCESSES, "a") as out:
        out.write(json.dumps(asdict(me)) + "\n")


def read_processes(run_dir: Path) -> list[RunProcess]:
    """The processes recorded in the run directory (lines that do not read are skipped)."""
    try:
        lines = (Path(run_dir) / PROCESSES).read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(RunProcess(**json.loads(line)))
        except (ValueError, TypeError):
            continue
    return out


def process_alive(process: RunProcess) -> bool | None:
    """Whether a recorded process still runs; None where this machine cannot tell (another host,
    or no /proc). A zombie (killed, not yet reaped) is not running."""
    if process.host != socket.gethostname() or process.start_ticks is None:
        return None
    boot = _boot_id()
    if boot is None:
        return None
    if process.boot_id != boot:
        return False
    stat = _proc_stat(process.pid)
    return stat is not None and stat[1] == process.start_ticks and stat[0] not in ("Z", "X")


def read_step_rows(path: Path) -> tuple[list[dict], bool]:
    """The rows of a per-step JSONL file (metrics.jsonl, evals.jsonl): JSON objects with an integer
    `step`, in file order; and whether the file is clean (no line a crash left half-written, a
    newline at the end). A missing file is empty and clean."""
    text = path.read_text() if path.exists() else ""
    lines = text.splitlines()
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line a crash tore
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            rows.append(row)
    return rows, len(rows) == len(lines) and (not text or text.endswith("\n"))


def write_json(path: Path, value: Any) -> None:
    """Write `value` as JSON, atomically (see `atomic_write_text`)."""
    atomic_write_text(path, json.dumps(value, indent=2, sort_keys=True, default=str) + "\n")


def fsync_dir(path: Path) -> None:
    """Make the directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    """Replace `path` with `text` all at once: a crash leaves the old file or the new, never a part.

    The text goes to a temporary file beside it, is fsynced, renamed over the old file, and the
    directory is fsynced so that the rename survives a power loss too.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as out:
        out.write(text)
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
