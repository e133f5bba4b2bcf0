"""read_file: the text of a file below the task's directory, and nothing outside it.

Same schema as `tasks.tools_ref.read_file` and the same output for files that exist (the text
without trailing newlines; a missing file is 'error: no such file: <path>'). Absolute paths, `..`
and symlinks that resolve outside the directory are refused (outcome refused).
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any, ClassVar

from ...contracts import ToolOutcome
from ...tasks import tools_ref
from ..tool import Tool, ToolContext, ToolFailure

MAX_FILE_BYTES = 1024 * 1024
"""Larger files are not read (outcome resource_limit); the model sees at most MAX_OUTPUT_CHARS anyway."""


def resolve_below(workdir: Path, path: str) -> Path:
    """The real path of `path` inside `workdir`, or ToolFailure(refused) when it would leave it."""
    clean = path.strip()
    while clean.startswith("./"):
        clean = clean[2:]
    pure = PurePosixPath(clean)
    if pure.is_absolute() or ".." in pure.parts:
        raise ToolFailure(f"path is outside the task directory: {path}", ToolOutcome.refused)
    root = workdir.resolve()
    real = (root / pure).resolve()
    if not real.is_relative_to(root):  # a symlink pointing out
        raise ToolFailure(f"path is outside the task directory: {path}", ToolOutcome.refused)
    return real


class ReadFile(Tool):
    """Read a text file of the task (paths relative to the task directory; a leading './' is fine)."""

    name: ClassVar[str] = tools_ref.READ_FILE["function"]["name"]
    description: ClassVar[str] = tools_ref.READ_FILE["function"]["description"]
    parameters: ClassVar[dict[str, Any]] = tools_ref.READ_FILE["function"]["parameters"]

    def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        path = arguments["path"]
        if context.workdir is None:
            raise ToolFailure("this task has no files")
        real = resolve_below(context.workdir, path)
        if not real.exists():
            raise ToolFailure(f"no such file: {path}")
        if not real.is_file():
            raise ToolFailure(f"not a file: {path}")
        if real.stat().st_size > MAX_FILE_BYTES:
            raise ToolFailure(f"file is larger than {MAX_FILE_BYTES} bytes: {path}", ToolOutcome.resource_limit)
        return real.read_bytes().decode("utf-8", "replace").rstrip("\n")
