"""read_file: the text of a file below the task's directory, and nothing outside it.

Same schema as `tasks.tools_ref.read_file` and the same output for files that exist (the text
without trailing newlines; a missing file is 'error: no such file: <path>'). Absolute paths and
`..` are refused up front (outcome refused); the open itself is confined by the kernel
(`workspace.open_below`: openat2 with RESOLVE_BENEATH and no symlinks), so a symlink or a swap
of a path component by a concurrent writer cannot lead it out, and a file with other hard links
(which may be an outside file's) is not read.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import PurePosixPath
from typing import Any, ClassVar

from ...contracts import ToolOutcome
from ...tasks import tools_ref
from ..tool import Tool, ToolContext, ToolFailure
from ..workspace import open_below, read_at_most

MAX_FILE_BYTES = 1024 * 1024
"""Larger files are not read (outcome resource_limit); the model sees at most MAX_OUTPUT_CHARS anyway."""


def task_relative(path: str) -> PurePosixPath:
    """`path` as the model wrote it, made relative (whitespace and leading './' stripped), or
    ToolFailure(refused) when it is absolute or has a `..`: those never name a file of the task."""
    if "\0" in path:
        raise ToolFailure(f"no such file: {path}")
    clean = path.strip()
    while clean.startswith("./"):
        clean = clean[2:]
    pure = PurePosixPath(clean)
    if pure.is_absolute() or ".." in pure.parts:
        raise ToolFailure(f"path is outside the task directory: {path}", ToolOutcome.refused)
    return pure


class ReadFile(Tool):
    """Read a text file of the task (paths relative to the task directory; a leading './' is fine)."""

    name: ClassVar[str] = tools_ref.READ_FILE["function"]["name"]
    description: ClassVar[str] = tools_ref.READ_FILE["function"]["description"]
    parameters: ClassVar[dict[str, Any]] = tools_ref.READ_FILE["function"]["parameters"]

    def run(self, arguments: dict[str, Any], context: ToolContext) -> str:
        path = arguments["path"]
        if context.workdir is None:
            raise ToolFailure("this task has no files")
        relative = task_relative(path)
        if relative == PurePosixPath("."):
            raise ToolFailure(f"not a file: {path}")
        try:
            fd = open_below(context.workdir, relative)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                raise ToolFailure(f"no such file: {path}") from None
            if exc.errno == errno.ELOOP:
                raise ToolFailure(f"symbolic links are not followed: {path}", ToolOutcome.refused) from None
            if exc.errno == errno.EXDEV:
                raise ToolFailure(f"path is outside the task directory: {path}", ToolOutcome.refused) from None
            raise ToolFailure(f"cannot read {path}: {exc.strerror}") from None
        try:
            opened = os.fstat(fd)
            if not stat.S_ISREG(opened.st_mode):
                raise ToolFailure(f"not a file: {path}")
            if opened.st_nlink != 1:
                raise ToolFailure(f"a file with other hard links is not read: {path}", ToolOutcome.refused)
            data = read_at_most(fd, MAX_FILE_BYTES + 1)
        finally:
            os.close(fd)
        if len(data) > MAX_FILE_BYTES:
            raise ToolFailure(f"file is larger than {MAX_FILE_BYTES} bytes: {path}", ToolOutcome.resource_limit)
        return data.decode("utf-8", "replace").rstrip("\n")
