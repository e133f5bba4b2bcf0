"""Task directories on disk: a task's files written into a fresh temporary directory that the tools
work in, and throwaway copies of it for code that may scribble on it (python_eval).

Both are context managers and delete what they made on exit, even when the code inside left
files it had made unreadable.
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path, PurePosixPath
from typing import Any

from .tool import ToolContext


class UnsafeTaskPath(ValueError):
    """A task's file path that would land outside its directory (absolute, `..`, empty)."""


def check_task_path(path: str) -> PurePosixPath:
    """`path` as a relative path that stays inside the task directory, or UnsafeTaskPath."""
    pure = PurePosixPath(path)
    if not path or "\0" in path or pure.is_absolute() or ".." in pure.parts or pure == PurePosixPath("."):
        raise UnsafeTaskPath(f"task file path must be relative and stay inside the task directory: {path!r}")
    return pure


@contextmanager
def task_workspace(files: Mapping[str, str], state: dict[str, Any] | None = None) -> Iterator[ToolContext]:
    """A ToolContext whose workdir is a fresh directory holding `files` (relative path -> text).

    The directory always exists (empty when the task has no files) and is deleted on exit.
    Paths are checked before anything is written: an unsafe one raises UnsafeTaskPath.
    """
    checked = [(check_task_path(path), text) for path, text in files.items()]
    root = Path(tempfile.mkdtemp(prefix="rollmarket-task-")).resolve()
    try:
        for path, text in checked:
            target = root.joinpath(*path.parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
        yield ToolContext(workdir=root, state={} if state is None else state)
    finally:
        remove_tree(root)


@contextmanager
def scratch_copy(source: Path | None) -> Iterator[Path]:
    """A fresh directory holding a copy of `source` (symlinks copied as links, not followed), deleted on exit."""
    root = Path(tempfile.mkdtemp(prefix="rollmarket-scratch-")).resolve()
    try:
        if source is not None:
            shutil.copytree(source, root, symlinks=True, dirs_exist_ok=True)
        yield root
    finally:
        remove_tree(root)


def remove_tree(root: Path) -> None:
    """Delete `root`; when that fails, give back the owner permissions that code in it took away, and retry."""
    try:
        shutil.rmtree(root)
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    with suppress(OSError):
        os.chmod(root, stat.S_IRWXU)
    for dirpath, dirnames, _files in os.walk(root):
        for name in dirnames:  # top-down: each directory is opened up before the walk enters it
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                with suppress(OSError):
                    os.chmod(path, stat.S_IRWXU)
    shutil.rmtree(root, ignore_errors=True)
