"""Run directories: `runs/<UTC timestamp>-<short id>/` holding config, metrics and reports."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
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
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    path = Path(root) / f"{stamp}-{secrets.token_hex(3)}"
    path.mkdir(parents=True, exist_ok=False)
    (path / "logs").mkdir()
    return path


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
